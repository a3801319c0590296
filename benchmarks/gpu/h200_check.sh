#!/usr/bin/env bash
# The one prepared one-GPU check. From a fresh checkout of main, repo root, one GPU, under 8 minutes:
#   bash benchmarks/gpu/h200_check.sh                      (results: benchmarks/results/gpu/h200_check.md)
#   RESULTS_DIR=/some/dir bash benchmarks/gpu/h200_check.sh (results elsewhere, e.g. a folder that is copied back)
#   DRY_RUN=1 bash benchmarks/gpu/h200_check.sh            (the same commands at tiny sizes on CPU gloo ranks;
#                                                            results in a temporary folder unless RESULTS_DIR is set)
#   WHEELS=dir bash benchmarks/gpu/h200_check.sh           (a machine without a package index, such as the lent
#                                                            H200: the wheels of `bash benchmarks/gpu/wheels.sh dir`)
#   ONLY="bn trace" bash benchmarks/gpu/h200_check.sh      (only the named items: groups lm memory fsdp ac bn det trace;
#                                                            for a session with little device time left)
# The package itself is imported from the checkout (PYTHONPATH), never installed there. With WHEELS, its missing
# dependencies (benchmarks/gpu/wheels.txt) are installed from that folder alone (--no-index --no-deps, into a
# folder of their own); without it, the README's command (`pip install -e .`) runs only when they do not import.
# W&B and submitit are not needed: a run imports them only when it logs to W&B or launches on Slurm.
# Results: RESULTS_DIR holds two files, h200_check.md and runs-<stamp>.tar.gz (every run's config, summary, metrics,
# plan and log, checkpoints left out), re-packed after each run, so the folder can be copied back whole (the
# device tool returns at most 8 files, 2 folders deep).
# Every run is bounded: `timeout -k` (SIGTERM, then SIGKILL to the whole process group, ranks included) and a total
# deadline (TOTAL_S, default 450 s) that shortens or skips the last runs. Each run's row is appended to the results
# file as soon as it ends, and each check's verdict as soon as its runs exist: a kill loses only what had not run.
#
# What one GPU can check (the issue's items), in this order:
#   - the plan's floor for the memory target: at LLaMA-134M shapes the stem and head (49.2 M of 134.1 M parameters)
#     are held by every SDP rank, so SDP C=0.5 cannot hold less than ~0.68x of DDP's model state; the script
#     computes the floor from sdp-plan for the exact config (floor.json), not from a constant;
#   - NCCL at world size 1: the communicator life cycle of an SDP re-draw (split, all-reduce, destroy, split again:
#     nccl_groups.py), and DDP initialises bound to its device and trains (LLaMA-134M, bf16);
#   - step time, tokens/s and MFU of DDP's whole model and of one SDP C=0.5 worker's compute (the same model with
#     half its blocks), each alone on the GPU at world size 1;
#   - measured against predicted peaks (set-up, train, eval) for DDP, FSDP and SDP: sdp-plan run before each run
#     with the run's own overrides;
#   - device-memory figures: cuda_max_reserved_bytes is the run's maximum and cuda_device_used_bytes the largest
#     use seen (allocated <= reserved <= device used, on every rank);
#   - TF32 recorded: summary.json backends.tf32_matmul;
#   - the memory target: 4 gloo ranks sharing the GPU (each with its own CUDA figures): DDP vs SDP C=0.5 model
#     state against the plan's floor, and the allocator peaks;
#   - FSDP set-up peak: 4 gloo ranks, FSDP built on meta holds one rank's shards plus one module, never the
#     full fp32 model (set-up peak < DDP's parameter bytes);
#   - activation checkpointing under bf16 (DDP+AC, 4 gloo ranks sharing the GPU): its training peak over DDP's,
#     measured against the same ratio of sdp-plan's predictions (checkpointed blocks run without autocast's
#     weight-cast cache, which the plan emulates: a prediction until this runs), and its peaks against the plan;
#   - stale BatchNorm statistics after the move to the GPU: SDP at C=1 (world 1, NCCL) with eval.bn=average
#     evaluates like DDP (ResNet-18 width 16), both with train.deterministic=true and train.tf32=false: with TF32
#     on, the two runs' step-1 losses already differed (3.6e-5, identical weights: a different cuDNN kernel) and
#     30 steps amplified it to a 2 % eval gap, which says nothing about the statistics;
#   - where the plan's train peak and CUDA's part (peak_trace.py): the rehearsal's two steps of the LM on CUDA under
#     real autocast and on meta under the plan's emulation, live bytes op by op, the first gaps printed;
#   - deterministic mode on CUDA: train.deterministic=true either trains or is refused before any rank starts
#     (never raises inside the ranks at the first step).
# Not checkable on one GPU: NCCL sub-communicators of several ranks (and their split_share), because NCCL refuses
# two ranks on one device; those need a node with at least 2 GPUs (cluster.device=cuda, world >= 2). The results
# end with the list of figures that mean nothing when ranks share one GPU (rows.py caveats).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
START=$(date +%s); TOTAL_S="${TOTAL_S:-450}"
if [ -n "${DRY_RUN:-}" ]; then RESULTS_DIR="${RESULTS_DIR:-$(mktemp -d)}"; else RESULTS_DIR="${RESULTS_DIR:-benchmarks/results/gpu}"; fi
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
RESULTS="$RESULTS_DIR/h200_check.md"; WORK="${WORK_DIR:-$(mktemp -d)}"; RUNS="$WORK/$STAMP"; mkdir -p "$RUNS" "$RESULTS_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
if [ -n "${WHEELS:-}" ]; then  # no package index: wheels.sh's wheels, nothing else, into a folder of their own
  ls "$WHEELS"/*.whl > /dev/null 2>&1 || { echo "WHEELS=$WHEELS holds no .whl (make them: bash benchmarks/gpu/wheels.sh DIR)"; exit 2; }
  SITE="$WORK/site"
  timeout -k 5 120 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    || { echo "install from WHEELS=$WHEELS failed (--no-index --no-deps --target $SITE)"; exit 2; }
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if ! $PY -c "import sdp.driver.train, hydra, omegaconf, torch" 2>/dev/null; then
  [ -z "${WHEELS:-}" ] || { echo "sdp does not import with WHEELS=$WHEELS: $($PY -c 'import sdp.driver.train' 2>&1 | tail -1)"; exit 2; }
  timeout -k 5 240 $PY -m pip install -q -e . || { echo "install failed: $PY -m pip install -e . (without a package index: WHEELS=<dir of benchmarks/gpu/wheels.sh>)"; exit 2; }
fi
pack() { tar -czf "$RESULTS_DIR/runs-$STAMP.tar.gz" -C "$WORK" --exclude='*.pt' --exclude='checkpoints' "$STAMP"; }
ROWS() { timeout -k 5 30 $PY benchmarks/gpu/rows.py --results "$RESULTS" --runs "$RUNS" "$@"; }
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

if [ -n "${DRY_RUN:-}" ]; then  # the same runs, CPU-sized
  GPU="cluster.device=cpu cluster.backend=gloo"; NCCL="$GPU"; W=2; T=120; TOTAL_S="${TOTAL_S_DRY:-900}"
  LM="model=llama_tiny dataset=synthetic_text dataset.seq_len=32 dataset.num_samples=64 dataset.num_val=16 train.batch_size=4 train.steps=3 train.warmup_steps=1"
  LM_SMALL="$LM"
  BN="model=resnet18_cifar model.width=4 dataset=synthetic dataset.image_size=8 train.batch_size=8 train.steps=4 train.warmup_steps=1"
  DEVICE="cpu (dry run)"; NCCL_GROUPS="--device cpu --backend gloo"
else
  GPU="cluster.device=cuda cluster.backend=gloo"; NCCL="cluster.device=cuda cluster.backend=nccl"; W=4; T=100
  LM="model=llama_134m dataset=synthetic_text dataset.vocab_size=32000 dataset.seq_len=512 dataset.num_samples=256 dataset.num_val=32 train.batch_size=8 train.steps=8 train.warmup_steps=3"
  LM_SMALL="model=llama_tiny dataset=synthetic_text dataset.seq_len=512 dataset.num_samples=64 dataset.num_val=16 train.batch_size=8 train.steps=5 train.warmup_steps=1"
  BN="model=resnet18_cifar model.width=16 dataset=synthetic dataset.image_size=32 train.batch_size=64 train.steps=30 train.warmup_steps=3"
  NCCL_GROUPS="--device cuda --backend nccl"
  DEVICE=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)
fi
LM_MODEL=$(printf '%s\n' $LM | sed -n 's/^model=//p')  # one C=0.5 worker's compute: the model with half its blocks
HALF_LAYERS=$($PY -c "from omegaconf import OmegaConf as O; print(O.load('conf/model/$LM_MODEL.yaml').n_layers // 2)")
COMMON="train.eval_every=0 eval.subnetworks=false logger.wandb.mode=disabled logger.progress=false"
LM_RUN="$LM optim=adamw train.precision=bf16 $COMMON"
TORCH=$($PY -c "import torch; print(torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -1)
if COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT+dirty"; else COMMIT="(not a git checkout)"; fi
ROWS header --title "$STAMP ${DRY_RUN:+DRY RUN }commit $COMMIT" --line "device: $DEVICE; torch $TORCH; runs: $RUNS" \
  --line "time limit per run ${T}s (timeout -k 10), total ${TOTAL_S}s"

run() {  # run NAME overrides...: one sdp-train job, bounded; its row appended at once
  local name=$1; shift
  local t=$T rest; rest=$(left)
  if [ $(( rest - 15 )) -lt "$t" ]; then t=$(( rest - 15 )); fi
  if [ "$t" -lt 20 ]; then ROWS row --name "$name" --rc skipped --secs 0; echo "== $name skipped (total time)"; return; fi
  local t0; t0=$(date +%s)
  timeout -k 10 "$t" $PY -m sdp.driver.train hydra.run.dir="$RUNS/$name" "$@" > "$RUNS/$name.log" 2>&1
  local rc=$?
  ROWS row --name "$name" --rc "$rc" --secs "$(( $(date +%s) - t0 ))"
  pack
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"
}
planned() {  # planned NAME overrides...: sdp-plan's prediction for the run (NAME.plan.json), then the run
  local name=$1
  timeout -k 5 120 $PY benchmarks/gpu/rows.py --results "$RESULTS" --runs "$RUNS" plan --name "$@" > "$RUNS/$name.plan.log" 2>&1 || echo "plan of $name failed: $(tail -1 "$RUNS/$name.plan.log")" | tee -a "$RESULTS"
  run "$@"
}
verdict() { timeout -k 5 20 $PY benchmarks/gpu/rows.py --results "$RESULTS" --runs "$RUNS" verdict "$@"; }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }  # want ITEM: ONLY unset, or ITEM named in it

SDP_HALF="parallelism=sdp parallelism.coverage=0.5"
if want groups; then
  timeout -k 5 90 $PY benchmarks/gpu/nccl_groups.py $NCCL_GROUPS --out "$RUNS/nccl_groups.json" > "$RUNS/nccl_groups.log" 2>&1
  ROWS groups
fi
if want lm; then
  run nccl_ddp_lm_w1 parallelism=ddp cluster.world_size=1 $NCCL $LM_RUN
  verdict tf32 nccl_ddp_lm_w1
  run nccl_ddp_lm_half_w1 parallelism=ddp cluster.world_size=1 $NCCL $LM_RUN model.n_layers=$HALF_LAYERS
  verdict mfu nccl_ddp_lm_w1 nccl_ddp_lm_half_w1
fi
if want memory; then
  planned gloo_ddp_lm parallelism=ddp cluster.world_size=$W $GPU $LM_RUN
  planned gloo_sdp_lm $SDP_HALF cluster.world_size=$W $GPU $LM_RUN
  ROWS floor --ddp gloo_ddp_lm --sdp gloo_sdp_lm $LM_RUN cluster.world_size=$W $GPU > "$RUNS/floor.log" 2>&1 \
    || echo "floor failed: $(tail -3 "$RUNS/floor.log")" | tee -a "$RESULTS"
  verdict memory gloo_ddp_lm gloo_sdp_lm
fi
if want fsdp; then
  planned gloo_fsdp_lm parallelism=fsdp cluster.world_size=$W $GPU $LM_RUN
  verdict fsdp_setup gloo_ddp_lm gloo_fsdp_lm
  verdict peaks gloo_ddp_lm gloo_fsdp_lm gloo_sdp_lm
  [ -n "${DRY_RUN:-}" ] || verdict device_figures nccl_ddp_lm_w1 gloo_ddp_lm gloo_sdp_lm gloo_fsdp_lm
fi
if want ac; then  # DDP's memory run is the reference (item memory; missing: the verdict says n/a)
  planned gloo_ddp_ac_lm parallelism=ddp_ac cluster.world_size=$W $GPU $LM_RUN
  verdict peaks gloo_ddp_ac_lm
  verdict ac gloo_ddp_lm gloo_ddp_ac_lm
fi
if want bn; then  # exact arithmetic, so that only the statistics can differ (the header says why)
  EXACT="train.deterministic=true train.tf32=false"
  run nccl_ddp_bn_w1 parallelism=ddp cluster.world_size=1 $NCCL $BN eval.bn=average $EXACT $COMMON
  run nccl_sdp_bn_w1 parallelism=sdp parallelism.coverage=1.0 cluster.world_size=1 $NCCL $BN eval.bn=average $EXACT $COMMON
  verdict bn nccl_ddp_bn_w1 nccl_sdp_bn_w1
fi
if want det; then
  run nccl_det_w1 parallelism=ddp cluster.world_size=1 $NCCL $LM_SMALL train.deterministic=true $COMMON
  verdict deterministic nccl_det_w1
fi
if want trace; then  # the plan's train step against the device's, op by op (peak_trace.py)
  TRACE_DEV=cuda; [ -z "${DRY_RUN:-}" ] || TRACE_DEV=cpu
  TR=$(printf '%s ' $LM optim=adamw train.precision=bf16)
  timeout -k 5 120 $PY benchmarks/gpu/peak_trace.py --device $TRACE_DEV --out "$RUNS/trace_$TRACE_DEV.json" $TR > "$RUNS/trace.log" 2>&1 \
    && timeout -k 5 120 $PY benchmarks/gpu/peak_trace.py --device meta --target $TRACE_DEV --out "$RUNS/trace_meta.json" $TR >> "$RUNS/trace.log" 2>&1 \
    && { echo; echo '```'; echo "peak_trace ($TRACE_DEV vs the plan's meta rehearsal): $TR"; \
         timeout -k 5 60 $PY benchmarks/gpu/peak_trace.py --compare "$RUNS/trace_$TRACE_DEV.json" "$RUNS/trace_meta.json"; echo '```'; } >> "$RESULTS" \
    || echo "trace failed: $(tail -3 "$RUNS/trace.log")" | tee -a "$RESULTS"
  pack
fi
ROWS caveats
pack
echo "total $(( $(date +%s) - START ))s; results: $RESULTS and $RESULTS_DIR/runs-$STAMP.tar.gz" | tee -a "$RESULTS"
