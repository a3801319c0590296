"""The training loss of every strategy, in a module that imports nothing from ``sdp``: the trainer
and the driver-side predictions (:mod:`sdp.planning.plan_entries`, :mod:`sdp.planning.plan_peaks`, which the strategy
modules call) share it without importing the trainer."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; LM logits (B, T, V) and targets (B, T) are flattened."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
