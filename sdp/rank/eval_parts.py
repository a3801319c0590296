"""Evaluating a model that no rank holds whole, one top-level part at a time (forward-masked SDP's
assembled model, :class:`sdp.subnet.assemble.PartwiseAssembly`): the same numbers as the whole model's
(``tests/test_partwise_eval.py``), with one part and one pass's boundary activations held at a time.
:func:`sdp.rank.evaluation.totals` dispatches here.
"""

from __future__ import annotations

import math
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from sdp.data.base import DataBundle
from sdp.core.distctx import DistContext
from sdp.core.distctx import flatten, unflatten
from sdp.models.base import batch_norms
from sdp.rank.eval_ops import accumulate, bn_pass, gathered, new_totals, ordered_mean, scored_batches


@runtime_checkable
class Partwise(Protocol):
    """A model a strategy yields for evaluation one top-level part at a time (``head(blocks(stem(x)))``),
    because no rank holds it whole (forward-masked SDP, :class:`sdp.subnet.assemble.PartwiseAssembly`).
    ``part(i)`` is collective and returns a transient module in eval mode; the caller drops it."""

    has_batch_norm: bool  # any BatchNorm with running statistics (else bn=reestimate has nothing to do)

    def __len__(self) -> int: ...

    def part(self, i: int) -> nn.Module: ...


def val_passes(*, num_val: int, world_size: int, batch_size: int, part_batches: int) -> int:
    """Passes of ``part_batches`` evaluation batches that the longest validation shard (rank 0's, of
    ``ceil(num_val / world_size)`` samples) needs: every rank runs this many, known without asking."""
    return math.ceil(math.ceil(math.ceil(num_val / world_size) / batch_size) / part_batches)


@torch.no_grad()
def partwise_totals(model: Partwise, *, bn: str, bn_batches: Callable[[], Iterable[torch.Tensor]], ctx: DistContext,
                    data: DataBundle, rank: int, world_size: int, batch_size: int, num_workers: int,
                    part_batches: int) -> torch.Tensor:
    """:func:`~sdp.rank.eval_ops.val_totals` (after :func:`~sdp.rank.evaluation.reestimate_bn` under ``bn=reestimate``) of
    a model built part by part. Each pass builds every part once, runs the pass's batches through it and drops
    it, so a rank holds one part and the pass's boundary activations, never the whole model. Validation passes
    take ``part_batches`` evaluation batches; calibration passes as many calibration batches as hold no more
    samples than that (``part_batches`` x the largest validation batch a rank runs: the calibration set of a few
    training batches is then usually one pass, not one per batch). Re-estimation is the same cumulative average
    as the whole model's (each part's statistics carried from pass to pass, then the gathered mean over the
    world), so the numbers equal the assembled model's (``tests/test_partwise_eval.py``). Every rank runs the
    same number of passes, because building a part is collective: the validation count from the set's length
    (:func:`val_passes`, a rank whose shard is done runs empty passes), the calibration count because every
    rank's shard of a global batch has the same size."""
    limit = part_batches * min(batch_size, math.ceil(len(data.val) / world_size))  # type: ignore[arg-type]
    with ctx.comm.phase_as("eval"):  # building parts, statistics: evaluation traffic
        reestimate = bn == "reestimate" and model.has_batch_norm
        stats = _reestimated(model, batches=bn_batches(), ctx=ctx, limit=limit) if reestimate else None
        out = new_totals(data, device=ctx.device)
        val = scored_batches(data, rank=rank, world_size=world_size, batch_size=batch_size, num_workers=num_workers,
                             device=ctx.device)
        count = val_passes(num_val=len(data.val), world_size=world_size, batch_size=batch_size,  # type: ignore[arg-type]
                           part_batches=part_batches)
        for chunk in _passes(val, size=part_batches, count=count):
            _add_pass(out, model=model, chunk=chunk, stats=stats)
    return out


def _add_pass(out: torch.Tensor, *, model: Partwise, chunk: list[tuple[torch.Tensor, tuple[torch.Tensor, Any]]],
              stats: list[dict[str, torch.Tensor]] | None) -> None:
    """One validation pass: ``chunk``'s batches through every part in turn, their sums added to ``out``.
    ``chunk`` is emptied (the caller's reference would keep the inputs alive for the whole pass); each
    batch's output replaces its input as it is made, and the last part's output (the logits) is turned
    into sums batch by batch, so at most one batch's logits exist. A function of its own so that
    nothing of the pass (a part, the logits) outlives it."""
    xs, ys = [x for x, _ in chunk], [y for _, y in chunk]
    chunk.clear()
    last = len(model) - 1
    for i in range(len(model)):
        part = model.part(i)
        if stats and stats[i]:
            _load(part, stats[i])
        for j in range(len(xs)):
            y = part(xs[j])
            xs[j] = y if i < last else None  # the input goes as soon as its output exists (as in a whole forward)
            if i == last:
                accumulate(out, y, *ys[j])  # the targets and their group ids
            del y
        del part


def by_samples(batches: Iterable[torch.Tensor], *, limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive ``batches`` in lists of at most ``limit`` samples (at least one batch each)."""
    chunk: list[torch.Tensor] = []
    held = 0
    for x in batches:
        if chunk and held + len(x) > limit:
            yield chunk
            chunk, held = [], 0
        chunk.append(x)
        held += len(x)
    if chunk:
        yield chunk


def _reestimated(model: Partwise, *, batches: Iterable[torch.Tensor], ctx: DistContext,
                 limit: int) -> list[dict[str, torch.Tensor]]:
    """Every part's BatchNorm buffers after re-estimation on ``batches`` (:func:`~sdp.rank.evaluation.reestimate_bn`,
    part by part, passes of at most ``limit`` samples): statistics reset, accumulated pass after pass, then the
    gathered mean over the world ({} for a part without BatchNorm, which keeps what it was built with)."""
    stats: list[dict[str, torch.Tensor] | None] = [None] * len(model)
    seen = 0
    for xs in by_samples(batches, limit=limit):
        seen += len(xs)
        outs: list[Any] = list(xs)
        xs.clear()  # the generator's own reference would keep this pass's inputs alive to its end
        for i in range(len(model)):
            part = model.part(i)
            norms = batch_norms(part)
            if stats[i] is None:
                for m in norms:
                    m.reset_running_stats()
            else:
                _load(part, stats[i])
            for j in range(len(outs)):  # each output replaces its input: the pass holds one boundary per batch
                outs[j] = bn_pass(part, batches=[outs[j]], keep=True)[0] if norms else part(outs[j])
            keys = _bn_keys(part)
            stats[i] = {k: b.clone() for k, b in part.named_buffers() if k in keys}
            del part, norms  # both: a BatchNorm list would keep its part's modules alive into the next part's build
    assert seen > 0, "eval.bn=reestimate found no training batch before this evaluation (step 0?)"
    kept = [s or {} for s in stats]
    floats = [b for s in kept for k, b in s.items() if k.rsplit(".", 1)[-1] in ("running_mean", "running_var")]
    unflatten(ordered_mean(gathered([flatten(floats)], ctx=ctx)), floats)
    return kept


def _bn_keys(part: nn.Module) -> set[str]:
    """Names of ``part``'s BatchNorm buffers (statistics and batch counts), the ones re-estimation sets."""
    return {f"{name}.{k}" if name else k for name, m in part.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
            for k, _ in m.named_buffers(recurse=False)}


def _passes(items: Iterable[Any], *, size: int, count: int) -> Iterator[list[Any]]:
    """``items`` in ``count`` lists of ``size`` (empty once they run out): the same count on every rank."""
    it = iter(items)
    for _ in range(count):
        yield list(islice(it, size))
    left = sum(1 for _ in it)
    assert left == 0, f"{left} validation batches beyond the {count} passes of {size} every rank runs"


def _load(part: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy ``buffers`` (a part's re-estimated BatchNorm buffers, by name) into a freshly built ``part``."""
    for k, b in part.named_buffers():
        if k in buffers:
            b.copy_(buffers[k])
