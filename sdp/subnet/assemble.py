"""Assembling the full model from the workers' subnetworks (evaluation, checkpoints, re-draws).

Why a fresh copy instead of widening the training module in place: the training module, its
narrowed tensors and the optimizer's references to them must come back exactly as they were, and
a separate transient model (built from a meta-device skeleton) makes that true by construction.
The cost is a transient full copy of parameters and buffers (no gradients, no optimizer state),
reported apart by the strategy.

Order: (1) every rank copies the pieces it has; (2) BatchNorm running statistics are averaged over
the ranks that computed them (holders under forward masking, the world otherwise); (3) under
forward masking each piece a rank lacks is broadcast from its lowest-rank holder, one flat
broadcast per source rank. Rescaling is the strategy's (``set_branch_scales``); BatchNorm
re-estimation is the evaluation protocol's (:mod:`sdp.evaluation`), applied to every strategy.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from sdp.models.base import SDPModel
from sdp.parallel.base import DistContext, average_buffers
from sdp.subnet.masking import Local, Piece, locate, view
from sdp.subnet.plan import Plan
from sdp.subnet.sync import GroupSet, broadcast_pieces, flatten, unflatten


def tensor_map(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


@torch.no_grad()
def assemble(*, skeleton: SDPModel, pieces: list[Piece], layout: dict[str, Local], plan: Plan, masking: str,
             groups: GroupSet, ctx: DistContext) -> SDPModel:
    """The full model with every unit active, identical on every rank."""
    n, rank = ctx.world_size, ctx.rank
    full = copy.deepcopy(skeleton).to_empty(device=ctx.device)
    state = tensor_map(full)

    def target(p: Piece) -> torch.Tensor:
        return view(state[p.name].data, p.dim, p.start, p.length)

    for p in pieces:
        spec = locate(p, layout)
        if spec is not None:
            target(p).copy_(view(*spec))
    if n > 1:
        def ran(p: Piece) -> tuple[int, ...]:
            return p.holders if (masking == "forward" and not p.shared) else tuple(range(n))

        stats = [p for p in pieces if not p.is_param and state[p.name].is_floating_point()]
        for h in sorted({ran(p) for p in stats}, key=lambda h: (len(h), h)):
            items = [p for p in stats if ran(p) == h]
            if rank in h and len(h) > 1:
                views = [target(p) for p in items]
                flat = flatten(views)
                ctx.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=len(h))
                dist.all_reduce(flat, group=groups.get(h))
                unflatten(flat / len(h), views)
    if masking == "forward" and n > 1:
        world = tuple(range(n))
        for src in range(n):
            items = [p for p in pieces if len(p.holders) < n and min(p.holders) == src]
            if items:
                broadcast_pieces(items, layout=layout, src=src, ranks=world, group=None, rank=rank,
                                 comm=ctx.comm, targets=[target(p) for p in items])
    return full


def set_branch_scales(model: SDPModel, plan: Plan, *, scale: float) -> None:
    """Multiply every unit block's residual branch by ``scale`` (1 restores the plain model)."""
    for b in {u.block for u in plan.units}:
        model.blocks[b].branch_scale = scale
