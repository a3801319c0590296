"""The losses every rank computes, in a module that imports only the data's target convention from ``sdp``: the training loss
(:func:`loss_fn`) and evaluation's summed loss and correct count (:func:`loss_and_correct`). The trainer, the
evaluation (:mod:`sdp.rank.eval_ops`) and the strategies' meta rehearsals (:mod:`sdp.parallel.plan_entries`,
:mod:`sdp.parallel.plan_peaks`) share them without importing the trainer."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from sdp.data.base import IGNORE_INDEX, per_target


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the scored targets (those not :data:`IGNORE_INDEX`); LM logits (B, T, V) and
    targets (B, T) are flattened. A task that leaves positions unscored scores the same number in every sample
    (e.g. :mod:`sdp.data.pointer`), so a mean of shards' means (DDP's average, a pipeline's micro-batches) is
    the batch's mean."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


LOSS_CHUNK_TOKENS = 8192  # rows of the flattened logits per cross-entropy call in evaluation


def loss_and_correct(out: torch.Tensor, target: torch.Tensor, *,
                     chunk: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and correct arg-max predictions of ``out`` (N, C) or (B, T, V) against
    ``target`` (targets :data:`IGNORE_INDEX` add nothing: :func:`scored` counts the rest), ``chunk`` rows at a time: cross-entropy's log-softmax copy is then one chunk of the
    vocabulary-sized logits, not all of them (an LM's evaluation batch would otherwise hold two). Both
    are float64 tensors on ``out``'s device: nothing is read back per chunk (a host sync on a GPU)."""
    logits, labels = out.reshape(-1, out.shape[-1]), target.reshape(-1)
    loss = torch.zeros((), dtype=torch.float64, device=out.device)
    correct = torch.zeros((), dtype=torch.float64, device=out.device)
    for o, t in zip(logits.split(chunk), labels.split(chunk)):
        loss += F.cross_entropy(o, t, reduction="sum")
        correct += (o.argmax(-1) == t).sum()
    return loss, correct


def target_logprobs(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's float32 log-probabilities (rows x classes, whatever dtype autocast made ``out``) and each row's
    log-probability of its target in float64: what the ensemble of the workers combines
    (:func:`sdp.rank.eval_ensemble.add_batch`), here so that sdp-plan's rehearsal allocates what the ranks do."""
    probs = F.log_softmax(out, dim=-1, dtype=torch.float32)
    return probs, probs.gather(1, target[:, None]).squeeze(1).double()


def group_sums(out: torch.Tensor, target: torch.Tensor, ids: torch.Tensor, *, groups: int,
               chunk: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: the summed cross-entropy and the scored count of ``out`` against ``target`` (as
    :func:`loss_and_correct` and :func:`scored`, :data:`IGNORE_INDEX` targets skipped), ``ids`` giving each
    target's group in ``[0, groups)`` (the targets' shape, or a prefix of it: one group per sample). Two float64
    vectors of ``groups`` on ``out``'s device, chunked as :func:`loss_and_correct` and read back nowhere."""
    logits, labels, where = out.reshape(-1, out.shape[-1]), target.reshape(-1), per_target(ids, target).reshape(-1)
    loss = torch.zeros(groups, dtype=torch.float64, device=out.device)
    count = torch.zeros(groups, dtype=torch.float64, device=out.device)
    for o, t, g in zip(logits.split(chunk), labels.split(chunk), where.split(chunk)):
        keep = t != IGNORE_INDEX
        per = F.cross_entropy(o, t, reduction="none")  # 0 where ignored; masked out below all the same
        loss.index_add_(0, g[keep], per[keep].double())
        count.index_add_(0, g[keep], torch.ones_like(per[keep], dtype=torch.float64))
    return loss, count


def scored_rows(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` as rows (N, C) and ``target`` flat, the :data:`IGNORE_INDEX` rows dropped (no copy when none is):
    what the ensemble of the workers scores (:func:`sdp.rank.eval_ensemble.add_batch`) and what ``sdp-bench
    diagnose`` re-scores from saved weights, so that both drop the same rows."""
    rows, labels = out.reshape(-1, out.shape[-1]), target.reshape(-1)
    keep = labels != IGNORE_INDEX
    return (rows, labels) if bool(keep.all()) else (rows[keep], labels[keep])


def scored(target: torch.Tensor) -> torch.Tensor:
    """How many of ``target``'s entries are scored (not :data:`IGNORE_INDEX`): the count a mean divides by."""
    return (target != IGNORE_INDEX).sum()
