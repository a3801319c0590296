#!/usr/bin/env bash
# One-GPU measurement check (issue 5), run by the lead on a lent GPU machine from the repo root:
#   OUT=/some/dir bash benchmarks/gpu_check.sh
# Needs python3 + torch + hydra-core/omegaconf/matplotlib (install the carried wheels first).
# (1) 4 gloo ranks sharing the GPU (cluster.device=cuda cluster.backend=gloo; device = local_rank % n_gpus):
#     ddp vs sdp vs fsdp on resnet18_cifar width 64, batch 64/rank, synthetic 32x32, then llama_134m on
#     synthetic_text; each rank records its own CUDA max allocated/reserved, MFU from the device table;
#     (2) one NCCL rank (world 1): DDP full model vs the world-1 SDP subnetwork is not meaningful (C=1),
#     so the NCCL check is a 1-rank DDP run, plus a 1-rank throughput figure for the full model.
# Writes at most 8 flat files under $OUT: the two rendered reports (md), their json, the NCCL summary,
# a log. Budget: under 6 minutes on an H200 (steps kept small).
set -uo pipefail
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONPATH=$PWD WANDB_MODE=disabled
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$LOG" 2>&1 || true
GPU="cluster.device=cuda cluster.backend=gloo train.warmup_steps=3 train.steps=12"
timeout 200 $PY benchmarks/report.py --suite resnet18 --runs ddp=ddp sdp=sdp fsdp=fsdp \
  --extra $GPU train.batch_size=64 --out "$WORK/resnet18" >>"$LOG" 2>&1 || echo "resnet18 report failed: $?" >>"$LOG"
timeout 150 $PY benchmarks/report.py --suite llama --runs ddp=ddp sdp=sdp fsdp=fsdp \
  --extra $GPU model=llama_134m dataset.seq_len=512 dataset.vocab_size=32000 train.batch_size=4 --out "$WORK/llama" >>"$LOG" 2>&1 \
  || echo "llama report failed: $?" >>"$LOG"
timeout 60 $PY -m sdp.train parallelism=ddp model=resnet18_cifar model.width=64 dataset=synthetic train.batch_size=256 \
  cluster.world_size=1 cluster.device=cuda cluster.backend=nccl train.steps=20 train.warmup_steps=5 train.eval_every=0 \
  logger.wandb.mode=disabled logger.progress=false hydra.run.dir="$WORK/nccl1" >>"$LOG" 2>&1 || echo "nccl world-1 run failed: $?" >>"$LOG"
for s in resnet18 llama; do
  cp "$WORK/$s/report.md" "$OUT/report_$s.md" 2>/dev/null
  cp "$WORK/$s/report.json" "$OUT/report_$s.json" 2>/dev/null
done
cp "$WORK/resnet18/memory.png" "$OUT/memory_resnet18.png" 2>/dev/null
cp "$WORK/nccl1/summary.json" "$OUT/summary_nccl_world1.json" 2>/dev/null
ls -la "$OUT" >>"$LOG"
