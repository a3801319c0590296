"""Evaluation protocols on the same weights: each (method, seed) trains once, then is evaluated under
every ``eval.bn`` protocol and, for SDP under forward masking, every evaluation-time ``rescale``.

Why one trained model per row and several evaluations: evaluation never changes the training run
(:mod:`sdp.rank.evaluation` restores the statistics it replaces), so the protocols are compared on
bit-identical weights, which separate runs would only give by determinism. All jobs run inside one
set of ranks (one start-up instead of one per job, :func:`sdp.bench.runs.spawn_ranks`); every piece is
the suite's own (worker.build_model, the strategy registry, the Trainer).

    sdp-bench eval-protocols --out benchmarks/results/eval-protocol     # ~5 min on 2 cores

Prints a markdown table (eval accuracy % / eval loss per protocol, per seed, mean ± std) and writes
``results.json`` and ``table.md`` into ``--out``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sdp.results import contract as results
from sdp.bench.runs import compose as compose_job
from sdp.bench.runs import parser, spawn_ranks
from sdp.core.fields import choices_of
from sdp.driver.schema import Eval

COMMON = ["model=resnet18_cifar", "dataset=digits", "train.eval_every=0", "logger.wandb.mode=disabled",
          "logger.progress=false"]
METHODS = {"DDP": ["parallelism=ddp"], "B-SDP C=0.5": ["parallelism=sdp"], "N-SDP C=0.5": ["parallelism=sdp_neuron_fwd"]}


def compose(overrides: list[str]) -> dict[str, Any]:
    """The job's config as ``sdp-train`` composes and validates it, resolved to plain containers for the ranks."""
    from omegaconf import OmegaConf

    from sdp.driver.config import validate

    cfg = compose_job(overrides)
    validate(cfg)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def _rank(rank: int, world: int, jobs: list[tuple[str, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every job on this rank: train once, then evaluate under each protocol; the rows (the same on every rank)."""
    from omegaconf import OmegaConf

    from sdp.results.loggers import NullLogger
    from sdp.metrics.timing import PhaseTimer
    from sdp.parallel import STRATEGIES, DistContext, JobFacts
    from sdp.rank.trainer import Trainer
    from sdp.rank.worker import build_model
    from sdp.registry import build

    rows = []
    for label, seed, config in jobs:
        cfg = OmegaConf.create(config)
        started = time.time()
        ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        data = build(cfg.dataset)
        model = build_model(cfg, data)
        strategy = STRATEGIES.get(str(cfg.parallelism.name)).runtime(cfg=cfg.parallelism, job=JobFacts.of(cfg), ctx=ctx)
        strategy.checkpoint_blocks(model=model)
        strategy.setup(model=model, optimizer_factory=lambda p, cfg=cfg: build(cfg.optim.optimizer)(p))
        trainer = Trainer(cfg=cfg, strategy=strategy, data=data, logger=NullLogger(), timer=PhaseTimer(device=ctx.device))
        state = trainer.fit()  # ends with one evaluation under the configured protocol
        sdp_fwd = cfg.parallelism.name == "sdp" and cfg.parallelism.masking == "forward"
        for rescale in (("eval", "none") if sdp_fwd else (None,)):
            if rescale is not None:  # evaluation-time only: training is the same for eval and none
                strategy.rescale = rescale  # type: ignore[attr-defined]
            for bn in choices_of(Eval, "bn"):
                cfg.eval.bn = bn
                ev = trainer.evaluate()
                rows.append({"method": label, "seed": seed, "bn": bn, "rescale": rescale, "steps": state.step,
                             "train_loss": state.last_loss, "eval_loss": ev.eval_loss,
                             "eval_accuracy": ev.eval_accuracy, "seconds": time.time() - started})
        if rank == 0:
            print(f"{label} seed {seed}: {time.time() - started:.0f} s", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    seeds = sorted({r["seed"] for r in rows})
    keys = sorted({(r["method"], r["rescale"] or "-", r["bn"]) for r in rows}, key=lambda k: (list(METHODS).index(k[0]), k[1], k[2]))
    head = ["method", "rescale", "eval.bn", *[f"seed {s}: acc % / loss" for s in seeds], "acc % mean ± std", "loss mean ± std"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, rs, bn in keys:
        got = {r["seed"]: r for r in rows if (r["method"], r["rescale"] or "-", r["bn"]) == (m, rs, bn)}
        acc = [100 * got[s]["eval_accuracy"] for s in seeds if s in got]
        loss = [got[s]["eval_loss"] for s in seeds if s in got]
        cells = [f"{100 * got[s]['eval_accuracy']:.1f} / {got[s]['eval_loss']:.3f}" if s in got else "-" for s in seeds]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else float("nan"))
        lines.append("| " + " | ".join([m, rs, bn, *cells, f"{statistics.fmean(acc):.1f} ± {sd(acc):.1f}",
                                        f"{statistics.fmean(loss):.3f} ± {sd(loss):.3f}"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = parser(suite="eval-protocols", doc=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--common", nargs="*", default=[], help="extra overrides for every job")
    args = ap.parse_args(argv)
    jobs = [(label, seed, compose([*COMMON, *over, f"seed={seed}", f"train.steps={args.steps}",
                                   f"cluster.world_size={args.world_size}", *args.common]))
            for seed in args.seeds for label, over in METHODS.items()]
    started = time.time()
    rows = spawn_ranks(_rank, world=args.world_size, args=(jobs,), timeout_s=120)[0]
    args.out.mkdir(parents=True, exist_ok=True)
    results.write_json(args.out / "results.json", {"rows": rows, **results.provenance()})
    md = table(rows)
    note = (f"\n\n{args.world_size} gloo ranks, resnet18_cifar (width {jobs[0][2]['model'].get('width')}), digits, "
            f"{args.steps} steps, batch {jobs[0][2]['train']['batch_size']}/rank; each row of one method and seed is the "
            f"same trained weights evaluated several ways. Wall time {time.time() - started:.0f} s.\n")
    (args.out / "table.md").write_text(md + note)
    print(md + note)

