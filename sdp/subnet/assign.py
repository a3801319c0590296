"""Assignment of SDP units to workers: k distinct holders per unit, from per-unit cost vectors.

Pure functions of the normalised (and weighted) cost vectors, apart from the plan and its model so
that the search can be tested alone over many cases in milliseconds. ``cyclic`` and ``random`` are
the paper's simple rules; ``balanced`` minimises the fullest worker's largest resource (LPT, then a
local search over moves and swaps, then an exact branch and bound within a node budget), so that
neither memory nor time has a straggler, **under the constraint that the worker-overlap graph stays
connected** (two workers are linked when they hold a common unit). Why the constraint: without it the
minimax optimum of a model whose units come in equal pairs splits the workers into islands that train
disjoint halves of the network and never exchange a gradient (ResNet-18 on 8 workers at C = 0.5: holder
sets {0-3} and {4-7}), which is not the paper's uniform representation of every parameter. The graph
can be connected iff ``units * (k - 1) >= n - 1`` (:func:`connectable`); below that (k = 1, too few
units) ``balanced`` drops the constraint and the plan warns. :mod:`sdp.subnet.frontier` enumerates
every assignment to check it and to show the trade-off between resources.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

ASSIGNMENTS = ("cyclic", "random", "balanced")


class PlanError(ValueError):
    """A plan that cannot exist; the message names the values."""


def components(*, holders: list[list[int]] | tuple[tuple[int, ...], ...], n: int) -> list[tuple[int, ...]]:
    """The connected components of the worker-overlap graph (a worker holding nothing is its own), in
    order of their smallest worker."""
    parent = list(range(n))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for h in holders:
        for r in h[1:]:
            parent[root(r)] = root(h[0])
    groups: dict[int, list[int]] = {}
    for r in range(n):
        groups.setdefault(root(r), []).append(r)
    return sorted(tuple(g) for g in groups.values())


def connectable(*, n: int, k: int, units: int) -> bool:
    """Whether some assignment connects the n workers: each unit joins at most k - 1 new workers to
    the others, and a chain of units overlapping by one worker reaches that bound."""
    return units * (k - 1) >= n - 1


def assign(*, costs: list[tuple[float, ...]], world_size: int, k: int, method: str, seed: int = 0, draw: int = 0,
           connected: bool = True) -> tuple[tuple[int, ...], ...]:
    """Holder sets (sorted tuples of k distinct ranks), one per unit, for draw ``draw``.

    ``costs`` are per-unit vectors of normalised resources (params, FLOPs, activation bytes).
    ``connected`` (balanced only): keep the worker-overlap graph connected where that is possible
    (False gives the unconstrained minimax optimum, to measure what the constraint costs).
    """
    n = world_size
    if method not in ASSIGNMENTS:
        raise PlanError(f"parallelism.assignment={method!r} is invalid: allowed: {', '.join(ASSIGNMENTS)}")
    if not 1 <= k <= n:
        raise PlanError(f"k={k} holders per unit is impossible with world_size={n}: need 1 <= k <= {n}")
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + draw)
    if method == "random":
        return tuple(tuple(sorted(torch.randperm(n, generator=g)[:k].tolist())) for _ in costs)
    if method == "cyclic":
        holders = [list((u + j) % n for j in range(k)) for u in range(len(costs))]
    else:
        holders = _balanced(costs=costs, n=n, k=k, connected=connected)
    return relabel(holders=holders, n=n, seed=seed, draw=draw)


def relabel(*, holders: list[list[int]] | tuple[tuple[int, ...], ...], n: int, seed: int,
            draw: int) -> tuple[tuple[int, ...], ...]:
    """Draw ``draw``'s holder sets from draw 0's: a seeded permutation of the workers (none for draw 0).
    Why a relabelling: it keeps the balance, the overlap graph's connectivity and the number of
    distinct holder sets (:mod:`sdp.subnet.capped` caps draw 0 and relabels it for the others)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) * 1_000_003 + draw)).tolist() \
        if draw > 0 else list(range(n))
    return tuple(tuple(sorted(perm[r] for r in h)) for h in holders)


def _balanced(*, costs: list[tuple[float, ...]], n: int, k: int, connected: bool) -> list[list[int]]:
    """The minimax search from LPT and from cyclic: each start searched freely, then (where the graph
    can be connected) the free optimum connected by :func:`_connect` and searched again without
    disconnecting moves, and, if that costs more than the free optimum, the start connected and
    searched the same way; the best connected result (the best of all when ``connected`` is False: a
    connected plan is a plan too) seeds the exact branch and bound."""
    keep = connected and connectable(n=n, k=k, units=len(costs))
    done: dict[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], list[list[int]]]] = {}

    def search(holders: list[list[int]], *, linked: bool) -> tuple[tuple[float, ...], list[list[int]]]:
        key = (linked, *map(tuple, holders))
        if key not in done:
            done[key] = _search(costs=costs, n=n, holders=[list(h) for h in holders], connected=linked)
        return done[key]

    free, linked = [], []
    for start in (_lpt(costs=costs, n=n, k=k), [[(u + j) % n for j in range(k)] for u in range(len(costs))]):
        free.append(search(start, linked=False))
        if connectable(n=n, k=k, units=len(costs)):
            linked.append(search(_connect(costs=costs, n=n, holders=free[-1][1]), linked=True))
            if linked[-1][0][:2] > free[-1][0][:2]:  # connecting the free optimum cost something: try the start too
                linked.append(search(_connect(costs=costs, n=n, holders=start), linked=True))
    return _exact(costs=costs, n=n, k=k, start=min(linked if keep else free + linked), connected=keep)[1]


def _loads(*, costs: list[tuple[float, ...]], n: int, holders: list[list[int]]) -> list[list[float]]:
    dims = len(costs[0]) if costs else 0
    load = [[0.0] * dims for _ in range(n)]
    for c, h in zip(costs, holders):
        for r in h:
            load[r] = [a + x for a, x in zip(load[r], c)]
    return load


def _peaks(load: list[list[float]]) -> tuple[float, float]:
    """(the largest load of any resource on any worker, the sum over resources of the fullest worker's)."""
    peaks = [max(row[d] for row in load) for d in range(len(load[0]))] if load and load[0] else [0.0]
    return round(max(peaks), 12), round(sum(peaks), 12)


def _lpt(*, costs: list[tuple[float, ...]], n: int, k: int) -> list[list[int]]:
    """Largest summed cost first, onto the k least-loaded workers."""
    load, count = [0.0] * n, [0] * n
    holders: list[list[int]] = [[] for _ in costs]
    for u in sorted(range(len(costs)), key=lambda i: (-sum(costs[i]), i)):
        holders[u] = sorted(range(n), key=lambda r: (load[r], count[r], r))[:k]
        for r in holders[u]:
            load[r] += sum(costs[u])
            count[r] += 1
    return holders


def _connect(*, costs: list[tuple[float, ...]], n: int, holders: list[list[int]]) -> list[list[int]]:
    """Merge the overlap graph's components, one exchange at a time: each time the single-holder move
    (unit u from worker a to b) or swap (u from a to b and unit v from b to a) between two components
    that merges some and leaves the lowest peaks. A swap of two equal-cost units changes no worker's
    load, so a model whose units come in equal pairs (ResNet stages, Swin, LLaMA) is connected for free.
    Some merging move always exists while the graph can be connected: some component then has a
    redundant membership (a holder whose leaving does not split it), and moving it across merges two."""
    holders = [list(h) for h in holders]
    cost = np.asarray(costs, dtype=np.float64)
    count = len(components(holders=holders, n=n))
    while count > 1:
        comp = {r: i for i, c in enumerate(components(holders=holders, n=n)) for r in c}
        load = np.asarray(_loads(costs=costs, n=n, holders=holders), dtype=np.float64)
        member = np.zeros((len(holders), n), dtype=bool)
        for u, h in enumerate(holders):
            member[u, h] = True
        cands: list[tuple[np.ndarray, np.ndarray, int, int, int, np.ndarray]] = []
        for u, h in enumerate(holders):
            for a in h:
                for b in range(n):
                    if member[u, b] or comp[a] == comp[b]:
                        continue
                    vs = np.flatnonzero(member[:, b] & ~member[:, a])
                    vs = np.concatenate([[-1], vs[vs != u]])  # -1: a move, else a swap with unit v
                    delta = np.where(vs[:, None] >= 0, cost[vs], 0.0) - cost[u]  # a's change, b's is -delta
                    others = np.delete(load, [a, b], axis=0).max(axis=0, initial=0.0)
                    peaks = np.maximum(others, np.maximum(load[a] + delta, load[b] - delta))
                    cands.append((peaks.max(axis=1).round(12), peaks.sum(axis=1).round(12), u, a, b, vs))
        assert cands, f"no exchange crosses the components {components(holders=holders, n=n)}"
        flat = [(m, s, u, a, b, int(v)) for ms, ss, u, a, b, vs in cands for m, s, v in zip(ms, ss, vs)]
        for _, _, u, a, b, v in sorted(flat, key=lambda c: c[:2]):
            trial = [list(h) for h in holders]
            trial[u][trial[u].index(a)] = b
            if v >= 0:
                trial[v][trial[v].index(b)] = a
            if (c := len(components(holders=trial, n=n))) < count:
                holders, count = trial, c
                break
        else:
            raise AssertionError(f"no exchange merges the components {components(holders=holders, n=n)}")
    return holders


def _search(*, costs: list[tuple[float, ...]], n: int, holders: list[list[int]],
            connected: bool = False) -> tuple[tuple[float, ...], list[list[int]]]:
    """Local search over single-holder moves, holder swaps and exchanges of two units' whole holder sets
    (which a chain of single moves cannot make without first raising a peak) that lower (the largest load of any
    resource on any worker, the sum over resources of the most loaded worker, the sum of loads to
    the 8th power, which lowers tied maxima one at a time); with ``connected`` a move that would
    disconnect the overlap graph is refused. ``balanced`` runs it from LPT and from cyclic and keeps
    the better: LPT on a summed cost alone leaves one resource (ResNet's parameters, 4x larger per
    stage) skewed, and the search alone can stop in a local minimum."""
    load = _loads(costs=costs, n=n, holders=holders)

    def objective() -> tuple[float, float, float]:
        return (*_peaks(load), round(sum(x**8 for row in load for x in row), 15))

    def allowed() -> bool:
        return not connected or len(components(holders=holders, n=n)) == 1

    def move(u: int, a: int, b: int) -> None:
        holders[u][holders[u].index(a)] = b
        load[a] = [x - c for x, c in zip(load[a], costs[u])]
        load[b] = [x + c for x, c in zip(load[b], costs[u])]

    def exchange(u: int, v: int) -> None:
        for r in holders[u]:
            load[r] = [x - c + d for x, c, d in zip(load[r], costs[u], costs[v])]
        for r in holders[v]:
            load[r] = [x - c + d for x, c, d in zip(load[r], costs[v], costs[u])]
        holders[u], holders[v] = holders[v], holders[u]

    def improve(best: tuple[float, float, float]) -> tuple[float, float, float] | None:
        """Apply the first allowed move, swap or exchange that lowers the objective; None when none does."""
        for u in range(len(costs)):
            for a in list(holders[u]):
                for b in [r for r in range(n) if r not in holders[u]]:
                    move(u, a, b)
                    if (obj := objective()) < best and allowed():
                        return obj
                    for v in range(len(costs)):  # swap: v gives b's place to a in exchange
                        if v != u and b in holders[v] and a not in holders[v]:
                            move(v, b, a)
                            if (obj := objective()) < best and allowed():
                                return obj
                            move(v, a, b)
                    move(u, b, a)
        for u, v in itertools.combinations(range(len(costs)), 2):  # exchange: u and v trade holder sets
            if holders[u] != holders[v]:
                exchange(u, v)
                if (obj := objective()) < best and allowed():
                    return obj
                exchange(u, v)
        return None

    best = objective()
    for _ in range(200):
        if (nxt := improve(best)) is None:
            break
        best = nxt
    return best, holders


def _exact(*, costs: list[tuple[float, ...]], n: int, k: int, start: tuple[tuple[float, ...], list[list[int]]],
           connected: bool = False, space: int = 1_000_000,
           budget: int = 50_000) -> tuple[tuple[float, ...], list[list[int]]]:
    """Branch and bound over every assignment, seeded with the local search's ``start``: minimises the
    worst worker's largest normalised load (then the sum of the per-resource peaks), exactly when it
    finishes within ``budget`` nodes, else returns the best found; skipped (``start`` returned) when
    the space, C(n, k) ** (units - 1), exceeds ``space`` (a handful of units: ResNet-18's 8 blocks on
    4 workers is 6 ** 7). Why: the local search stops in local minima that matter at small unit
    counts (ResNet-18 at C=0.5 on 4 workers: 0.544 instead of 0.537 of the parameters on the fullest
    worker). Units go largest first; the first unit's holders are fixed (workers are interchangeable).
    With ``connected`` only assignments whose overlap graph is connected count (``start`` must be
    one), and a branch is cut as soon as its units left cannot join its components any more (each
    unit joins at most k - 1)."""
    order = sorted(range(len(costs)), key=lambda u: -max(costs[u]))
    combos = list(itertools.combinations(range(n), k))
    if not costs or len(combos) ** (len(costs) - 1) > space:
        return start
    best_obj, best = start[0], [list(h) for h in start[1]]
    load = [[0.0] * len(costs[0]) for _ in range(n)]
    chosen: list[tuple[int, ...]] = [()] * len(costs)
    nodes = 0

    def dfs(i: int) -> None:
        nonlocal best_obj, best, nodes
        nodes += 1
        if nodes > budget:
            return
        if connected and len(components(holders=[chosen[u] for u in order[:i]], n=n)) - 1 > (len(order) - i) * (k - 1):
            return
        if i == len(order):
            obj = _peaks(load)
            if obj < best_obj[:2]:
                best_obj, best = obj, [list(h) for h in chosen]
            return
        u = order[i]
        for h in combos if i else combos[:1]:
            for r in h:
                load[r] = [a + c for a, c in zip(load[r], costs[u])]
            if max(max(load[r]) for r in h) <= best_obj[0] + 1e-12:
                chosen[u] = h
                dfs(i + 1)
            for r in h:
                load[r] = [a - c for a, c in zip(load[r], costs[u])]

    dfs(0)
    return best_obj, best
