"""``sdp-plan``'s traffic outside the training step: each phase's bytes and collectives per rank over the whole run,
shaped as summary.json's ``comm.per_rank[r].outside_training`` (phase -> ``bytes``, ``collectives``), so prediction
and measurement compare field by field (``tests/test_traffic_plan.py``: equal, on 4-rank runs).

Why: at paper scale a run's evaluations and re-draws can move more than its steps (a language model's ensemble
moves 16 bytes per validation token and rank per evaluation; a re-draw moves a share of the model), and these
are what a user reads before booking a cluster. Phases:

- ``eval``: the run's evaluations (the trainer's :class:`~sdp.rank.schedule.Cadence`, its budget resolved: the steps
  it evaluates after). Each is the strategy's evaluated models (:meth:`~sdp.parallel.spec.StrategySpec.eval_traffic`:
  DDP's buffer average, SDP's assembly, built once or once per pass of :mod:`sdp.rank.eval_parts`) plus the protocol
  of :mod:`sdp.rank.evaluation`, whatever the strategy: the BatchNorm re-estimation's all-gather of the statistics
  (``eval.bn=reestimate``, a model with BatchNorm), the world sum of the totals (3 float64), and where workers have
  their own models, the workers' sum (2 float64, ``eval.subnetworks``) and the ensemble
  (:func:`sdp.rank.eval_ensemble.add_batch`: per chunk of rows two float64 all-reduces, and for a classifier the
  chunk's float32 probabilities); counted with the evaluation code's own helpers (:func:`~sdp.rank.eval_parts.val_passes`,
  :func:`~sdp.rank.eval_parts.by_samples`, :func:`~sdp.rank.evaluation.calibration_steps`);
- the strategy's other phases (:meth:`~sdp.parallel.spec.StrategySpec.phase_traffic`: SDP's ``resample``, every
  re-draw of the run rehearsed; ``consolidate``, the consolidation switch; ``calibrate``, assembly calibration).

Not predicted: comm phase ``checkpoint``, which a run records only when it resumes (DDP's bucket priming); checkpoint
writes move no tensor between ranks (each rank writes its own files; their records meet in one small gather on a
group of their own, :mod:`sdp.rank.checkpoint_io`, not counted as traffic): the bytes each rank writes are
:mod:`sdp.planning.plan_checkpoint`'s, a column of :func:`format_phases`' table.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig

from sdp.core.loss import LOSS_CHUNK_TOKENS
from sdp.models.base import SDPModel, batch_norms
from sdp.parallel import JobFacts, StrategySpec
from sdp.parallel.plan_entries import EvalTraffic, Record
from sdp.rank.eval_ops import statistics
from sdp.rank.eval_parts import by_samples, val_passes
from sdp.rank.evaluation import calibration_steps, ensemble, part_batches
from sdp.rank.schedule import Cadence

NOT_PREDICTED = "eval: not predicted (the strategy's spec has no eval_traffic)"


def _ensemble(*, world: int, val_samples: int, batch_size: int, rows_per_sample: int, classes: int | None) -> list[Record]:
    """:func:`sdp.rank.eval_ensemble.add_batch` on every batch of every validation shard (each rank runs them all)."""
    out: list[Record] = []
    for shard in range(world):
        size = len(range(shard, val_samples, world))
        for start in range(0, size, batch_size):
            rows = min(batch_size, size - start) * rows_per_sample
            for first in range(0, rows, LOSS_CHUNK_TOKENS):
                chunk = min(LOSS_CHUNK_TOKENS, rows - first)
                out += [("all_reduce", chunk * classes * 4, world)] if classes is not None else []
                out += [("all_reduce", chunk * 8, world)] * 2  # the row maximum, then the sum of exp
    return out


def evaluation(*, cfg: DictConfig, job: JobFacts, traffic: EvalTraffic, model: SDPModel, step: int, cadence: Cadence,
               val_samples: int, output: torch.Size) -> list[list[Record]]:
    """Per rank, the records of the evaluation after 1-based ``step`` (``traffic``: the strategy's; ``output``: the
    model's output shape on the meta device, (N, C) a classifier, (B, T, V) a language model)."""
    world = job.world_size
    if world == 1:
        return [[]]
    bn = str(cfg.eval.bn)
    stats = [t for t in statistics(batch_norms(model))]
    reestimate = bn == "reestimate" and bool(stats)
    eval_batch = int(cfg.train.eval_batch_size)
    builds = 1
    if traffic.partwise:
        parts = int(part_batches(cfg))
        builds = val_passes(num_val=val_samples, world_size=world, batch_size=eval_batch, part_batches=parts)
        if reestimate:
            steps = calibration_steps(fraction=cadence.fraction(step), reference_steps=cadence.reference_steps,
                                      count=int(cfg.eval.bn_batches))
            limit = parts * min(eval_batch, math.ceil(val_samples / world))
            cal = [torch.empty(job.batch_size, device="meta") for _ in steps]
            builds += sum(1 for _ in by_samples(cal, limit=limit))
    protocol: list[Record] = [("all_gather", sum(t.numel() * t.element_size() for t in stats) * world, world)] \
        if reestimate else []
    protocol.append(("all_gather", 3 * 8 * world, world))  # world_sum of (loss, correct, count)
    out = [traffic.build[r] * builds + protocol for r in range(world)]
    workers, ens = bool(cfg.eval.subnetworks), bool(ensemble(cfg))
    if traffic.own is not None and (workers or ens):
        classifier = len(output) == 2
        mean = _ensemble(world=world, val_samples=val_samples, batch_size=eval_batch,
                         rows_per_sample=1 if classifier else int(cfg.dataset.seq_len),
                         classes=int(output[-1]) if classifier else None) if ens else []
        for r in range(world):
            out[r] += traffic.own[r] + mean + ([("all_gather", 2 * 8 * world, world)] if workers else [])
    return out


def predict_outside(*, cfg: DictConfig, job: JobFacts, spec: type[StrategySpec], model: SDPModel, prepared: Any,
                    cadence: Cadence, val_samples: int) -> tuple[list[dict[str, dict[str, int]]], list[str]]:
    """Per rank, ``outside_training`` over the run of ``cfg`` (phase -> bytes and collectives; a phase with no
    record left out, as summary.json leaves it), and the notes on what is not predicted."""
    world, notes = job.world_size, []
    phases: list[dict[str, list[Record]]] = [{} for _ in range(world)]
    with torch.no_grad():
        output = model(model.example_input(2).to("meta")).shape
    for step in sorted(cadence.eval_at):
        traffic = spec.eval_traffic(cfg=cfg.parallelism, job=job, model=model, step=step, prepared=prepared)
        if traffic is None:
            notes = [NOT_PREDICTED]
            break
        for r, records in enumerate(evaluation(cfg=cfg, job=job, traffic=traffic, model=model, step=step,
                                               cadence=cadence, val_samples=val_samples, output=output)):
            phases[r].setdefault("eval", []).extend(records)
    for phase, per_rank in spec.phase_traffic(cfg=cfg.parallelism, job=job, model=model, steps=cadence.steps,
                                              prepared=prepared).items():
        for r, records in enumerate(per_rank):
            phases[r].setdefault(phase, []).extend(records)
    return [{phase: {"bytes": sum(p for _, p, _ in recs), "collectives": len(recs)}
             for phase, recs in mine.items() if recs} for mine in phases], notes


def format_phases(plan: dict[str, Any]) -> str:
    """The printed per-phase table: each rank's bytes over the whole run by phase: training (the step's bytes times
    the run's steps), every phase outside it (``comm.per_rank[r].outside_training``: eval, resample) with its
    collectives, and what it writes to checkpoints (:mod:`sdp.planning.plan_checkpoint`, tensor payload)."""
    comm, steps, ckpt = plan["comm"]["per_rank"], int(plan["steps"]), plan.get("checkpoint")
    phases = sorted({phase for c in comm for phase in c.get("outside_training", {})})
    header = ["rank", "train MiB / collectives", *(f"{phase} MiB / collectives" for phase in phases)]
    if ckpt is not None:
        header.append(f"checkpoint MiB written / checkpoints (steps {', '.join(map(str, ckpt['steps']))})")
    lines = [f"per phase, the whole run ({steps} steps; comm as summary.json's comm.per_rank[r]: train = bytes_per_step x "
             "steps, the others its outside_training; checkpoint: each rank's files, tensor payload):",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in comm:
        mine = c.get("outside_training", {})
        cells = [f"{c['bytes_per_step'] * steps / 2**20:.3f} / {c['collectives_per_step'] * steps:.0f}",
                 *(f"{mine[p]['bytes'] / 2**20:.3f} / {mine[p]['collectives']}" if p in mine else "0 / 0" for p in phases)]
        if ckpt is not None:
            cells.append(f"{ckpt['per_rank'][c['rank']]['bytes'] / 2**20:.3f} / {len(ckpt['steps'])}")
        lines.append("| " + " | ".join([str(c["rank"]), *cells]) + " |")
    return "\n".join(lines)
