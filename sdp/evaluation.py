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
from typing import Any, Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F

from sdp.errors import boolean, one_of, positive_int
from sdp.data.base import DataBundle, val_batches
from sdp.parallel.base import DistContext, average_buffers

BN_PROTOCOLS = ("reestimate", "average")


def validate_eval(cfg: DictConfig) -> None:
    """The ``eval:`` node (called by :func:`sdp.config.validate`)."""
    one_of("eval.bn", cfg.eval.bn, BN_PROTOCOLS)
    positive_int("eval.bn_batches", cfg.eval.bn_batches)
    boolean("eval.subnetworks", cfg.eval.subnetworks)


def protocol(cfg: DictConfig) -> dict[str, Any]:
    """What summary.json records of the protocol (the report splits tables on it)."""
    return {"bn": str(cfg.eval.bn), "bn_batches": int(cfg.eval.bn_batches), "subnetworks": bool(cfg.eval.subnetworks)}


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
    saved = [(m.momentum, m.training) for m in norms]
    was_training = model.training
    model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches
        m.train()
    seen = 0
    try:
        for x in batches:
            model(x)
            seen += 1
    finally:
        for m, (momentum, training) in zip(norms, saved):
            m.momentum = momentum
            m.train(training)
        model.train(was_training)
    assert seen > 0, "eval.bn=reestimate found no training batch before this evaluation (step 0?)"
    if average:
        average_buffers(model, ctx=ctx)
    return seen


@contextmanager
def applied(model: nn.Module, *, bn: str, batches: Iterable[torch.Tensor], ctx: DistContext,
            average: bool = True) -> Iterator[nn.Module]:
    """``model`` under the protocol for the duration of the block; its BatchNorm buffers as they were after."""
    norms = batch_norms(model) if bn == "reestimate" else []
    if not norms:
        yield model
        return
    kept = [{k: v.clone() for k, v in m.named_buffers(recurse=False)} for m in norms]
    prev, ctx.comm.phase = ctx.comm.phase, "eval"
    try:
        reestimate_bn(model, batches=batches, ctx=ctx, average=average)
    finally:
        ctx.comm.phase = prev
    try:
        yield model
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, kept):
                for k, v in m.named_buffers(recurse=False):
                    v.copy_(buffers[k])


LOSS_CHUNK_TOKENS = 8192  # rows of the flattened logits per cross-entropy call in evaluation


def loss_and_correct(out: torch.Tensor, target: torch.Tensor, *, chunk: int = LOSS_CHUNK_TOKENS) -> tuple[float, float]:
    """Summed cross-entropy and correct arg-max predictions of ``out`` (N, C) or (B, T, V) against
    ``target``, ``chunk`` rows at a time: cross-entropy's log-softmax copy is then one chunk of the
    vocabulary-sized logits, not all of them (an LM's evaluation batch would otherwise hold two)."""
    logits, labels = out.reshape(-1, out.shape[-1]), target.reshape(-1)
    loss = correct = 0.0
    for o, t in zip(logits.split(chunk), labels.split(chunk)):
        loss += float(F.cross_entropy(o, t, reduction="sum"))
        correct += float((o.argmax(-1) == t).sum())
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
