"""A cap on the process groups an SDP plan needs (``parallelism.max_holder_sets``).

Why: SDP averages each unit's gradient over its holders, so it creates one process group per distinct
holder set of size 2 .. n - 1 (units, and at neuron level the union of a block's unit holders for the
block's unsplit remainder; a set of all n workers is the default group, a single worker needs none).
With NCCL every group is a communicator with its own device buffers, outside the caching allocator:
neuron-level ResNet-18 on 8 workers at C = 0.5 needs 18 of them. The cap trades balance for fewer
communicators: the balanced plan is kept when it needs no more than the cap; otherwise units are
re-placed on a family of ``cap`` holder sets (ring windows of k workers spaced n / cap apart, so the
family covers every worker and overlapping neighbours keep the worker-overlap graph connected; beyond
n windows, the sets the balanced plan uses most), by a greedy placement that never passes the cap and a
local search over moves and exchanges that lowers the same minimax objective as ``balanced``.
"""

from __future__ import annotations

import math

from sdp.subnet.assign import PlanError, _loads, _peaks, components, connectable


def groups_needed(*, holders: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], unions: list[list[int]], n: int) -> set[tuple[int, ...]]:
    """The rank sets that become process groups: distinct unit holder sets and unions of size 2 .. n - 1."""
    sets = {tuple(sorted(h)) for h in holders}
    sets |= {tuple(sorted({r for u in us for r in holders[u]})) for us in unions if us}
    return {s for s in sets if 1 < len(s) < n}


def minimum_cap(*, n: int, k: int) -> int:
    """The fewest holder sets that give every worker a unit (1 < k < n); 0 when no group is needed."""
    return 0 if k in (1, n) else math.ceil(n / k)


def family(*, n: int, k: int, cap: int, used: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    windows = min(cap, n)
    fam = list(dict.fromkeys(tuple(sorted((n * i // windows + j) % n for j in range(k))) for i in range(windows)))
    for h in sorted(set(used), key=lambda h: -used.count(h)):
        if len(fam) >= cap:
            break
        if h not in fam:
            fam.append(h)
    return fam


def cap_holder_sets(*, costs: list[tuple[float, ...]], holders: tuple[tuple[int, ...], ...], n: int, k: int, cap: int,
                    unions: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """``holders`` unchanged if they need at most ``cap`` process groups, else a plan within the cap."""
    need = minimum_cap(n=n, k=k)
    if cap < need:
        raise PlanError(f"parallelism.max_holder_sets={cap} is too small: {n} workers with k={k} holders per unit need "
                        f"at least {need} holder sets so that every worker holds a unit")
    if len(groups_needed(holders=holders, unions=unions, n=n)) <= cap:
        return holders
    fam = family(n=n, k=k, cap=cap, used=list(holders))
    keep = connectable(n=n, k=k, units=len(costs))
    placed: list[list[int]] = [[] for _ in costs]
    union_of = {u: us for us in unions for u in us}

    def count() -> int:
        return len(groups_needed(holders=[tuple(h) for h in placed], unions=[[u for u in us if placed[u]] for us in unions], n=n))

    for u in sorted(range(len(costs)), key=lambda u: -max(costs[u])):  # greedy, largest unit first
        best = None
        same = next((placed[v] for v in union_of.get(u, []) if placed[v]), None)
        for h in fam:
            placed[u] = list(h)
            if count() <= cap:
                score = _peaks(_loads(costs=costs, n=n, holders=[p for p in placed if p]))
                if best is None or score < best[0]:
                    best = (score, list(h))
        if best is None:  # the cap is full: a set this unit's block (or, for its first unit, any unit) already uses
            same = same or next(p for p in placed if p and tuple(p) in fam)
        placed[u] = best[1] if best is not None else list(same)
    return tuple(tuple(sorted(h)) for h in _improve(costs=costs, n=n, holders=placed, fam=fam, cap=cap, unions=unions,
                                                      connected=keep))


def _improve(*, costs: list[tuple[float, ...]], n: int, holders: list[list[int]], fam: list[tuple[int, ...]], cap: int,
             unions: list[list[int]], connected: bool) -> list[list[int]]:
    """Moves of one unit to another family set and exchanges of two units' sets that lower the objective
    and keep the plan within the cap (and connected where it already is or can be made so)."""

    def objective() -> tuple[float, ...]:
        load = _loads(costs=costs, n=n, holders=holders)
        return (*_peaks(load), round(sum(x**8 for row in load for x in row), 15))

    def ok() -> bool:
        if len(groups_needed(holders=holders, unions=unions, n=n)) > cap:
            return False
        return not connected or len(components(holders=holders, n=n)) == 1 or not was_connected

    was_connected = len(components(holders=holders, n=n)) == 1
    best = objective()
    for _ in range(200):
        improved = False
        for u in range(len(costs)):
            for h in fam:
                old = holders[u]
                if list(h) == old:
                    continue
                holders[u] = list(h)
                if (obj := objective()) < best and ok():
                    best, improved = obj, True
                    break
                holders[u] = old
        for u in range(len(costs)):
            for v in range(u + 1, len(costs)):
                if holders[u] != holders[v]:
                    holders[u], holders[v] = holders[v], holders[u]
                    if (obj := objective()) < best and ok():
                        best, improved = obj, True
                    else:
                        holders[u], holders[v] = holders[v], holders[u]
        if not improved:
            break
        was_connected = was_connected or len(components(holders=holders, n=n)) == 1
    return holders
