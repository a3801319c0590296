#!/usr/bin/env bash
# The one prepared GPU check (issue 18, part 6). Run from the repo root on a machine with one GPU:
#   OUT=/some/dir bash benchmarks/gpu/h200_check.sh          (budget: < 10 minutes on one H200)
#   DRY=1 OUT=/tmp/dry bash benchmarks/gpu/h200_check.sh     (CPU dry path: llama_tiny, 2 ranks, 3 steps)
# Everything at LLaMA-134M shapes (dim 768, 12 layers, vocab 32000, seq 512) in train.precision=bf16:
#   1. NCCL on a single rank: DDP, world 1 (NCCL initialises bound to its device, trains, reports);
#   2. 4 gloo ranks sharing the GPU (NCCL refuses two ranks on one device), each rank with its own CUDA
#      figures: DDP, FSDP, SDP forward masking (B-SDP, C=0.5) and SDP backward masking (C=0.5);
#   then $OUT/gpu_table.md: per run the allocator peak (max over ranks of cuda_max_allocated), the device
#   memory in use at the end (cuda_device_used_bytes from torch.cuda.mem_get_info: the WHOLE device, i.e.
#   all ranks sharing it + their communicators and CUDA contexts), tokens/s, step time, process groups;
#   and the issue's targets: SDP C=0.5 allocator peak <= 0.6x DDP's, device total <= 0.7x DDP's.
# Hydra/OmegaConf may be missing on the GPU machine: carried wheels in .whl/ go into /tmp/site first.
set -uo pipefail
OUT="${OUT:-/tmp/sdp_gpu_out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if ! $PY -c "import hydra" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" WANDB_MODE=disabled PYTHONUNBUFFERED=1
RUNS="$OUT/runs"; mkdir -p "$RUNS"; : > "$OUT/log.txt"
if [ -n "${DRY:-}" ]; then  # the same runs, CPU-sized: checks the script, the keys and the table
  DEV="cluster.device=cpu cluster.backend=gloo"; NCCL_DEV="$DEV"; WORLD=2; T=120
  MODEL="model=llama_tiny dataset=synthetic_text dataset.seq_len=32 train.batch_size=4 train.steps=3 train.warmup_steps=1"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" >> "$OUT/device.txt"
  DEV="cluster.device=cuda cluster.backend=gloo"; NCCL_DEV="cluster.device=cuda cluster.backend=nccl"; WORLD=4; T=110
  MODEL="model=llama_134m dataset=synthetic_text dataset.vocab_size=32000 dataset.seq_len=512 dataset.num_samples=512 train.batch_size=8 train.steps=12 train.warmup_steps=4"
fi
COMMON="$MODEL optim=adamw train.precision=bf16 train.eval_every=0 logger.wandb.mode=disabled logger.progress=false"
run() {  # run NAME overrides...: one sdp-train job with a time limit, its log appended to log.txt
  local name=$1; shift; local t0=$(date +%s)
  timeout "$T" $PY -m sdp.train hydra.run.dir="$RUNS/$name" $COMMON "$@" > "$RUNS/$name.log" 2>&1
  local rc=$?; echo "== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/log.txt"
  [ $rc -eq 0 ] || tail -25 "$RUNS/$name.log" >> "$OUT/log.txt"
}
run nccl_ddp_w1 parallelism=ddp cluster.world_size=1 $NCCL_DEV
run gloo_ddp parallelism=ddp cluster.world_size=$WORLD $DEV
run gloo_fsdp parallelism=fsdp cluster.world_size=$WORLD $DEV
run gloo_sdp_fwd parallelism=sdp parallelism.coverage=0.5 cluster.world_size=$WORLD $DEV
run gloo_sdp_bwd parallelism=sdp_block_bwd parallelism.coverage=0.5 cluster.world_size=$WORLD $DEV
$PY - "$RUNS" "$OUT" <<'PY'
import json, sys
from pathlib import Path
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
rows, allsum = {}, {}
MiB = 2**20
for d in sorted(p for p in runs.iterdir() if (p / "summary.json").exists()):
    s = json.loads((d / "summary.json").read_text()); allsum[d.name] = s
    mem = s["memory"]["per_rank"]
    groups = s.get("process_groups", {}).get("per_rank", [{}])
    rows[d.name] = {
        "ranks": s["world_size"], "precision": s.get("precision"),
        "alloc_peak": max(m.get("cuda_max_allocated_bytes", 0) for m in mem),
        "device_used": max(m.get("cuda_device_used_bytes", 0) for m in mem),
        "state": max(m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in mem),
        "acts": max(m.get("activation_bytes") or 0 for m in mem),
        "tokens_per_s": s["time"].get("tokens_per_s"), "step_s": s["time"]["step_s_median"],
        "groups": max(g.get("count", 0) for g in groups), "split": all(g.get("split_from_default") for g in groups),
    }
(out / "gpu_summaries.json").write_text(json.dumps(allsum, indent=1, default=str))
lines = ["| run | ranks | precision | allocator peak MiB (max rank) | device used MiB (whole GPU) | model state MiB | activations MiB | tokens/s | step s | groups/rank | NCCL split |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
for name, r in rows.items():
    lines.append(f"| {name} | {r['ranks']} | {r['precision']} | {r['alloc_peak'] / MiB:.0f} | {r['device_used'] / MiB:.0f} | "
                 f"{r['state'] / MiB:.0f} | {r['acts'] / MiB:.0f} | {r['tokens_per_s'] or 0:.0f} | {r['step_s']:.3f} | {r['groups']} | {r['split']} |")
ddp = rows.get("gloo_ddp")
for name in ("gloo_sdp_fwd", "gloo_sdp_bwd"):
    r = rows.get(name)
    if ddp and r and ddp["alloc_peak"] and ddp["device_used"]:
        a, t = r["alloc_peak"] / ddp["alloc_peak"], r["device_used"] / ddp["device_used"]
        lines.append(f"\n{name} / gloo_ddp: allocator peak {a:.2f}x (target <= 0.6), device used {t:.2f}x (target <= 0.7)")
(out / "gpu_table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
