"""The arithmetic every evaluation shares (:mod:`sdp.rank.evaluation` is the protocol built on it): BatchNorm
passes, the validation sums (float64, on the device: read once per evaluation, never per batch or
chunk; with the dataset's evaluation groups, :class:`sdp.data.base.EvalGroups`, each group's loss sum and
count after the three totals: :func:`new_totals`), and sums and means taken in one fixed order wherever their
terms were computed, so that a model evaluated on one rank and the same model evaluated across ranks give bit-identical numbers.
"""

from __future__ import annotations

from itertools import repeat
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from sdp.core.distctx import DistContext
from sdp.core.loss import group_sums, loss_and_correct, scored
from sdp.data.base import DataBundle, val_batches, val_group_ids
from sdp.models.base import batch_norms


def statistics(norms: Sequence[nn.modules.batchnorm._BatchNorm]) -> list[torch.Tensor]:
    """The running statistics that re-estimation computes and averages (not ``num_batches_tracked``)."""
    return [b for m in norms for b in (m.running_mean, m.running_var)]


@torch.no_grad()
def bn_pass(model: nn.Module, *, batches: Iterable[torch.Tensor], keep: bool) -> list[torch.Tensor | None]:
    """Run ``batches`` through ``model`` in eval mode except its BatchNorm layers, which accumulate a
    cumulative average (momentum None) onto their current statistics; returns the outputs (``keep``)
    or one None per batch. Momentum and modes are restored after."""
    norms = batch_norms(model)
    saved = [(m.momentum, m.training) for m in norms]
    was_training = model.training
    model.eval()
    for m in norms:
        m.momentum = None
        m.train()
    out: list[torch.Tensor | None] = []
    try:
        for x in batches:
            y = model(x)
            out.append(y if keep else None)
    finally:
        for m, (momentum, training) in zip(norms, saved):
            m.momentum = momentum
            m.train(training)
        model.train(was_training)
    return out


def ordered_sum(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """``rows[0] + rows[1] + ...`` in that order: one summation order wherever the rows were computed."""
    assert rows, "nothing to sum"
    out = rows[0].clone()
    for r in rows[1:]:
        out += r
    return out


def ordered_mean(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`ordered_sum` / count: the shards' statistics averaged in one order wherever computed."""
    return ordered_sum(rows) / len(rows)


def gathered(rows: list[torch.Tensor], *, ctx: DistContext) -> list[torch.Tensor]:
    """Every rank's ``rows`` (the same count and shapes on every rank), in rank order: one all-gather."""
    if ctx.world_size == 1 or not rows:
        return list(rows)
    mine = torch.stack(rows)
    out = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    ctx.comm.record(kind="all_gather", payload=mine.numel() * mine.element_size() * ctx.world_size, group_size=ctx.world_size)
    dist.all_gather(out, mine)
    return [row for rank_rows in out for row in rank_rows.unbind(0)]


def world_sum(t: torch.Tensor, *, ctx: DistContext) -> torch.Tensor:
    """``t`` summed over the ranks in rank order (:func:`ordered_sum` of the gathered values, where an
    all-reduce's order is the backend's): the world's totals, added as :func:`sdp.rank.evaluation.own_totals` adds shards."""
    return ordered_sum(gathered([t], ctx=ctx))


def new_totals(data: DataBundle, *, device: torch.device) -> torch.Tensor:
    """Zeroed validation sums: (loss sum, correct, count), then, where ``data`` has evaluation groups (G of them),
    G per-group loss sums and G per-group counts. One vector, so the ranks' and shards' sums add as the totals do."""
    groups = 0 if data.eval_groups is None else len(data.eval_groups.labels)
    return torch.zeros(3 + 2 * groups, dtype=torch.float64, device=device)


def scored_batches(data: DataBundle, *, rank: int, world_size: int, batch_size: int, num_workers: int,
                   device: torch.device) -> Iterator[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]]:
    """:func:`~sdp.data.base.val_batches` on ``device``, each target with its group ids
    (:func:`~sdp.data.base.val_group_ids`, the same chunks; None without groups): what :func:`accumulate` scores."""
    batches = val_batches(data, rank=rank, world_size=world_size, batch_size=batch_size, num_workers=num_workers)
    pairs: Iterable[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]] = (
        zip(batches, repeat(None)) if data.eval_groups is None
        else zip(batches, val_group_ids(data, rank=rank, world_size=world_size, batch_size=batch_size), strict=True))
    for (x, y), g in pairs:
        yield x.to(device), (y.to(device), None if g is None else g.to(device))


def accumulate(totals: torch.Tensor, out: torch.Tensor, target: torch.Tensor, ids: torch.Tensor | None = None) -> None:
    """Add one batch's (loss sum, correct, count) to ``totals``, on the device, and with ``ids`` (the targets'
    groups) each group's loss sum and count after them (:func:`new_totals`): the one place both the whole-model
    and the part-by-part evaluation add a batch, so they add in the same order."""
    loss, correct = loss_and_correct(out, target)
    totals[0] += loss
    totals[1] += correct  # the trainer reports accuracy for classification only
    totals[2] += scored(target)
    if ids is not None:
        groups = (len(totals) - 3) // 2
        assert groups > 0 and len(totals) == 3 + 2 * groups, f"totals of {len(totals)} values hold no groups' sums"
        group_loss, group_count = group_sums(out, target, ids, groups=groups)
        totals[3 : 3 + groups] += group_loss
        totals[3 + groups :] += group_count


@torch.no_grad()
def val_totals(model: nn.Module, *, data: DataBundle, rank: int, world_size: int, batch_size: int,
               num_workers: int, device: torch.device,
               each: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """(loss sum, correct, count, and the groups' sums: :func:`new_totals`) of ``model`` on shard ``rank`` of
    ``world_size`` of the validation set, ``batch_size`` samples per forward (``train.eval_batch_size`` bounds
    evaluation memory). ``each`` (output, target) is called on every batch after its sums are added (the ensemble's sums,
    :mod:`sdp.rank.eval_ensemble`); the output is dropped before the next forward either way."""
    totals = new_totals(data, device=device)
    for x, (y, ids) in scored_batches(data, rank=rank, world_size=world_size, batch_size=batch_size,
                                      num_workers=num_workers, device=device):
        out = model(x)
        accumulate(totals, out, y, ids)
        if each is not None:
            each(out, y)
        del out  # not alive through the next batch's forward
    return totals
