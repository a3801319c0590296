"""The evaluation protocol: one rule, applied by the trainer to whatever model a strategy evaluates.

Why outside the strategies: a comparison is fair only if every method is evaluated the same way.
BatchNorm running statistics are part of the evaluated model, and they can be produced two ways:

- ``average``: the statistics the training run accumulated (momentum averages), averaged over the
  ranks that ran each layer. Every strategy's ``eval_module`` already yields the model in this state
  (only the strategy knows who ran a layer: SDP holders, pipeline stage owners, the world);
- ``reestimate``: recompute them on the model being evaluated, from the last ``eval.bn_batches``
  training batches of each rank (cumulative average, then the mean over the world), as SWA's
  ``update_bn`` does. The batches are regenerated from the step-indexed sampler (a global batch is
  a pure function of (seed, step), augmentation included), so every strategy sees the same batches,
  nothing is cached during training, and a resumed run re-estimates exactly as an uninterrupted one.

Re-estimation runs the model in eval mode except its BatchNorm layers (no dropout, no stochastic
depth, no RNG drawn), and the statistics it replaces are restored afterwards, so evaluation never
changes the training run. Models without BatchNorm are left alone under either protocol.

``eval.subnetworks``: a strategy whose workers train different models (forward-masked SDP) also
yields each worker's own subnetwork; the trainer evaluates it under the same protocol (statistics of
that worker alone) on the whole validation set, and reports the mean over workers and the *assembly
gap* (assembled model's eval loss minus that mean): how much of the evaluated model's quality is
owed to assembling subnetworks that were never run together.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F

from sdp.errors import boolean, one_of, positive_int
from sdp.data.base import DataBundle, val_batches
from sdp.distctx import DistContext, average_buffers, average_tensors

BN_PROTOCOLS = ("reestimate", "average")


def validate_eval(cfg: DictConfig) -> None:
    """The ``eval:`` node (called by :func:`sdp.config.validate`)."""
    one_of("eval.bn", cfg.eval.bn, BN_PROTOCOLS)
    positive_int("eval.bn_batches", cfg.eval.bn_batches)
    positive_int("eval.part_batches", part_batches(cfg))
    boolean("eval.subnetworks", cfg.eval.subnetworks)


def part_batches(cfg: DictConfig) -> Any:
    """``eval.part_batches``; 1 for configs written before the key (a re-run of a recorded run)."""
    return cfg.eval.get("part_batches", 1)


def protocol(cfg: DictConfig) -> dict[str, Any]:
    """What summary.json records of the protocol (the report splits tables on it)."""
    return {"bn": str(cfg.eval.bn), "bn_batches": int(cfg.eval.bn_batches), "subnetworks": bool(cfg.eval.subnetworks)}


@runtime_checkable
class Partwise(Protocol):
    """A model a strategy yields for evaluation one top-level part at a time (``head(blocks(stem(x)))``),
    because no rank holds it whole (forward-masked SDP, :class:`sdp.subnet.assemble.PartwiseAssembly`).
    ``part(i)`` is collective and returns a transient module in eval mode; the caller drops it."""

    has_batch_norm: bool  # any BatchNorm with running statistics (else bn=reestimate has nothing to do)

    def __len__(self) -> int: ...

    def part(self, i: int) -> nn.Module: ...


def totals(source: nn.Module | Partwise, *, bn: str, bn_batches: Callable[[], Iterable[torch.Tensor]], ctx: DistContext,
           data: DataBundle, rank: int, world_size: int, batch_size: int, num_workers: int, average: bool = True,
           part_batches: int = 1) -> torch.Tensor:
    """(loss sum, correct, count) of the evaluated model under the protocol: the one entry point the
    trainer calls for every strategy's model. A plain module is run whole, batch by batch; a
    :class:`Partwise` model part by part (:func:`partwise_totals`) with the same numbers."""
    if isinstance(source, Partwise):
        return partwise_totals(source, bn=bn, bn_batches=bn_batches, ctx=ctx, data=data, rank=rank, world_size=world_size,
                               batch_size=batch_size, num_workers=num_workers, part_batches=part_batches)
    with applied(source, bn=bn, batches=bn_batches(), ctx=ctx, average=average) as model:
        return val_totals(model, data=data, rank=rank, world_size=world_size, batch_size=batch_size,
                          num_workers=num_workers, device=ctx.device)


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """BatchNorm layers with running statistics (a forward-masked worker's dropped blocks keep their
    modules with the tensors deleted: they never run and have nothing to re-estimate)."""
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]


@torch.no_grad()
def reestimate_bn(model: nn.Module, *, batches: Iterable[torch.Tensor], ctx: DistContext, average: bool = True) -> int:
    """Recompute the BatchNorm running statistics of ``model`` on ``batches`` (this rank's), then
    average them over the world so every rank evaluates the same model (``average=False`` for a
    model that is this rank's own, such as an SDP worker's subnetwork). Returns the batch count."""
    norms = batch_norms(model)
    for m in norms:
        m.reset_running_stats()
    seen = len(bn_pass(model, batches=batches, keep=False))
    assert seen > 0, "eval.bn=reestimate found no training batch before this evaluation (step 0?)"
    if average:
        average_buffers(model, ctx=ctx)
    return seen


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


@contextmanager
def applied(model: nn.Module, *, bn: str, batches: Iterable[torch.Tensor], ctx: DistContext,
            average: bool = True) -> Iterator[nn.Module]:
    """``model`` under the protocol for the duration of the block; its BatchNorm buffers as they were after."""
    norms = batch_norms(model) if bn == "reestimate" else []
    if not norms:
        yield model
        return
    kept = [{k: v.clone() for k, v in m.named_buffers(recurse=False)} for m in norms]
    with ctx.comm.phase_as("eval"):
        reestimate_bn(model, batches=batches, ctx=ctx, average=average)
    try:
        yield model
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, kept):
                for k, v in m.named_buffers(recurse=False):
                    v.copy_(buffers[k])


LOSS_CHUNK_TOKENS = 8192  # rows of the flattened logits per cross-entropy call in evaluation


def loss_and_correct(out: torch.Tensor, target: torch.Tensor, *, chunk: int = LOSS_CHUNK_TOKENS,
                     number: Callable[[torch.Tensor], float] = float) -> tuple[float, float]:
    """Summed cross-entropy and correct arg-max predictions of ``out`` (N, C) or (B, T, V) against
    ``target``, ``chunk`` rows at a time: cross-entropy's log-softmax copy is then one chunk of the
    vocabulary-sized logits, not all of them (an LM's evaluation batch would otherwise hold two).
    ``number`` reads each chunk's sums (the planner's meta rehearsal passes one that reads nothing)."""
    logits, labels = out.reshape(-1, out.shape[-1]), target.reshape(-1)
    loss = correct = 0.0
    for o, t in zip(logits.split(chunk), labels.split(chunk)):
        loss += number(F.cross_entropy(o, t, reduction="sum"))
        correct += number((o.argmax(-1) == t).sum())
    return loss, correct


@torch.no_grad()
def val_totals(model: nn.Module, *, data: DataBundle, rank: int, world_size: int, batch_size: int,
               num_workers: int, device: torch.device) -> torch.Tensor:
    """(loss sum, correct, count) of ``model`` on shard ``rank`` of ``world_size`` of the validation set,
    ``batch_size`` samples per forward (``train.eval_batch_size`` bounds evaluation memory)."""
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in val_batches(data, rank=rank, world_size=world_size, batch_size=batch_size, num_workers=num_workers):
        x, y = x.to(device), y.to(device)
        loss, correct = loss_and_correct(model(x), y)
        totals[0] += loss
        totals[1] += correct  # the trainer reports accuracy for classification only
        totals[2] += y.numel()
    return totals


@torch.no_grad()
def partwise_totals(model: Partwise, *, bn: str, bn_batches: Callable[[], Iterable[torch.Tensor]], ctx: DistContext,
                    data: DataBundle, rank: int, world_size: int, batch_size: int, num_workers: int,
                    part_batches: int) -> torch.Tensor:
    """:func:`val_totals` (after :func:`reestimate_bn` under ``bn=reestimate``) of a model built part by
    part, ``part_batches`` batches per pass: each pass builds every part once, runs the pass's batches
    through it and drops it, so a rank holds one part and one boundary activation per batch, never the
    whole model. Re-estimation is the same cumulative average as the whole model's (each part's
    statistics carried from pass to pass, then one flat mean over the world), so the numbers equal the
    assembled model's (``tests/test_partwise_eval.py``). Every rank runs the same number of passes (a
    rank whose shard is done runs empty ones), because building a part is collective."""
    with ctx.comm.phase_as("eval"):  # building parts, statistics and pass counts: evaluation traffic
        stats = _reestimated(model, batches=bn_batches(), ctx=ctx, part_batches=part_batches) if bn == "reestimate" and model.has_batch_norm else None
        out = torch.zeros(3, dtype=torch.float64, device=ctx.device)
        val = ((x.to(ctx.device), y.to(ctx.device)) for x, y in
               val_batches(data, rank=rank, world_size=world_size, batch_size=batch_size, num_workers=num_workers))
        for chunk in _passes(val, size=part_batches, ctx=ctx):
            _add_pass(out, model=model, chunk=chunk, stats=stats)
    return out


def _add_pass(out: torch.Tensor, *, model: Partwise, chunk: list[tuple[torch.Tensor, torch.Tensor]],
              stats: list[dict[str, torch.Tensor]] | None) -> None:
    """One validation pass: ``chunk``'s batches through every part in turn, their sums added to ``out``.
    A function of its own so that nothing of the pass (a part, the logits) outlives it."""
    xs = [x for x, _ in chunk]
    for i in range(len(model)):
        part = model.part(i)
        if stats and stats[i]:
            _load(part, stats[i])
        xs = [part(x) for x in xs]
        del part
    for o, (_, y) in zip(xs, chunk):
        loss, correct = loss_and_correct(o, y)
        out[0] += loss
        out[1] += correct
        out[2] += y.numel()


def _reestimated(model: Partwise, *, batches: Iterable[torch.Tensor], ctx: DistContext,
                 part_batches: int) -> list[dict[str, torch.Tensor]]:
    """Every part's buffers after BatchNorm re-estimation on ``batches`` (:func:`reestimate_bn`, part by
    part): statistics reset, accumulated pass after pass, then averaged over the world ({} for a part
    without BatchNorm, which keeps what it was built with)."""
    stats: list[dict[str, torch.Tensor] | None] = [None] * len(model)
    seen = 0
    for xs in _passes(batches, size=part_batches, ctx=ctx):
        seen += len(xs)
        outs: list[Any] = xs
        for i in range(len(model)):
            part = model.part(i)
            norms = batch_norms(part)
            if stats[i] is None:
                for m in norms:
                    m.reset_running_stats()
            else:
                _load(part, stats[i])
            outs = bn_pass(part, batches=outs, keep=True) if norms else [part(x) for x in outs]
            stats[i] = {k: b.clone() for k, b in part.named_buffers()} if norms else {}
            del part, norms  # both: a BatchNorm list would keep its part's modules alive into the next part's build
    assert seen > 0, "eval.bn=reestimate found no training batch before this evaluation (step 0?)"
    kept = [s or {} for s in stats]
    average_tensors([b for s in kept for b in s.values() if b.is_floating_point()], ctx=ctx)
    return kept


def _passes(items: Iterable[Any], *, size: int, ctx: DistContext) -> Iterator[list[Any]]:
    """``items`` in lists of ``size`` until every rank's are exhausted (one MAX all-reduce per pass)."""
    it = iter(items)
    while True:
        chunk = list(islice(it, size))
        if ctx.world_size > 1:
            more = torch.tensor([len(chunk)], device=ctx.device)
            ctx.comm.record(kind="all_reduce", payload=more.numel() * more.element_size(), group_size=ctx.world_size)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if int(more) == 0:
                return
        elif not chunk:
            return
        yield chunk


def _load(part: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for k, b in part.named_buffers():
        if k in buffers:
            b.copy_(buffers[k])
