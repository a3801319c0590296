#!/usr/bin/env bash
# One prepared GPU check (run from the repo root on a machine with python3 + torch + one or more GPUs):
#   1. NCCL: a 1-rank DDP job with cluster.device=cuda (NCCL initialises, trains, reports CUDA memory);
#   2. several gloo ranks sharing one GPU (NCCL refuses two ranks on one device): DDP vs SDP variants vs
#      DDP+AC on ResNet-18 (width 64, CIFAR shapes) and DDP vs SDP on LLaMA-134M shapes, each rank
#      reporting its own CUDA max allocated / reserved bytes and step time;
# then collects every summary into $OUT/gpu_summaries.json and a table $OUT/gpu_table.md.
# Hydra/OmegaConf may be missing there: carried wheels in .whl/ are installed into /tmp/site first.
set -uo pipefail
OUT="${OUT:-/tmp/sdp_gpu_out}"; mkdir -p "$OUT"
if ! python3 -c "import hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" WANDB_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" >> "$OUT/device.txt"
RUNS="$OUT/runs"; mkdir -p "$RUNS"; : > "$OUT/log.txt"
run() {  # run NAME overrides...: one sdp-train job, its log appended to log.txt
  local name=$1; shift; local t0=$(date +%s)
  timeout 150 python3 -m sdp.train hydra.run.dir="$RUNS/$name" logger.wandb.mode=disabled logger.progress=false \
      cluster.device="${DEVICE:-cuda}" train.eval_every=0 "$@" > "$RUNS/$name.log" 2>&1
  local rc=$?; echo "== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
  [ $rc -eq 0 ] || tail -25 "$RUNS/$name.log" >> "$OUT/log.txt"
}
RESNET="model=resnet18_cifar model.width=64 dataset=synthetic dataset.num_samples=4096 train.batch_size=64 train.steps=25 train.warmup_steps=5"
run nccl_ddp_w1 $RESNET parallelism=ddp cluster.world_size=1 cluster.backend=nccl
for s in ddp sdp sdp_block_bwd sdp_neuron_fwd ddp_ac; do
  run resnet_${s}_gloo4 $RESNET parallelism=$s cluster.world_size=4 cluster.backend=gloo
done
LLAMA="model=llama_134m dataset=synthetic_text dataset.vocab_size=32000 dataset.seq_len=512 dataset.num_samples=512 optim=adamw train.batch_size=8 train.steps=15 train.warmup_steps=5"
for s in ddp sdp; do
  run llama134m_${s}_gloo4 $LLAMA parallelism=$s cluster.world_size=4 cluster.backend=gloo
done
python3 - "$RUNS" "$OUT" <<'PY'
import json, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
rows, allsum = [], {}
for d in sorted(p for p in runs.iterdir() if (p / "summary.json").exists()):
    s = json.loads((d / "summary.json").read_text()); allsum[d.name] = s
    mem = s["memory"]["per_rank"]
    state = max(m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in mem)
    alloc = max(m.get("cuda_max_allocated_bytes", 0) for m in mem)
    rows.append((d.name, s["world_size"], state / 2**20, alloc / 2**20,
                 max(c["bytes_per_step"] for c in s["comm"]["per_rank"]) / 2**20,
                 s["time"]["step_s_median"], s["time"]["samples_per_s"], s["time"]["straggler_spread"]))
(out / "gpu_summaries.json").write_text(json.dumps(allsum, indent=1, default=str))
lines = ["| run | ranks | model state MiB (max rank) | CUDA max allocated MiB (max rank) | comm MiB/step | step s | samples/s | straggler |",
         "|---|---|---|---|---|---|---|---|"]
lines += [f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.4f} | {r[6]:.1f} | {r[7]:.3f} |" for r in rows]
(out / "gpu_table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
