"""Distillation during SDP's consolidation (``parallelism.distill_alpha``, :mod:`sdp.parallel.sdp_consolidate`): the
frozen teacher and the chunked KL term.

Why a module of its own: the KL term's memory rule (no vocabulary-sized float32 copy of the batch) is its own
piece of arithmetic, used by the ranks and by ``sdp-plan``'s rehearsal (:mod:`sdp.parallel.sdp_peaks`) alike.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdp.data.base import IGNORE_INDEX


def frozen_teacher(module: nn.Module) -> nn.Module:
    """A frozen copy of the worker's own subnetwork at the switch, in eval mode (dropout off, its own BatchNorm
    statistics): the teacher distillation fits, never updated."""
    teacher = copy.deepcopy(module)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


KL_CHUNK_ROWS = 1024  # rows (positions) of the logits per chunk of the distillation term, forward and backward


class _ChunkedKL(torch.autograd.Function):
    """``sum_rows w_row KL(softmax(teacher_row) || softmax(student_row))`` and its gradient in the student's logits,
    ``w_row (softmax(student_row) - softmax(teacher_row))``, computed ``chunk`` rows at a time in float32.

    Why not autograd over the whole batch: its log-softmaxes, the teacher's probabilities and the KL's product would
    each be a float32 copy of all the vocabulary-sized logits, kept for the backward (at LLaMA 1B with GPT-2's
    vocabulary, 8 x 1024 positions, some 1.5 GiB apiece, ``sdp-bench one-model-scale``); here only the two logits
    tensors the step already holds are kept, and one chunk's float32 work is live at a time (the backward recomputes
    the softmaxes, cheap beside the model)."""

    @staticmethod
    def forward(ctx: Any, student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,  # type: ignore[override]
                chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for s, t, w in zip(student.split(chunk), teacher.split(chunk), weights.split(chunk)):
            log_s, log_t = F.log_softmax(s.float(), dim=-1), F.log_softmax(t.float(), dim=-1)
            total += ((log_t.exp() * (log_t - log_s)).sum(-1) * w).sum()
        ctx.save_for_backward(student, teacher, weights)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        student, teacher, weights = ctx.saved_tensors
        out = torch.empty_like(student)
        for start in range(0, student.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            diff = F.softmax(student[rows].float(), dim=-1) - F.softmax(teacher[rows].float(), dim=-1)
            out[rows] = (diff * (weights[rows] * grad)[:, None]).to(out.dtype)
        return out, None, None, None


def distilled_loss(*, ce: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor,
                   alpha: float, chunk: int = KL_CHUNK_ROWS) -> torch.Tensor:
    """``(1 - alpha) ce + alpha KL(teacher || student)`` over the last dimension (classes, vocabulary), averaged over
    the positions the cross-entropy averages over: the scored targets (not :data:`~sdp.data.base.IGNORE_INDEX`);
    the KL ``chunk`` positions at a time (:class:`_ChunkedKL`: no vocabulary-sized float32 copy of the batch)."""
    scored = (targets.reshape(-1) != IGNORE_INDEX).float()
    kl = _ChunkedKL.apply(student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1]).detach(),
                          scored, chunk)
    return (1 - alpha) * ce + alpha * kl / scored.sum().clamp(min=1)
