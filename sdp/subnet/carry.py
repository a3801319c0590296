"""Carrying optimizer state over a plan re-draw, so that every holder of a unit continues its history.

Why carry rather than reset: a re-draw relabels the workers, so nearly every unit changes hands; a
reset would throw away the momentum (Adam moments, step counts) of nearly every unit at every
re-draw, and keeping only what a rank had before leaves a new co-holder without state, so two holders
of one unit apply different updates from the same gradient and drift apart. Carried, a re-draw
changes who computes a unit, not how it is optimised, and all holders stay bit-identical.

How: the assembly of :mod:`sdp.subnet.assemble`, applied to optimizer state and written straight into
the new layout. State lives per tensor and a tensor is a concatenation of pieces (neuron level), each
with its holders under the old and the new plan. (1) Every rank copies the pieces it trained and
trains again. (2) The lowest old holder of each piece that some new holder lacks describes its state
(keys, kinds, dtypes, scalar values such as Adam's ``step``) in one small all-gather, so that every
rank knows what comes and what to allocate, and state that does not exist yet (before the first
step, SGD without momentum) is created nowhere. (3) Each such piece is broadcast from that holder,
one flat broadcast per source rank, state key and dtype, into the new state tensors (ranks that do not
train the piece receive into scratch, as in assembly). The pieces of one new tensor must agree on
keys, kinds and scalar values, or the re-draw stops naming them. State must be shaped like its
parameter or be a scalar (SGD, Adam(W), RMSprop, Adagrad, ...); other state is refused by name.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdp.distctx import DistContext
from sdp.subnet.masking import Local, Piece, locate, view
from sdp.subnet.sync import broadcast_pieces

# A piece's state as ``{key: description}``; a description is ("tensor", dtype) for state shaped like
# the parameter, ("scalar", dtype, value, on_param_device) for a 0-dim tensor, ("number", value), ("none",).
Described = dict[str, tuple]


def describe(*, key: str, value: Any, param: torch.Tensor) -> tuple:
    """What a receiver needs to rebuild ``value`` (a state entry of ``param``) bit for bit."""
    if value is None:
        return ("none",)
    if isinstance(value, torch.Tensor):
        if value.shape == param.shape:
            return ("tensor", value.dtype)
        if value.dim() == 0:
            return ("scalar", value.dtype, value.item(), value.device == param.device)
    elif isinstance(value, (bool, int, float)):
        return ("number", value)
    raise ValueError(f"optimizer state {key!r} of type {type(value).__name__} "
                     f"(shape {getattr(value, 'shape', None)}) for a parameter of shape {tuple(param.shape)}: "
                     "a re-draw carries state shaped like the parameter or scalar only")


def _rebuild(desc: tuple, *, like: torch.Tensor) -> Any:
    """An entry as ``desc`` says: empty tensors to be filled piece by piece, scalars complete."""
    if desc[0] == "tensor":
        return torch.empty(like.shape, dtype=desc[1], device=like.device)
    if desc[0] == "scalar":
        return torch.tensor(desc[2], dtype=desc[1], device=like.device if desc[3] else "cpu")
    return desc[1] if desc[0] == "number" else None


@torch.no_grad()
def carry_state(*, state: dict[Any, dict[str, Any]], old: list[Piece], old_layout: dict[str, Local],
                new: list[Piece], new_layout: dict[str, Local], params: list[nn.Parameter], every_rank: bool,
                shapes: dict[str, torch.Size], ctx: DistContext) -> dict[nn.Parameter, dict[str, Any]]:
    """The optimizer state of ``params`` (this rank's trainable tensors under ``new_layout``), each
    piece's history taken from its old holders. ``state``: the optimizer's state under ``old_layout``.
    ``every_rank``: every rank trains every piece (backward masking with global refresh), so nothing
    moves. Collective over the world; every rank derives the same collectives from the two plans."""
    n, rank, world = ctx.world_size, ctx.rank, tuple(range(ctx.world_size))
    assert [(p.name, p.dim, p.start, p.length) for p in old] == [(p.name, p.dim, p.start, p.length) for p in new], \
        "a re-draw changes the holders of pieces, not the pieces"

    def trainers(p: Piece) -> tuple[int, ...]:
        return world if every_rank else p.holders

    idx = [i for i, p in enumerate(old) if p.is_param]
    had: dict[int, dict[str, tuple[tuple, Any]]] = {}  # piece -> key -> (description, piece view or value)
    for i in idx:
        if rank in trainers(old[i]):
            spec = locate(old[i], old_layout)
            assert spec is not None, f"rank {rank} trained {old[i].name} but has no storage for it"
            t, dim, start, length = spec
            had[i] = {}
            for key, v in state.get(t, {}).items():
                d = describe(key=key, value=v, param=t)
                had[i][key] = (d, view(v, dim, start, length) if d[0] == "tensor" else v)
    descs: dict[int, Described] = {i: {k: d for k, (d, _) in s.items()} for i, s in had.items()}
    moving = [i for i in idx if not set(trainers(new[i])) <= set(trainers(old[i]))]  # some new trainer lacks it
    moving_set = set(moving)
    if moving:  # (2) the sources describe what they will send
        mine = {i: descs[i] for i in moving if min(trainers(old[i])) == rank}
        gathered: list[Any] = [None] * n
        dist.all_gather_object(gathered, mine)
        ctx.comm.record(kind="all_gather", payload=sum(len(pickle.dumps(g)) for g in gathered), group_size=n)
        for g in gathered:
            descs.update(g)

    # the new tensors, each with its pieces and the state those carry (all pieces must agree)
    trainable = {id(t): t for t in params}
    where: dict[int, tuple[torch.Tensor, int | None, int, int]] = {}
    parts: dict[int, list[int]] = {}
    for i in idx:
        if rank in trainers(new[i]):
            spec = locate(new[i], new_layout)
            if spec is not None and id(spec[0]) in trainable:
                where[i] = spec
                parts.setdefault(id(spec[0]), []).append(i)
    out: dict[nn.Parameter, dict[str, Any]] = {}
    for tid, its in parts.items():
        t = trainable[tid]
        ds = [descs[i] for i in its]
        assert all(d == ds[0] for d in ds), \
            f"rank {rank}: the pieces of one new tensor ({new[its[0]].name}) carry different optimizer state: " \
            f"{[(new[i].name, new[i].start, descs[i]) for i in its]}"
        if ds[0]:
            out[t] = {key: _rebuild(d, like=t) for key, d in ds[0].items()}
    for i, (t, dim, start, length) in where.items():  # (1) what this rank trained and trains again
        if (i not in moving_set or min(trainers(old[i])) == rank) and t in out:  # else (3) brings the source's
            for key, (d, v) in had[i].items():
                if d[0] == "tensor":
                    view(out[t][key], dim, start, length).copy_(v)
    for src in range(n):  # (3) the rest from the lowest old holder, one flat broadcast per (key, dtype)
        items = [i for i in moving if min(trainers(old[i])) == src]
        kinds = sorted({(k, d[1]) for i in items for k, d in descs[i].items() if d[0] == "tensor"}, key=str)
        for key, dtype in kinds:
            sel = [i for i in items if descs[i].get(key, ("",)) == ("tensor", dtype)]
            targets = []
            for i in sel:
                if rank == src:
                    targets.append(had[i][key][1])
                elif i in where and where[i][0] in out:
                    t, dim, start, length = where[i]
                    targets.append(view(out[t][key], dim, start, length))
                else:
                    targets.append(torch.empty(_shape(new[i], shapes), dtype=dtype, device=ctx.device))
            broadcast_pieces([new[i] for i in sel], layout=new_layout, src=src, ranks=world, group=None, rank=rank,
                             comm=ctx.comm, targets=targets)
    return out


def _shape(p: Piece, shapes: dict[str, torch.Size]) -> list[int]:
    shape = list(shapes[p.name])
    if p.dim is not None:
        shape[p.dim] = p.length
    return shape
