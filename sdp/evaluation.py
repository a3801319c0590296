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
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from sdp.config import one_of, positive_int
from sdp.parallel.base import DistContext, average_buffers

BN_PROTOCOLS = ("reestimate", "average")


def validate_eval(cfg: DictConfig) -> None:
    """The ``eval:`` node (called by :func:`sdp.config.validate`)."""
    one_of("eval.bn", cfg.eval.bn, BN_PROTOCOLS)
    positive_int("eval.bn_batches", cfg.eval.bn_batches)


def protocol(cfg: DictConfig) -> dict[str, Any]:
    """What summary.json records of the protocol (the report splits tables on it)."""
    return {"bn": str(cfg.eval.bn), "bn_batches": int(cfg.eval.bn_batches)}


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@torch.no_grad()
def reestimate_bn(model: nn.Module, *, batches: Iterable[torch.Tensor], ctx: DistContext) -> int:
    """Recompute the BatchNorm running statistics of ``model`` on ``batches`` (this rank's), then
    average them over the world so every rank evaluates the same model. Returns the batch count."""
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
    average_buffers(model, ctx=ctx)
    return seen


@contextmanager
def applied(model: nn.Module, *, bn: str, batches: Iterable[torch.Tensor], ctx: DistContext) -> Iterator[nn.Module]:
    """``model`` under the protocol for the duration of the block; its BatchNorm buffers as they were after."""
    norms = batch_norms(model) if bn == "reestimate" else []
    if not norms:
        yield model
        return
    kept = [{k: v.clone() for k, v in m.named_buffers(recurse=False)} for m in norms]
    prev, ctx.comm.phase = ctx.comm.phase, "eval"
    try:
        reestimate_bn(model, batches=batches, ctx=ctx)
    finally:
        ctx.comm.phase = prev
    try:
        yield model
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, kept):
                for k, v in m.named_buffers(recurse=False):
                    v.copy_(buffers[k])
