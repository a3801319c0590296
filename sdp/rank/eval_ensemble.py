"""The ensemble of the workers' subnetworks (``eval.ensemble``): the mean of their predicted probabilities.

Why: under forward masking every worker trains a different subnetwork, and the assembled model (the
units' union) is one way to use them; averaging their predictions is the other. "Does Federated Dropout
actually work?" (Charles et al., 2022) finds that plain ensembling of the trained subnetworks beats the
assembled model, and an ensemble is the usual baseline for a set of separately trained models. Its loss
is the cross-entropy of the mean probability (for a language model per token, as every loss here), its
accuracy (a classifier's only) the arg-max of the mean probability.

Memory: no rank ever holds a second model or more than one batch of probabilities. Each rank runs its
own subnetwork (calibrated as for the workers' own columns, :func:`sdp.rank.evaluation.own_totals`, which
calls :func:`add_batch` on every batch) on every validation batch, the same samples on every rank, and
per chunk of a batch's rows (``LOSS_CHUNK_TOKENS``, as the loss is computed) the ranks' values are
combined by all-reduces: nothing of the validation set's probabilities is kept beyond that chunk.

Numbers: the loss of the mean needs each worker's probability of the target only, one value per row,
averaged in log space: the largest worker's log-probability m (an all-reduce MAX), then m + log of the
summed exp(log p - m) (an all-reduce SUM, in float64) minus log n: exact where a float32 probability
would underflow, and where every worker's model is the same (C = 1) its own log-probability to rounding.
Every rank ends with the same totals, so no further collective is needed. The per-row vectors do not
grow with the number of workers. Where every worker's subnetwork is the full model (C = 1) the ensemble
is that model and its figures equal DDP's evaluation (``tests/test_ensemble.py``).

Traffic (comm phase "eval"): the loss moves 2 x 8 bytes per row (token) and rank, O(tokens). The arg-max
of the mean probability needs every class's probability, so only a classifier's ensemble computes it
(one all-reduce of the chunk's float32 probabilities, rows x classes x 4 bytes); a language model's
ensemble reports no accuracy (as no LM evaluation does) and moves no vocabulary-sized tensor: at FineWeb
scale (V = 50,257) that would be about 200 kB per token and rank.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from sdp.core.distctx import DistContext
from sdp.core.loss import LOSS_CHUNK_TOKENS, scored_rows, target_logprobs


def add_batch(totals: torch.Tensor, out: torch.Tensor, target: torch.Tensor, *, ctx: DistContext, argmax: bool,
              chunk: int = LOSS_CHUNK_TOKENS) -> None:
    """Add one validation batch's (loss sum, correct, count) of the ensemble of every rank's model to
    ``totals`` (float64, on the device): ``out`` is this rank's logits (N, C) or (B, T, V) for ``target``,
    the same batch on every rank. ``argmax`` (a classifier): also count the mean probability's correct
    arg-max, which all-reduces the chunk's probabilities; without it ``correct`` stays 0 and only the
    per-row log-probabilities move. Collective: every rank calls it with the same shapes, batch after batch."""
    logits, labels = scored_rows(out, target)  # the same batch on every rank: the same rows kept, the same shapes
    with ctx.comm.phase_as("eval"):
        for o, t in zip(logits.split(chunk), labels.split(chunk)):
            probs, mine = target_logprobs(o, t)  # this worker's log-probability of each target (float64)
            if argmax:
                probs.exp_()  # in place: the chunk's probabilities are the one chunk-sized tensor held
                _all_reduce(probs, op=dist.ReduceOp.SUM, ctx=ctx)  # the sum over workers: its arg-max is the mean's
                totals[1] += (probs.argmax(-1) == t).sum()
            del probs
            log_mean = log_mean_prob(mine, workers=ctx.world_size, reduce=lambda v, op: _all_reduce(v, op=op, ctx=ctx))
            totals[0] -= log_mean.sum()
            totals[2] += t.numel()


def log_mean_prob(mine: torch.Tensor, *, workers: int, reduce: Callable[[torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
    """log of the mean over ``workers`` of their probabilities of each row's target, from ``mine`` (float64
    log-probabilities, overwritten) and ``reduce(t, op)`` (``dist.ReduceOp.MAX`` / ``SUM`` over the workers): the
    largest log-probability m, then m + log of the summed exp(log p - m), minus log n. Across ranks (:func:`add_batch`)
    ``reduce`` all-reduces; in one process holding every worker's row (``sdp-bench diagnose``) it reduces dim 0 with
    keepdim, so both compute the ensemble with this one arithmetic."""
    top = reduce(mine.clone(), dist.ReduceOp.MAX)
    mine.sub_(top).exp_()  # each worker's probability over the best one's, in [0, 1]
    return reduce(mine, dist.ReduceOp.SUM).log_().add_(top) - math.log(workers)


def _all_reduce(t: torch.Tensor, *, op: Any, ctx: DistContext) -> torch.Tensor:
    """``t`` reduced over the world in place (recorded as evaluation traffic); itself on one rank."""
    if ctx.world_size > 1:
        ctx.comm.record(kind="all_reduce", payload=t.numel() * t.element_size(), group_size=ctx.world_size)
        dist.all_reduce(t, op=op)
    return t
