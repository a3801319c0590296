"""Assembling the full model from the workers' subnetworks (evaluation, checkpoints).

Why a fresh copy instead of widening the training module in place: the training module, its
narrowed tensors and the optimizer's references to them must come back exactly as they were, and
a separate transient model (built from a meta-device skeleton) makes that true by construction.

Two shapes: :func:`assemble` builds the whole model at once (a model that cannot be cut into parts:
a transient full copy of parameters and buffers); :class:`PartwiseAssembly`
builds it one top-level part at a time (stem, each block, head) for evaluation, so a rank holds its
own state plus one part, never the full model (:mod:`sdp.rank.evaluation` runs the part and drops it).
Re-draws do not assemble: :mod:`sdp.subnet.redraw` moves only the pieces that change hands.

Order: (1) every rank copies the pieces it has; (2) BatchNorm running statistics are averaged over
the ranks that computed them (holders under forward masking, the world otherwise); (3) under
forward masking each piece a rank lacks is broadcast from its lowest-rank holder to the ranks that
lack it (its holder set's refresh set, not the world), one flat broadcast per holder set. Rescaling
is the strategy's (``set_branch_scales``); BatchNorm re-estimation is the evaluation protocol's
(:mod:`sdp.rank.evaluation`), applied to every strategy.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from sdp.models.base import ResidualBlock, SDPModel
from sdp.models.gates import Gates, fold
from sdp.core.distctx import DistContext, flatten, unflatten
from sdp.subnet.masking import Local, Piece, locate, view
from sdp.subnet.plan import Plan
from sdp.subnet.holder_groups import GroupSet
from sdp.subnet.sync import broadcast_pieces


def tensor_map(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


@torch.no_grad()
def assemble(*, skeleton: SDPModel, pieces: list[Piece], layout: dict[str, Local], plan: Plan, masking: str,
             groups: GroupSet, ctx: DistContext) -> SDPModel:
    """The full model with every unit active, identical on every rank."""
    full = copy.deepcopy(skeleton).to_empty(device=ctx.device)
    fill(state=tensor_map(full), pieces=pieces, layout=layout, masking=masking, groups=groups, ctx=ctx)
    return full


@torch.no_grad()
def assemble_part(*, skeleton: SDPModel, name: str, pieces: list[Piece], layout: dict[str, Local], masking: str,
                  groups: GroupSet, ctx: DistContext) -> nn.Module:
    """One top-level part of the full model (``"stem"``, ``"blocks.3"``, ``"head"``), identical on every
    rank: the same three steps as :func:`assemble`, restricted to the part's pieces. Collective: every
    rank calls it with the same ``name``."""
    part = copy.deepcopy(skeleton.get_submodule(name)).to_empty(device=ctx.device)
    state = {f"{name}.{k}": t for k, t in tensor_map(part).items()}
    mine = [p for p in pieces if p.name in state]
    assert {p.name for p in mine} == set(state), \
        f"part {name}: tensors without a piece {sorted(set(state) - {p.name for p in mine})[:5]} (tied weights?)"
    fill(state=state, pieces=mine, layout=layout, masking=masking, groups=groups, ctx=ctx, in_place=True)
    return part


def fill(*, state: dict[str, torch.Tensor], pieces: list[Piece], layout: dict[str, Local], masking: str,
         groups: GroupSet, ctx: DistContext, in_place: bool = False) -> None:
    """Write ``pieces`` into ``state`` (full-model tensor names -> empty tensors): this rank's own
    pieces copied, floating-point buffers averaged over the ranks that computed them, the pieces this
    rank lacks broadcast from their lowest-rank holder over that holder set's refresh set (the source
    and every non-holder, :func:`sdp.subnet.holder_groups.refresh_set`: the other holders already hold
    the values, so they are not sent them again). One flat broadcast per holder set; with ``in_place``,
    one broadcast per piece straight into its tensor, so no flat copy of the part exists and none is
    left to the backend's worker thread to free: a part's evaluation peak is the part. ``groups`` must
    hold the refresh sets (:func:`sdp.subnet.holder_groups.with_refresh_sets`). The same ``pieces`` list
    on every rank and holder sets in one order (size, then ranks), so each rank's collectives are a
    subsequence of one order over overlapping groups, which cannot deadlock."""
    n, rank = ctx.world_size, ctx.rank

    def target(p: Piece) -> torch.Tensor:
        return view(state[p.name].data, p.dim, p.start, p.length)

    for p in pieces:
        spec = locate(p, layout)
        if spec is not None:
            target(p).copy_(view(*spec))
    if n > 1:
        average_statistics(pieces=[p for p in pieces if not p.is_param and state[p.name].is_floating_point()],
                           target=target, masking=masking, rank=rank, world_size=n, reduce=_holder_sum(groups=groups, ctx=ctx))
    if masking == "forward" and n > 1:
        for h, items in fill_sends(pieces, world=n):
            ranks, src = groups.refresh_set(h), min(h)
            if rank not in ranks:  # a holder other than the source: it has these values, it takes no part
                continue
            group = groups.get(ranks)
            if not in_place:
                broadcast_pieces(items, layout=layout, src=src, ranks=ranks, group=group, rank=rank,
                                 comm=ctx.comm, targets=[target(p) for p in items])
            for p in items if in_place else ():
                t = target(p)
                buf = t if t.is_contiguous() else t.contiguous()  # a narrowed slice (neuron level) goes via a copy
                ctx.comm.record(kind="broadcast", payload=buf.numel() * buf.element_size() if rank == src else 0,
                                group_size=len(ranks))
                dist.broadcast(buf, src=src, group=group)
                if buf is not t:
                    t.copy_(buf)


def fill_sends(pieces: list[Piece], *, world: int) -> list[tuple[tuple[int, ...], list[Piece]]]:
    """What :func:`fill` broadcasts under forward masking, in its one order: each holder set of fewer than
    ``world`` ranks (by size, then ranks) with its pieces, sent from the set's lowest rank over its refresh set.
    Shared with ``sdp-plan``'s prediction of the same broadcasts (:mod:`sdp.parallel.sdp_traffic`)."""
    sets = sorted({p.holders for p in pieces if len(p.holders) < world}, key=lambda h: (len(h), h))
    return [(h, [p for p in pieces if p.holders == h]) for h in sets]


def average_statistics(*, pieces: list[Piece], target: Callable[[Piece], torch.Tensor], masking: str, rank: int,
                       world_size: int, reduce: Callable[[torch.Tensor, tuple[int, ...]], None]) -> None:
    """Average floating-point buffer ``pieces`` (BatchNorm statistics) in place over the ranks that computed
    them: a unit's holders under forward masking, the world otherwise; one flat ``reduce`` (a sum over the
    rank set) per set, in one order on every rank. ``target(piece)``: this rank's tensor view of it. Shared by
    assembly and re-draws (:mod:`sdp.subnet.redraw`), so both average with the same flat layout, bit for bit."""
    world = tuple(range(world_size))

    def ran(p: Piece) -> tuple[int, ...]:
        return p.holders if (masking == "forward" and not p.shared) else world

    for h in sorted({ran(p) for p in pieces}, key=lambda h: (len(h), h)):
        items = [p for p in pieces if ran(p) == h]
        if rank in h and len(h) > 1:
            views = [target(p) for p in items]
            flat = flatten(views)
            reduce(flat, h)
            unflatten(flat / len(h), views)


def _holder_sum(*, groups: GroupSet, ctx: DistContext) -> Callable[[torch.Tensor, tuple[int, ...]], None]:
    """The ``reduce`` of :func:`average_statistics` on the ranks: an all-reduce SUM over the holder set's
    process group, recorded as traffic of the current comm phase."""
    def reduce(flat: torch.Tensor, h: tuple[int, ...]) -> None:
        ctx.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=len(h))
        dist.all_reduce(flat, group=groups.get(h))
    return reduce


@contextmanager
def own_evaluated(*, module: nn.Module, pieces: list[Piece], layout: dict[str, Local], masking: str, groups: GroupSet,
                  ctx: DistContext, average: bool) -> Iterator[nn.Module]:
    """This rank's own subnetwork ``module`` (its pieces in ``layout``) in eval mode for the block. With
    ``average`` (``eval.bn=average``) its BatchNorm statistics are meanwhile those of the assembled model's units
    it holds: averaged over the ranks that ran each, exactly as :func:`fill` averages the assembled model's (the
    same pieces, holder sets and arithmetic; traffic of comm phase "eval"). Why: one BatchNorm rule for every
    evaluated model, so a worker's own subnetwork and the workers' ensemble are evaluated on the statistics the
    assembled model uses (at C = 1 the assembled model itself, bit for bit). This rank's own values and train
    mode come back after: evaluation never changes training. Collective over each holder set."""
    def target(p: Piece) -> torch.Tensor:
        spec = locate(p, layout)
        assert spec is not None, f"rank {ctx.rank} averages statistics piece {p.name} it does not hold (holders {p.holders})"
        return view(*spec)

    mine = [p for p in pieces if average and not p.is_param and locate(p, layout) is not None and target(p).is_floating_point()]
    kept = [target(p).clone() for p in mine]
    if mine and ctx.world_size > 1:
        with ctx.comm.phase_as("eval"):
            average_statistics(pieces=mine, target=target, masking=masking, rank=ctx.rank, world_size=ctx.world_size,
                               reduce=_holder_sum(groups=groups, ctx=ctx))
    module.eval()
    try:
        yield module
    finally:
        module.train()
        for p, value in zip(mine, kept):
            target(p).copy_(value)


def split_blocks(plan: Plan) -> dict[int, bool]:
    """Unit block index -> whether the plan splits it into groups (neuron level, hidden dims declared)."""
    return {u.block: u.group is not None for u in plan.units}


def set_branch_scales(model: SDPModel, plan: Plan, *, scale: float, gates: Gates | None = None) -> None:
    """Scale every unit by ``scale`` (1 restores the plain model): a whole-block unit's residual branch,
    a split unit's split sub-branch outputs only (:meth:`ResidualBlock.set_scale`); with ``gates`` (assembly
    calibration's, :mod:`sdp.parallel.sdp_calibrate`) each unit's fitted gates are folded in after."""
    for b, split in split_blocks(plan).items():
        scale_unit(model.blocks[b], block=b, split=split, scale=scale, gates=gates)


def scale_unit(unit: nn.Module, *, block: int, split: bool, scale: float, gates: Gates | None) -> None:
    """One unit of :func:`set_branch_scales` (also a part of :class:`PartwiseAssembly`): its scale, then its gates
    folded into its weights (:func:`sdp.models.gates.fold`), which replace the scale."""
    assert isinstance(unit, ResidualBlock), f"unit blocks.{block} is a {type(unit).__name__}, not a ResidualBlock"
    unit.set_scale(scale, split=split)
    if gates is not None:
        fold(unit, gates[block])


class PartwiseAssembly:
    """The assembled model as its parts, ``head(blocks(stem(x)))``, each built on demand.

    ``part(i)`` is collective (every rank calls it with the same ``i``, in the same order) and returns
    a transient module in eval mode with every unit active and scaled by ``scale`` (as
    :func:`set_branch_scales`: a split unit's split sub-branches only; ``gates``: folded in instead);
    :func:`sdp.rank.evaluation.totals` runs it on a chunk of batches and drops it before the next part, so
    the evaluation peak is this rank's own state, the largest part (received flat, then unflattened)
    and one chunk's activations. ``part_bytes`` records the largest part built (summary.json)."""

    def __init__(self, *, skeleton: SDPModel, pieces: list[Piece], layout: dict[str, Local], plan: Plan,
                 masking: str, groups: GroupSet, ctx: DistContext, scale: float, gates: Gates | None = None) -> None:
        self.skeleton, self.pieces, self.layout, self.masking, self.groups, self.ctx = skeleton, pieces, layout, masking, groups, ctx
        self.names = partwise_names(skeleton)
        self.units = {f"blocks.{b}": (b, split) for b, split in split_blocks(plan).items()}
        self.scale, self.gates = scale, gates
        self.part_bytes = 0
        self.has_batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
                                  for m in skeleton.modules())

    def __len__(self) -> int:
        return len(self.names)

    def part(self, i: int) -> nn.Module:
        name = self.names[i]
        m = assemble_part(skeleton=self.skeleton, name=name, pieces=self.pieces, layout=self.layout,
                          masking=self.masking, groups=self.groups, ctx=self.ctx)
        if name in self.units:
            b, split = self.units[name]
            scale_unit(m, block=b, split=split, scale=self.scale, gates=self.gates)
        self.part_bytes = max(self.part_bytes, sum(t.numel() * t.element_size() for t in tensor_map(m).values()))
        return frozen_part(m)


def frozen_part(part: nn.Module) -> nn.Module:
    """``part`` in eval mode with no parameter requiring gradients. Why the latter: torch's autocast caches the
    bf16 cast of every leaf tensor that requires grad for the whole autocast region, and its cache keeps the
    float32 source alive too; the trainer evaluates under one region, so every part built and "dropped" would
    stay in memory with its cast until the evaluation ends: the whole assembled model, 1.5x its float32 bytes
    (measured on the CPU tracker and on an H200). Parameters that require no gradient are cast per call and
    freed with the part. sdp-plan's rehearsal (:func:`sdp.parallel.plan_peaks.rehearse_partwise`) builds its parts with it too."""
    return part.requires_grad_(False).eval()


def partwise_names(model: SDPModel) -> list[str]:
    """The top-level parts of ``model`` in forward order, or [] when the model cannot be evaluated part
    by part: its forward is not the template's ``head(blocks(stem(x)))``, or a tensor is tied across
    parts (an LM head sharing the embedding: the part would lack the tensor)."""
    if type(model).forward is not SDPModel.forward:
        return []
    names = ["stem", *(f"blocks.{i}" for i in range(len(model.blocks))), "head"]
    owner: dict[int, str] = {}
    for part in names:
        for t in tensor_map(model.get_submodule(part)).values():
            if owner.setdefault(id(t), part) != part:
                return []
    return names
