"""The evaluation protocol: one rule, applied by the trainer to whatever model a strategy evaluates.

Why outside the strategies: a comparison is fair only if every method is evaluated the same way.
BatchNorm running statistics are part of the evaluated model, and they can be produced two ways:

- ``average``: the statistics the training run accumulated (momentum averages), averaged over the
  ranks that ran each layer. Every strategy's ``eval_module`` already yields the model in this state
  (only the strategy knows who ran a layer: SDP holders, pipeline stage owners, the world), and so does
  its ``subnetwork_module`` under this protocol (a worker's units with the assembled model's statistics),
  so the workers' own and ensemble evaluations follow the same rule as the full model's;
- ``reestimate``: recompute them on the model being evaluated from one *calibration set*, as SWA's
  ``update_bn`` does: the global training batches of ``eval.bn_batches`` steps, split into the
  replicas' shards as training splits them. The statistics are the mean, in shard order, of each
  shard's cumulative average (a rank computes its own shard; the shards' statistics are gathered and
  summed in rank order, so the arithmetic does not depend on who computed them).

The calibration set depends only on the evaluation point's fraction of the run's budget
(:func:`calibration_steps`): the ``eval.bn_batches`` steps that end at that fraction of the reference
step count (DDP's under ``train.budget=flops``, the run's own otherwise). DDP therefore calibrates on
its own last batches, and every other strategy at the same fraction on the very same samples (an SDP
run at C = 0.5 has twice DDP's steps; at its halfway point it calibrates on DDP's halfway batches).
The batches are regenerated from the step-indexed sampler (a global batch is a pure function of (seed,
step), augmentation included), so nothing is cached during training and a resumed run calibrates
exactly as an uninterrupted one.

Re-estimation runs the model in eval mode except its BatchNorm layers (no dropout, no stochastic
depth, no RNG drawn), and the statistics it replaces are restored afterwards, so evaluation never
changes the training run. Models without BatchNorm are left alone under either protocol.

``eval.subnetworks``: a strategy whose workers train different models (forward-masked SDP) also
yields each worker's own subnetwork; the trainer evaluates it (:func:`own_totals`) on exactly what the
assembled model is evaluated on: calibrated on every shard of the same calibration set, run on every
rank's validation shard in turn with the same batches, summed in rank order. It reports the mean over
workers and the *assembly gap* (assembled model's eval loss minus that mean), which then measures
assembly and nothing else: where nothing is assembled (C = 1) it is exactly 0
(``tests/test_calibration.py``). Running one shard at a time also keeps the worker's activations
those of one rank's evaluation batch, not of the whole validation set.

``eval.ensemble``: in the same pass, the ensemble of the workers' subnetworks (the mean of their
predicted probabilities, :mod:`sdp.rank.eval_ensemble`): every rank runs its own calibrated subnetwork on the
same batches, so the ranks' probabilities are summed batch by batch, one worker's subnetwork per rank.
Only a strategy whose workers train different models yields subnetworks; for every other one each
worker's model is the evaluated model itself, the ensemble would be that model, and the key does nothing.

Sums stay on the device (loss, correct, count in float64) and are read once per evaluation.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from fractions import Fraction
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from omegaconf import DictConfig
from torch import nn

from sdp.rank import eval_ensemble
from sdp.data.base import DataBundle, EvalGroups
from sdp.core.distctx import DistContext, flatten, unflatten
from sdp.models.base import batch_norms
from sdp.rank.eval_ops import bn_pass, gathered, ordered_mean, ordered_sum, statistics, val_totals
from sdp.rank.eval_parts import Partwise, partwise_totals
from sdp.results.evalresult import EvalResult


def part_batches(cfg: DictConfig) -> Any:
    """``eval.part_batches``; 1 for configs written before the key (a re-run of a recorded run)."""
    return cfg.eval.get("part_batches", 1)


def ensemble(cfg: DictConfig) -> Any:
    """``eval.ensemble``; false for configs written before the key (a re-run computes what the run did)."""
    return cfg.eval.get("ensemble", False)


def protocol(cfg: DictConfig) -> dict[str, Any]:
    """What summary.json records of the protocol (the report splits tables on it)."""
    return {"bn": str(cfg.eval.bn), "bn_batches": int(cfg.eval.bn_batches), "subnetworks": bool(cfg.eval.subnetworks),
            "ensemble": bool(ensemble(cfg))}


def result(*, values: dict[str, list[float]], classify: bool, groups: EvalGroups | None = None) -> EvalResult:
    """The evaluation's figures from its world-summed values, read once (:meth:`sdp.rank.trainer.Trainer.evaluate`):
    ``full`` (loss sum, correct, count, then with ``groups`` the groups' loss sums and counts:
    :func:`~sdp.rank.eval_ops.new_totals`),
    and where evaluated ``workers`` (:func:`worker_figures` summed over workers) / ``ensemble`` (mean loss, accuracy).
    The one place a figure is computed: a new metric is this and its :class:`EvalResult` field."""
    loss, correct, count = values["full"][:3]
    workers, ensemble = values.get("workers"), values.get("ensemble")

    def acc(x: float | None) -> float | None:
        return x if classify else None

    return EvalResult(
        eval_loss=loss / count, eval_accuracy=acc(correct / count),
        eval_loss_workers=None if workers is None else workers[0],
        eval_accuracy_workers=None if workers is None else acc(workers[1]),
        assembly_gap=None if workers is None else loss / count - workers[0],
        eval_loss_ensemble=None if ensemble is None else ensemble[0],
        eval_accuracy_ensemble=None if ensemble is None else acc(ensemble[1]),
        eval_loss_by_group=None if groups is None else by_group(
            groups, sums=values["full"][3:], workers=None if workers is None else workers[2:]))


def by_group(groups: EvalGroups, *, sums: list[float], workers: list[float] | None) -> dict[str, Any]:
    """``eval_loss_by_group``: each group's mean loss (its loss sum / its scored count; None for a group the
    validation set has no scored target of) and count, keyed by label, and where evaluated the workers' mean of
    their own per-group losses. ``sums``: the G loss sums then the G counts of :func:`~sdp.rank.eval_ops.new_totals`."""
    g = len(groups.labels)
    assert len(sums) == 2 * g and (workers is None or len(workers) == g), \
        f"{len(sums)} group sums and {None if workers is None else len(workers)} workers' figures for {g} groups"
    out: dict[str, Any] = {
        "name": groups.name,
        "loss": {k: (s / c if c else None) for k, s, c in zip(groups.labels, sums[:g], sums[g:])},
        "count": {k: int(c) for k, c in zip(groups.labels, sums[g:])}}
    if workers is not None:
        out["workers"] = {k: (w if c else None) for k, w, c in zip(groups.labels, workers, sums[g:])}
    return out


def worker_figures(t: torch.Tensor) -> torch.Tensor:
    """One worker's figures from its own :func:`own_totals` (whole validation set): mean loss, accuracy, then each
    group's mean loss (0 for a group without a scored target: :func:`by_group` reports it None). The trainer
    averages them over the workers."""
    g = (len(t) - 3) // 2
    return torch.cat([torch.stack([t[0] / t[2], t[1] / t[2]]), t[3 : 3 + g] / t[3 + g :].clamp(min=1)])


def calibration_steps(*, fraction: Fraction, reference_steps: int, count: int) -> range:
    """The training steps whose global batches calibrate BatchNorm at an evaluation point ``fraction``
    of the way through the budget: the ``count`` steps ending at ``fraction`` x ``reference_steps``
    (rounded up: DDP's own evaluation step, :func:`sdp.rank.schedule.eval_fractions`), fewer near the start.
    A function of the fraction alone, so every strategy calibrates on the same samples there."""
    stop = math.ceil(fraction * reference_steps)
    assert 0 < fraction <= 1 and stop >= 1, \
        f"evaluation at fraction {fraction} of {reference_steps} steps: no step to calibrate on"
    return range(max(0, stop - count), stop)


def totals(source: nn.Module | Partwise, *, bn: str, bn_batches: Callable[[], Iterable[torch.Tensor]], ctx: DistContext,
           data: DataBundle, rank: int, world_size: int, batch_size: int, num_workers: int,
           part_batches: int = 1) -> torch.Tensor:
    """(loss sum, correct, count; the groups' sums after them, :func:`~sdp.rank.eval_ops.new_totals`) of the
    evaluated model on validation shard ``rank`` of ``world_size``
    under the protocol, calibrated on ``bn_batches()`` (this rank's shard of the calibration set; the
    statistics are the mean over every rank's): the one entry point the trainer calls for every
    strategy's model (:func:`world_sum` adds the ranks' totals). A plain module is run whole, batch by
    batch; a :class:`Partwise` model part by part (:func:`partwise_totals`) with the same numbers."""
    if isinstance(source, Partwise):
        return partwise_totals(source, bn=bn, bn_batches=bn_batches, ctx=ctx, data=data, rank=rank, world_size=world_size,
                               batch_size=batch_size, num_workers=num_workers, part_batches=part_batches)
    with applied(source, bn=bn, shards=[bn_batches()], ctx=ctx) as model:
        return val_totals(model, data=data, rank=rank, world_size=world_size, batch_size=batch_size,
                          num_workers=num_workers, device=ctx.device)


def own_totals(model: nn.Module, *, bn: str, calibration: Sequence[Callable[[], Iterable[torch.Tensor]]], ctx: DistContext,
               data: DataBundle, world_size: int, batch_size: int, num_workers: int,
               ensemble: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss sum, correct, count) on the whole validation set of a model that is this rank's own (an SDP
    worker's subnetwork), evaluated exactly as :func:`totals` + :func:`world_sum` evaluate the world's
    model: calibrated on every shard of ``calibration`` (the statistics' mean over shards in shard
    order, as the world's gathered mean), run on validation shard 0 .. ``world_size`` - 1 in turn with
    the same batches, the shards' totals summed in rank order. Where the two models are the same the
    numbers are bit for bit the same; and one shard's batch runs at a time, as on every rank.

    With ``ensemble`` (collective: every rank's own model, the same batches), also the totals of the
    ranks' models' ensemble (:func:`sdp.rank.eval_ensemble.add_batch` on every batch of the same pass), the
    same on every rank; else None."""
    ens = torch.zeros(3, dtype=torch.float64, device=ctx.device) if ensemble else None
    each = partial(eval_ensemble.add_batch, ens, ctx=ctx, argmax=data.task == "classification") if ens is not None else None
    with applied(model, bn=bn, shards=[shard() for shard in calibration], ctx=ctx, average=False) as m:
        own = ordered_sum([val_totals(m, data=data, rank=j, world_size=world_size, batch_size=batch_size,
                                      num_workers=num_workers, device=ctx.device, each=each) for j in range(world_size)])
    return own, ens


@torch.no_grad()
def reestimate_bn(model: nn.Module, *, shards: Sequence[Iterable[torch.Tensor]], ctx: DistContext,
                  average: bool = True) -> int:
    """Recompute the BatchNorm running statistics of ``model``: each shard's batches from reset
    statistics (cumulative average), then the mean of the shards' statistics in shard order. With
    ``average`` the shards are this rank's part of the calibration set and the mean runs over every
    rank's, gathered in rank order (every rank then evaluates the same model); without, ``model`` is
    this rank's own (an SDP worker's subnetwork) and ``shards`` the whole set. Returns the batch count."""
    norms = batch_norms(model)
    if not norms:
        return 0
    rows, seen = [], 0
    for batches in shards:
        for m in norms:
            m.reset_running_stats()
        n = len(bn_pass(model, batches=batches, keep=False))
        assert n > 0, "eval.bn=reestimate found no training batch before this evaluation (step 0?)"
        rows.append(flatten(statistics(norms)))  # a new tensor: the next shard resets the statistics
        seen += n
    unflatten(ordered_mean(gathered(rows, ctx=ctx) if average else rows), statistics(norms))
    return seen


@contextmanager
def applied(model: nn.Module, *, bn: str, shards: Sequence[Iterable[torch.Tensor]], ctx: DistContext,
            average: bool = True) -> Iterator[nn.Module]:
    """``model`` under the protocol for the duration of the block (``shards``, ``average``: as
    :func:`reestimate_bn`); its BatchNorm buffers as they were after. No batch is read without BatchNorm."""
    norms = batch_norms(model) if bn == "reestimate" else []
    if not norms:
        yield model
        return
    kept = [{k: v.clone() for k, v in m.named_buffers(recurse=False)} for m in norms]
    with ctx.comm.phase_as("eval"):
        reestimate_bn(model, shards=shards, ctx=ctx, average=average)
    try:
        yield model
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, kept):
                for k, v in m.named_buffers(recurse=False):
                    v.copy_(buffers[k])
