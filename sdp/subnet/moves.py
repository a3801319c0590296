"""Which pieces change hands at a plan re-draw, in what order, and how many bytes: pure functions of
the two plans (every rank derives the same transfers from them without asking the others), used by
the re-draw itself (:mod:`sdp.subnet.redraw`) and by ``sdp-plan``'s prediction of it.

The rule (the one carry has always had): a piece a new holder lacks comes from its lowest old
holder; under backward masking every rank stores every value, so only optimizer state moves, from
the lowest old trainer to the new trainers that lack it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sdp.subnet.carry import Described, shape_of
from sdp.subnet.masking import Piece


@dataclass(frozen=True)
class Move:
    """A piece that changes hands: from ``src`` (its lowest old holder or trainer) to ``dsts``."""

    src: int
    dsts: tuple[int, ...]


def moves(*, old: list[Piece], new: list[Piece], mode: str, world: int) -> tuple[dict[int, Move], dict[int, Move]]:
    """(values, state) that move, by piece index: values under forward masking only (backward masking
    stores every value on every rank), state of every parameter piece some new trainer lacks."""
    assert [(p.name, p.dim, p.start, p.length) for p in old] == [(p.name, p.dim, p.start, p.length) for p in new], \
        "a re-draw changes the holders of pieces, not the pieces"
    everyone = tuple(range(world))
    values: dict[int, Move] = {}
    state: dict[int, Move] = {}
    for i, (a, b) in enumerate(zip(old, new)):
        if mode == "forward" and (lack := tuple(r for r in b.holders if r not in a.holders)):
            values[i] = Move(min(a.holders), lack)
        had, has = (everyone, everyone) if mode == "global" else (a.holders, b.holders)
        if a.is_param and (lack := tuple(r for r in has if r not in had)):
            state[i] = Move(min(had), lack)
    return values, state


def traffic(*, values: dict[int, Move], state: dict[int, Move], pieces: list[Piece], descs: dict[int, Described],
            shapes: dict[str, torch.Size], world: int) -> list[dict[str, int]]:
    """Per rank, the bytes a re-draw sends and receives (``descs``: each moving piece's state)."""
    out = [{"sent_bytes": 0, "received_bytes": 0} for _ in range(world)]

    def add(m: Move, nbytes: int) -> None:
        out[m.src]["sent_bytes"] += nbytes * len(m.dsts)
        for d in m.dsts:
            out[d]["received_bytes"] += nbytes

    for i, m in values.items():
        add(m, pieces[i].nbytes)
    for i, m in state.items():
        numel = math.prod(shape_of(pieces[i], shapes))
        add(m, sum(numel * d[1].itemsize for d in descs.get(i, {}).values() if d[0] == "tensor"))
    return out


def schedule(*, by_name: dict[str, list[int]], old: list[Piece], new: list[Piece], values: dict[int, Move],
             world: int, mode: str) -> list[str]:
    """The order every rank moves the tensors in (one order: the transfers pair up). A rank holds a tensor
    it receives together with the ones it still has to send, so a bad order makes a rank hold a block
    of the new plan and one of the old at once. Shared tensors (kept) go first, then the blocks one at a
    time, each time the block that least raises the fullest rank's bytes above where it started (after
    it dropped what it sends nowhere, :func:`sdp.subnet.redraw.move`). Backward masking moves no values: the model's order."""
    names = list(by_name)
    if mode != "forward":
        return names
    groups: dict[int, list[str]] = {}
    for name in names:
        groups.setdefault(-1 if old[by_name[name][0]].block is None else int(old[by_name[name][0]].block), []).append(name)
    balance = [0] * world
    delta: dict[int, list[int]] = {g: [0] * world for g in groups}
    for g, members in groups.items():
        for name, r in ((n, r) for n in members for r in range(world)):
            a = [i for i in by_name[name] if r in old[i].holders]
            b = [i for i in by_name[name] if r in new[i].holders]
            if a == b:
                continue
            delta[g][r] += sum(new[i].nbytes for i in b)
            freed = sum(old[i].nbytes for i in a)
            if any(r in new[i].holders or (i in values and values[i].src == r) for i in a):
                delta[g][r] -= freed  # at its turn
            else:
                balance[r] -= freed  # before anything moves
    order = sorted(g for g in groups if g < 0)
    left = sorted(g for g in groups if g >= 0)
    while left:
        g = min(left, key=lambda g: (max(balance[r] + delta[g][r] for r in range(world)), g))
        balance = [balance[r] + delta[g][r] for r in range(world)]
        order.append(g)
        left.remove(g)
    return [name for g in order for name in groups[g]]
