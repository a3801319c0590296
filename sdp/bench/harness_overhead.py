"""What the suite's harness costs: its DDP step time against a minimal hand-written torch DDP loop on
the same model, batch, data order and optimizer (issue 18, part 5; target ratio <= 1.05).

The suite run is a real ``sdp-train`` job (``parallelism=ddp``: phase timer, comm hook counting every
bucket, the per-step loss/NaN all-reduce, logging, peak-memory and activation meters). The minimal
loop spawns the same number of gloo ranks, builds the model with the suite's own ``build_model``
(same class, same seed, same init), takes every step's batch from the suite's ``GlobalBatchSampler``
(same samples per rank and step), wraps it in plain ``DistributedDataParallel`` with the suite's
bucket settings and runs forward, backward, SGD step, timing each step with ``perf_counter`` only.
Both report the max over ranks of each rank's median step time over the steps after warm-up; the
minimal loop also uses one thread per rank as the suite does on this machine (cores / ranks).
The ordering (suite, suite without tracker, minimal, ...) alternates ``--repeats`` times.

Two minimal arms: ``minimal`` makes the host allocator setting the suite's trainer makes on CPU
(:func:`sdp.rank.hostmem.retain_freed_memory`; the ratio's denominator, so the suite gains nothing the loop
lacks), ``minimal_default_malloc`` runs with glibc's defaults, for the record.

Two suite arms: the default config (``memory.tracker=true``: the live-tensor tracker, a dispatch mode
that sees every op, counts the CPU peaks) and ``memory.tracker=false``, which is how the suite's timing
runs are configured (``conf/experiment/cpu_study_*.yaml``: the peaks come from separate short runs). The
tracker is a measurement tool, not part of the step; the ratio without it is the harness's cost to a
timing run, the one with it what a default run pays for its memory figures. Both are reported, with
each side's phase medians (forward, backward, optimizer), so a gap can be told apart by phase.

    flock /tmp/sdp-cpu.lock sdp-bench harness-overhead
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sdp.bench.runs import ROOT, compose, parser, run_one, spawn_ranks
from sdp.results.contract import provenance

COMMON = ["model=resnet18_cifar", "model.width=32", "dataset=synthetic", "dataset.image_size=32", "train.batch_size=32",
          "cluster.world_size=2", "train.steps=16", "train.warmup_steps=4", "train.eval_every=0",
          "logger.wandb.mode=disabled", "logger.progress=false", "optim=sgd"]


def _minimal_rank(rank: int, world: int, config: dict, retain: bool) -> dict[str, Any]:
    """One rank of the hand-written loop: its median step and phase times after warm-up, its last loss."""
    from omegaconf import OmegaConf
    from torch.nn.functional import cross_entropy
    from torch.nn.parallel import DistributedDataParallel

    from sdp.data.base import GlobalBatchSampler
    from sdp.rank.worker import build_model
    from sdp.registry import build

    cfg = OmegaConf.create(config)
    data = build(cfg.dataset)
    model = build_model(cfg, data)
    ddp = DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=25, gradient_as_bucket_view=True)
    oc = cfg.optim.optimizer
    opt = torch.optim.SGD(ddp.parameters(), lr=float(oc.lr), momentum=float(oc.get("momentum", 0.0)),
                          nesterov=bool(oc.get("nesterov", False)), weight_decay=float(oc.get("weight_decay", 0.0)))
    sampler = GlobalBatchSampler(num_samples=len(data.train), global_batch=int(cfg.train.batch_size) * world, seed=int(cfg.seed))
    x_all, y_all = data.train.tensors
    if retain:  # the host allocator setting the suite's trainer makes on CPU (sdp/rank/hostmem.py)
        from sdp.rank.hostmem import retain_freed_memory

        retain_freed_memory()
    times: list[list[float]] = []  # per step: total, forward, backward, optimizer
    for step in range(int(cfg.train.steps)):
        t0 = time.perf_counter()
        idx = sampler.shard(step, replica=rank, replicas=world)
        x, y = x_all[idx], y_all[idx]
        t1 = time.perf_counter()
        loss = cross_entropy(ddp(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t4 = time.perf_counter()
        times.append([t4 - t0, t2 - t1, t3 - t2, t4 - t3])
    kept = times[int(cfg.train.warmup_steps):]
    return {"step": statistics.median(t[0] for t in kept),
            "phases": {k: statistics.median(t[i] for t in kept) for i, k in enumerate(PHASES, start=1)},
            "last_loss": float(loss.detach())}


PHASES = ("forward", "backward", "optimizer")


def _mean_phases(ranks: list[dict[str, float]]) -> dict[str, float]:
    """Mean over ranks of each rank's phase median (as :mod:`sdp.bench.overlap` reads summary.json)."""
    return {k: statistics.mean(r.get(k, 0.0) for r in ranks) for k in PHASES}


def minimal(config: dict, *, world: int, out: Path, retain: bool) -> dict[str, Any]:
    """The hand-written loop on ``world`` ranks (threads per rank as the suite on this machine), written to ``out``."""
    ranks = spawn_ranks(_minimal_rank, world=world, args=(config, retain), threads=max(1, (os.cpu_count() or 1) // world))
    gathered = [{"step": r["step"], "phases": r["phases"]} for _, r in sorted(ranks.items())]
    result = {"step_s_median": max(g["step"] for g in gathered), "per_rank": gathered,
              "phases_s_median": _mean_phases([g["phases"] for g in gathered]), "last_loss": ranks[0]["last_loss"]}
    out.write_text(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(suite="harness-overhead", doc=__doc__)
    ap.add_argument("--common", nargs="*", default=COMMON)
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "harness")
    args = ap.parse_args(argv)
    at_start = provenance()  # the tree the runs start from
    common = [*args.common, *args.extra]
    from omegaconf import OmegaConf

    cfg = compose([*common, "parallelism=ddp"])
    config = OmegaConf.to_container(cfg, resolve=True)
    world = int(cfg.cluster.world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    arms: dict[str, list[dict[str, Any]]] = {"suite": [], "suite_no_tracker": [], "minimal": [], "minimal_default_malloc": []}
    for i in range(args.repeats):
        for arm, extra in (("suite", []), ("suite_no_tracker", ["memory.tracker=false"])):
            s = run_one(label=f"{arm}{i}", spec="ddp", common=[*common, *extra], out=args.out)
            arms[arm].append({"step_s": s.time["step_s_median"],
                              "phases": _mean_phases([r["phases_s_median"] for r in s.time["per_rank"]])})
        for arm, retain in (("minimal", True), ("minimal_default_malloc", False)):
            m = minimal(config, world=world, out=args.out / f"{arm}{i}.json", retain=retain)
            arms[arm].append({"step_s": m["step_s_median"], "phases": m["phases_s_median"]})
        print(f"repeat {i}: " + ", ".join(f"{a} {v[-1]['step_s']:.4f} s" for a, v in arms.items()), flush=True)
    med = {a: {"step_s": statistics.median(r["step_s"] for r in v),
               "phases": {k: statistics.median(r["phases"][k] for r in v) for k in PHASES}} for a, v in arms.items()}
    result = {"median": med, "runs": arms, "loadavg": os.getloadavg(), "common": common, **at_start,
              "ratio": med["suite"]["step_s"] / med["minimal"]["step_s"],
              "ratio_no_tracker": med["suite_no_tracker"]["step_s"] / med["minimal"]["step_s"],
              "ratio_no_tracker_vs_default_malloc": med["suite_no_tracker"]["step_s"] / med["minimal_default_malloc"]["step_s"]}
    (args.out / "harness.json").write_text(json.dumps(result, indent=2))
    print("| arm | step s | forward s | backward s | optimizer s |\n|---|---|---|---|---|")
    for a, m in med.items():
        print(f"| {a} | {m['step_s']:.4f} | " + " | ".join(f"{m['phases'][k]:.4f}" for k in PHASES) + " |")
    print(f"suite DDP step / minimal DDP loop: {result['ratio']:.3f} with the live-tensor tracker (default), "
          f"{result['ratio_no_tracker']:.3f} without (memory.tracker=false, as timing runs; target <= 1.05); "
          f"without tracker vs the loop on glibc defaults {result['ratio_no_tracker_vs_default_malloc']:.3f}; "
          f"loadavg {result['loadavg']}")
    return result

