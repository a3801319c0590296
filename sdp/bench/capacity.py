"""Capacity at a fixed per-rank memory budget: the largest LLaMA (depth first, then width) that each
strategy trains for 5 steps. No peer suite reports this; it is what people pick SDP for.

Every trial is the worker's own path (strategy from the registry, ``build_model`` with the strategy's
meta flag, ``setup``, then ``train_step`` on the trainer's data order) on 4 spawned gloo ranks, under
the CPU live-tensor tracker (:mod:`sdp.metrics.live`). A trial fits when no rank's live tensor bytes
ever passed the budget: exactly where ``memory.budget_mb`` makes the tracker raise
``MemoryBudgetExceeded`` in ``sdp-train``; here the peak is compared after the 5 steps and the
verdict agreed over ranks (MAX all-reduce), so one rank's overflow does not leave the others waiting
in a collective. On a GPU (``--device cuda``) the limit is ``torch.cuda.set_per_process_memory_fraction``
and a trial fits when no rank raised ``torch.OutOfMemoryError``.

Search per strategy: depth 4, 8, 16, ... at ``--width`` until a failure, bisection between the last
fit and the first failure, then width in steps of ``--width-step`` at that depth.

    sdp-bench capacity --budget-mb 24 --out benchmarks/results/cpu-4ranks/capacity
    sdp-bench capacity --render-only --out benchmarks/results/cpu-4ranks/capacity   # table and plot again

The ranks are started by :func:`sdp.bench.runs.spawn_ranks`; the table is
:func:`sdp.report.compare.capacity_markdown`.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdp.bench.runs import ROOT, compose, parser, recorded, spawn_ranks
from sdp.core.fields import choices_of
from sdp.driver.schema import LocalCluster
from sdp.report.compare import capacity_markdown
from sdp.results.contract import provenance

STRATEGIES = {
    "ddp": ["parallelism=ddp"],
    "ddp_ac": ["parallelism=ddp_ac"],
    "fsdp": ["parallelism=fsdp"],
    "sdp_fwd_c50": ["parallelism=sdp", "parallelism.coverage=0.5"],
    "sdp_bwd_c50": ["parallelism=sdp_block_bwd", "parallelism.coverage=0.5"],
    "sdp_fwd_c25": ["parallelism=sdp", "parallelism.coverage=0.25"],
    "sdp_bwd_c25": ["parallelism=sdp_block_bwd", "parallelism.coverage=0.25"],
}
COMMON = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=64", "optim=adamw", "train.batch_size=8",
          "model.n_kv_heads=null", "logger.wandb.mode=disabled"]
STEPS = 5


class _NoTimer:
    from contextlib import nullcontext as _null

    def phase(self, _name: str):  # noqa: ANN201
        return self._null()


def model_overrides(*, depth: int, width: int) -> list[str]:
    hidden = 32 * round(width * 8 / 3 / 32)  # LLaMA's 8/3 dim, a multiple of 32 (splittable)
    return [f"model.n_layers={depth}", f"model.dim={width}", f"model.hidden={hidden}", f"model.n_heads={max(width // 32, 1)}"]


def trial(*, overrides: list[str], rank: int, world: int, budget: int, device: torch.device) -> tuple[bool, int, int]:
    """(fits on every rank, largest rank peak bytes, parameter count of the full model); ``device``: this
    rank's, from :func:`rank_device`."""
    from sdp.data.base import GlobalBatchSampler
    from sdp.metrics.live import LiveTensorTracker
    from sdp.models.base import count_params
    from sdp.parallel import STRATEGIES as REGISTRY, DistContext, JobFacts
    from sdp.core.loss import loss_fn
    from sdp.rank.worker import build_model
    from sdp.registry import build

    cfg = compose([*overrides, f"cluster.world_size={world}", f"cluster.device={device.type}"])
    data = build(cfg.dataset)
    with torch.device("meta"):
        n_params = count_params(build(cfg.model))
    dev = device
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=dev, backend="gloo")
    sampler = GlobalBatchSampler(num_samples=len(data.train), global_batch=int(cfg.train.batch_size) * world, seed=0)
    x_all, y_all = data.train.tensors
    sampler.indices(0)  # the epoch's permutation, drawn before the tracker: host-side work (sdp.rank.device_batches)
    tracker = LiveTensorTracker(device_type=dev.type) if dev.type == "cpu" else None
    ok, peak = True, 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        with tracker if tracker is not None else nullcontext():
            strategy = REGISTRY.get(str(cfg.parallelism.name)).runtime(cfg=cfg.parallelism, job=JobFacts.of(cfg), ctx=ctx)
            model = build_model(cfg, data, meta=strategy.materialises_held)
            strategy.checkpoint_blocks(model=model)
            strategy.setup(model=model, optimizer_factory=lambda params: build(cfg.optim.optimizer)(params))
            for step in range(STEPS):
                idx = sampler.shard(step, replica=rank, replicas=world)
                strategy.train_step(inputs=x_all[idx].to(dev), targets=y_all[idx].to(dev), loss_fn=loss_fn,
                                    timer=_NoTimer(), step=step)
            del strategy, model
    except torch.OutOfMemoryError:  # CUDA: the allocator refused past the memory fraction
        ok = False
    gc.collect()
    peak = tracker.peak if tracker is not None else int(torch.cuda.max_memory_allocated(dev))
    flag = torch.tensor([peak, 0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    peak_max, failed = int(flag[0]), bool(flag[1])
    return (not failed and peak_max <= budget), peak_max, n_params


def search(*, name: str, rank: int, world: int, device: torch.device, args: argparse.Namespace,
           log: list[dict[str, Any]]) -> dict[str, Any]:
    budget = int(args.budget_mb * 2**20)
    base = [*COMMON, *STRATEGIES[name]]

    def run(depth: int, width: int) -> bool:
        t0 = time.perf_counter()
        ok, peak, n = trial(overrides=[*base, *model_overrides(depth=depth, width=width)], rank=rank, world=world,
                            budget=budget, device=device)
        log.append({"strategy": name, "depth": depth, "width": width, "params": n, "peak_bytes": peak, "fits": ok,
                    "seconds": time.perf_counter() - t0})
        if rank == 0:
            print(f"  {name:12s} depth {depth:3d} width {width:4d} params {n / 1e6:7.3f} M peak {peak / 2**20:8.2f} MiB "
                  f"{'fits' if ok else 'over'}", flush=True)
        return ok

    good, bad, d = 0, None, args.min_depth
    while d <= args.max_depth:
        if run(d, args.width):
            good, d = d, d * 2
        else:
            bad = d
            break
    hi = bad if bad is not None else args.max_depth + 1
    while good and hi - good > 1:
        mid = (good + hi) // 2
        good, hi = (mid, hi) if run(mid, args.width) else (good, mid)
    best = {"strategy": name, "depth": good, "width": args.width if good else 0}
    if good:
        w = args.width + args.width_step
        while w <= args.max_width and run(good, w):
            best["width"], w = w, w + args.width_step
    fit = [e for e in log if e["strategy"] == name and e["fits"] and e["depth"] == best["depth"] and e["width"] == best["width"]]
    best["params"] = fit[0]["params"] if fit else 0
    best["peak_bytes"] = fit[0]["peak_bytes"] if fit else None
    return best


def rank_device(*, local_rank: int, device: str, budget_mb: float) -> torch.device:
    """This rank's device as ``sdp-train`` picks it (:func:`sdp.rank.worker.resolve_device`, ranks wrapping
    around the visible GPUs), made the current CUDA device as the worker does: without ``set_device``
    every rank's FSDP mesh and NCCL/gloo CUDA work lands on cuda:0 of a multi-GPU host. On CUDA the
    budget becomes the allocator's memory fraction."""
    from omegaconf import OmegaConf

    from sdp.rank.worker import resolve_device

    dev, _ = resolve_device(OmegaConf.create({"device": device, "backend": "gloo"}), local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(budget_mb * 2**20 / total, 1.0), dev)
    return dev


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every strategy's search on this rank (each trial's verdict is agreed over ranks, so all ranks agree)."""
    dev = rank_device(local_rank=rank, device=args.device, budget_mb=args.budget_mb)
    log: list[dict[str, Any]] = []
    best = [search(name=n, rank=rank, world=world, device=dev, args=args, log=log) for n in args.strategies]
    return {"best": best, "trials": log}


def render(result: dict[str, Any], *, out: Path) -> str:
    """The table (returned) and ``capacity.png`` from a result and the arguments it recorded."""
    args = argparse.Namespace(**result["args"])
    text = capacity_markdown(title=f"capacity: budget {args.budget_mb:g} MiB per rank, {args.world} ranks, LLaMA (vocab 256, "
                             f"seq 64, batch 8 per rank, AdamW), {STEPS} steps; depth first at width {args.width}, then width",
                             best=result["best"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = [b["strategy"] for b in result["best"]]
        ax.bar(names, [b["params"] / 1e6 for b in result["best"]], color="tab:blue")
        ax.set_ylabel("largest model trained (M params)")
        ax.set_title(f"capacity at {args.budget_mb:g} MiB per rank ({args.world} CPU ranks)")
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(out / "capacity.png", dpi=120)
    except ImportError:  # pragma: no cover - matplotlib is a dependency of the report
        pass
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(suite="capacity", doc=__doc__)
    ap.add_argument("--budget-mb", type=float, default=24.0, help="per-rank live tensor budget (MiB)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--width", type=int, default=64, help="model.dim during the depth search")
    ap.add_argument("--width-step", type=int, default=32)
    ap.add_argument("--min-depth", type=int, default=4, help="first depth tried (SDP plans need a unit per worker)")
    ap.add_argument("--max-depth", type=int, default=64)
    ap.add_argument("--max-width", type=int, default=512)
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--device", default="cpu", choices=choices_of(LocalCluster, "device"))
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "capacity")
    ap.add_argument("--render-only", action="store_true", help="table and plot again from --out/capacity.json")
    args = ap.parse_args(argv)
    raw = args.out / "capacity.json"
    result = recorded(raw, render_only=args.render_only, what="the trials")
    if result is None:
        at_start = provenance()  # the tree the trials ran from
        args.out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        result = spawn_ranks(_rank, world=args.world, args=(args,))[0]
        result["seconds"] = time.perf_counter() - t0
        result.update(at_start)
        result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "render_only"}
        raw.write_text(json.dumps(result, indent=2))
    text = render(result, out=args.out)
    (args.out / "capacity.md").write_text(text + "\n")
    print(text, flush=True)
    print(f"total {result['seconds']:.0f} s", flush=True)
    return result

