"""Scalar gates on the residual branches of a model's blocks, and their folding into the weights.

Why: SDP's assembled model chains blocks that were never trained together, and evaluation corrects the magnitude
of every branch by one fixed factor (``parallelism.rescale=eval``: k/n). Assembly calibration
(:mod:`sdp.parallel.sdp_calibrate`) replaces that factor by one fitted scalar per residual branch. A gate is read
by the block's forward through :meth:`ResidualBlock.gain <sdp.models.base.ResidualBlock.gain>`; once fitted it is
folded into the tensors the branch's output is linear in at its end
(:meth:`~sdp.models.base.ResidualBlock.gated_branches`: the last linear layer's weight and bias, or the closing
norm's scale and shift), so the calibrated model is a plain model: the same inference, no gate left.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from sdp.models.base import ResidualBlock, SDPModel

Gates = dict[int, dict[str, float]]
"""Fitted gates: block index -> branch name (a key of ``gated_branches``) -> value."""


def layout(model: SDPModel, *, blocks: Iterable[int]) -> list[tuple[int, str]]:
    """(block, branch) of every gate, in block order then each block's declared branch order: the positions of
    the gate vector :func:`attach` makes. A block that declares no branch is refused, naming it."""
    out = []
    for b in blocks:
        block = model.blocks[b]
        branches = block.gated_branches() if isinstance(block, ResidualBlock) else {}
        assert branches, f"blocks.{b} ({type(block).__name__}) declares no gated residual branch (gated_branches)"
        out.extend((b, branch) for branch in branches)
    return out


def attach(model: SDPModel, *, blocks: Iterable[int], init: float, device: torch.device) -> tuple[nn.Parameter, list[tuple[int, str]]]:
    """One gate per residual branch of ``blocks``, all at ``init`` (the factor the forward applied before), as one
    trainable vector each block reads its entries of; returns it and its :func:`layout`. :func:`remove` undoes it."""
    where = layout(model, blocks=blocks)
    vector = nn.Parameter(torch.full((len(where),), float(init), dtype=torch.float32, device=device))
    for b in sorted({b for b, _ in where}):
        model.blocks[b].gates = (vector, {branch: i for i, (bb, branch) in enumerate(where) if bb == b})
    return vector, where


def remove(model: SDPModel, *, blocks: Iterable[int]) -> None:
    """Take the gates off ``blocks``: their forward reads ``branch_scale`` again."""
    for b in blocks:
        model.blocks[b].gates = None


def values(vector: torch.Tensor, where: list[tuple[int, str]]) -> Gates:
    """The gate vector as plain floats by block and branch (what is kept, recorded and folded)."""
    out: Gates = {}
    for (b, branch), g in zip(where, vector.detach().float().cpu().tolist()):
        out.setdefault(b, {})[branch] = float(g)
    return out


@torch.no_grad()
def fold(block: ResidualBlock, gates: dict[str, float]) -> None:
    """Multiply each gated branch's end tensors by its gate and set ``branch_scale`` to 1 (the gates replace
    the factor): the block then computes what it computed with the gates, up to float rounding, with no gate."""
    declared = block.gated_branches()
    unknown = sorted(set(gates) - set(declared))
    assert not unknown, f"{type(block).__name__}: gates for branches {unknown}, it declares {sorted(declared)}"
    for branch, g in gates.items():
        for name in declared[branch]:
            block.get_parameter(name).mul_(g)
    block.branch_scale = 1.0
