"""Carrying optimizer state over a plan re-draw, so that every holder of a unit continues its history.

Why carry rather than reset: a re-draw relabels the workers, so nearly every unit changes hands; a
reset would throw away the momentum (Adam moments, step counts) of nearly every unit at every
re-draw, and keeping only what a rank had before leaves a new co-holder without state, so two holders
of one unit apply different updates from the same gradient and drift apart. Carried, a re-draw
changes who computes a unit, not how it is optimised, and all holders stay bit-identical.

How: the state moves with the parameters, piece by piece, through the one piece mover of
:mod:`sdp.subnet.redraw` (the trainers of a piece in place of its holders). This module says what moves:
the lowest old trainer of each piece that some new trainer lacks describes its state (keys, kinds,
dtypes, scalar values such as Adam's ``step``) in one small all-gather, so that every rank knows what
comes and what to allocate, and state that does not exist yet (before the first step, SGD without
momentum) is created nowhere. The pieces of one new tensor must agree on keys, kinds and scalar
values, or the re-draw stops naming them. State must be shaped like its
parameter or be a scalar (SGD, Adam(W), RMSprop, Adagrad, ...); other state is refused by name.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from sdp.core.distctx import DistContext
from sdp.subnet.masking import Local, Piece, locate

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
        if value.dim() == 0:  # on meta (the planner's fused step counter, on the parameter's device) it has no value:
            # a zero of its dtype stands in, of the run's Python type (a float pickles to the same bytes whatever it is)
            item = torch.zeros((), dtype=value.dtype).item() if value.is_meta else value.item()
            return ("scalar", value.dtype, item, value.device == param.device)
    elif isinstance(value, (bool, int, float)):
        return ("number", value)
    raise ValueError(f"optimizer state {key!r} of type {type(value).__name__} "
                     f"(shape {getattr(value, 'shape', None)}) for a parameter of shape {tuple(param.shape)}: "
                     "a re-draw carries state shaped like the parameter or scalar only")


def rebuild(desc: tuple, *, like: torch.Tensor) -> Any:
    """An entry as ``desc`` says: empty tensors to be filled piece by piece, scalars complete."""
    if desc[0] == "tensor":
        return torch.empty(like.shape, dtype=desc[1], device=like.device)
    if desc[0] == "scalar":
        return torch.tensor(desc[2], dtype=desc[1], device=like.device if desc[3] else "cpu")
    return desc[1] if desc[0] == "number" else None


def descriptions(*, state: dict[Any, dict[str, Any]], old: list[Piece], old_layout: dict[str, Local],
                 trainers: Callable[[Piece], tuple[int, ...]], moving: list[int], rank: int,
                 gather: Callable[[dict[int, Described]], list[dict[int, Described]]]) -> dict[int, Described]:
    """Piece index -> its optimizer state's description: every parameter piece this rank trained under
    the old plan (from ``state``, keyed by the old tensors of ``old_layout``), and every piece in
    ``moving`` (some new trainer lacks it), described by its lowest old trainer and shared through
    ``gather`` (one small all-gather on the ranks, skipped when nothing moves: every rank derives
    ``moving`` from the same two plans).

    The keys are interned. A piece received at an earlier re-draw keeps the key strings its description was
    unpickled with: equal to the optimizer's own, but other objects, which pickle writes out in full again
    where it would refer back to the first (16 bytes more for SGD's key, 24 for Adam's three, per such set).
    Interned, the all-gather's payload is a function of the plans and the optimizer alone, not of the state's
    history, and ``sdp-plan`` predicts it byte for byte (:func:`sdp.parallel.sdp_traffic.redraw_traffic`)."""
    out: dict[int, Described] = {}
    for i, p in enumerate(old):
        if p.is_param and rank in trainers(p):
            spec = locate(p, old_layout)
            assert spec is not None, f"rank {rank} trained {p.name} but has no storage for it"
            t = spec[0]
            out[i] = {sys.intern(key): describe(key=key, value=v, param=t) for key, v in state.get(t, {}).items()}
    if moving:
        for got in gather({i: out[i] for i in moving if min(trainers(old[i])) == rank}):
            for i, d in got.items():
                out.setdefault(i, d)
    return out


def gather_descriptions(mine: dict[int, Described], *, ctx: DistContext) -> list[dict[int, Described]]:
    """Every rank's ``mine`` (the ``gather`` of :func:`descriptions` on the ranks), recorded as one all-gather."""
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    ctx.comm.record(kind="all_gather", payload=sum(len(pickle.dumps(g)) for g in gathered), group_size=ctx.world_size)
    return gathered


def shape_of(p: Piece, shapes: dict[str, torch.Size]) -> list[int]:
    """The shape of piece ``p`` of a tensor shaped ``shapes[p.name]`` (its slice along ``p.dim``)."""
    shape = list(shapes[p.name])
    if p.dim is not None:
        shape[p.dim] = p.length
    return shape
