#!/usr/bin/env bash
# CI: start the single-node test cluster, run the Slurm test tier, stop the cluster (also on failure).
# Usage (as root, from anywhere):  bash slurm/local/ci.sh [extra pytest args]
# Env: PYTHON (interpreter with sdp and the test extra; default: python3), plus start.sh's knobs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
finish() {  # let jobs that are still exiting end (a job stopped with the daemons is restored next start), then stop
  for _ in $(seq 1 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
  scancel --user="$(id -un)" 2>/dev/null || true
  bash "$HERE/stop.sh" >/dev/null 2>&1 || true
}
trap finish EXIT
bash "$HERE/start.sh"
cd "$ROOT"
t0=$(date +%s)
WANDB_MODE=disabled "$PYTHON" -m pytest -m slurm tests/test_slurm.py -q "$@"
echo "[slurm] Slurm tests took $(( $(date +%s) - t0 ))s"
