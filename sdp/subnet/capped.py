"""A cap on the process groups an SDP plan needs (``parallelism.max_holder_sets``).

Why: SDP averages each unit's gradient over its holders, so it creates one process group per distinct
holder set of size 2 .. n - 1 (units, and at neuron level the union of a block's unit holders for the
block's unsplit remainder; a set of all n workers is the default group, a single worker needs none).
With NCCL every group is a communicator with its own device buffers, outside the caching allocator,
and a neuron-level plan can need one per block on top of its unit sets. The cap trades balance for
fewer communicators, never what ``balanced`` keeps: every worker holds a unit (where units x k >= n)
and the worker-overlap graph is connected (where :func:`sdp.subnet.assign.connectable`).

The balanced plan is kept when it needs no more than the cap. Otherwise the best plan found within
the cap wins, searched from two kinds of seed: (1) units placed greedily (largest first) on a
*family* of k-sets that itself connects and covers the workers: windows of k consecutive workers,
evenly spaced on a ring, or on a line with each spacing of consecutive windows (a chain of heavy
windows linked by light ones balances best when few sets are allowed: 8 workers, k = 2, 7 sets is
the path 0-1-...-7); a neuron-level block's units go together onto one set or spread over sets that
hold every worker, so that its remainder needs no group of its own; (2) the balanced plan with its
sets merged one at a time. The best seeds are improved by a local search (moves, whole-block moves,
exchanges, a set trading a worker) that lowers the same minimax objective as ``balanced`` and never
passes the cap, disconnects the workers or idles one. A cap that no such plan fits is refused
(:class:`PlanError`; ConfigError in the strategy's validation, before any rank starts) naming the
smallest cap the planner meets. The plan is built for draw 0; a re-draw relabels it
(:func:`sdp.subnet.assign.relabel`), which keeps its group count, balance and connection.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Callable, Iterator

import numpy as np

from sdp.subnet.assign import PlanError, components, connectable

Sets = tuple[tuple[int, ...], ...]


def groups_needed(*, holders: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], unions: list[list[int]], n: int) -> set[tuple[int, ...]]:
    """The rank sets that become process groups: distinct unit holder sets and unions of size 2 .. n - 1."""
    sets = {tuple(sorted(h)) for h in holders}
    sets |= {tuple(sorted({r for u in us for r in holders[u]})) for us in unions if us}
    return {s for s in sets if 1 < len(s) < n}


def needs(*, n: int, k: int, units: int) -> tuple[bool, bool]:
    """(connected, covered): what a capped plan keeps, each where some plan can have it at all."""
    return k > 1 and connectable(n=n, k=k, units=units), units * k >= n


def fewest_sets(*, n: int, k: int, connected: bool, covered: bool) -> int:
    """The fewest distinct k-sets (each a group, 1 < k < n) that connect and cover n workers: after the
    first, each set of a connected family adds at most k - 1 new workers, of a covering one k."""
    if k in (1, n):
        return 0
    return math.ceil((n - 1) / (k - 1)) if connected else math.ceil(n / k) if covered else 1


def meets(*, holders: Sets | list[tuple[int, ...]], n: int, cap: float, unions: list[list[int]], connected: bool,
          covered: bool) -> bool:
    """Whether ``holders`` need at most ``cap`` groups and, as asked, cover and connect the n workers."""
    if len(groups_needed(holders=holders, unions=unions, n=n)) > cap:
        return False
    if covered and len({r for h in holders for r in h}) < n:
        return False
    return not connected or len(components(holders=holders, n=n)) == 1


def _spacings(total: int, parts: int, hi: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` spacings in 1 .. hi, in lexicographic order."""
    if parts == 0:
        if total == 0:
            yield ()
        return
    for first in range(1, min(hi, total - parts + 1) + 1):
        for rest in _spacings(total - first, parts - 1, hi):
            yield (first, *rest)


def families(*, n: int, k: int, cap: int, connected: bool, covered: bool, used: Sets,
             per_size: int = 12) -> list[Sets]:
    """Candidate families of at most ``cap`` distinct k-sets that connect and cover the workers as asked
    (with every set in use): for each size m from :func:`fewest_sets` to min(cap, n), windows of k
    consecutive workers evenly spaced on the ring and on the line (starts 0 .. n - k), and line windows
    with the first ``per_size`` spacings (all of them for 8 workers); beyond n sets, the n ring windows
    and the sets the balanced plan ``used`` most. k = 1 or n: the one family (no set is a group)."""
    if k in (1, n):
        return [tuple(tuple(sorted((r + j) % n for j in range(k))) for r in range(n if k == 1 else 1))]
    window = lambda s: tuple(sorted((s + j) % n for j in range(k)))  # noqa: E731
    out: list[Sets] = []
    for m in range(fewest_sets(n=n, k=k, connected=connected, covered=covered), min(cap, n) + 1):
        out.append(tuple(window(n * i // m) for i in range(m)))
        if m > 1:
            out.append(tuple(window(round(i * (n - k) / (m - 1))) for i in range(m)))
        for gaps in itertools.islice(_spacings(n - k, m - 1, k - 1 if connected else k), per_size):
            out.append(tuple(window(s) for s in itertools.accumulate((0, *gaps))))
    if cap > n:
        ring = [window(s) for s in range(n)]
        out.append(tuple(ring + [h for h, _ in Counter(used).most_common() if h not in ring][: cap - n]))
    seen, keep = set(), []
    for fam in out:
        if len(set(fam)) == len(fam) and frozenset(fam) not in seen and meets(
                holders=fam, n=n, cap=cap, unions=[], connected=connected, covered=covered):
            seen.add(frozenset(fam))
            keep.append(fam)
    return keep


def _objective(load: np.ndarray) -> tuple[float, float, float]:
    """``balanced``'s: the largest load of any resource, the sum of the per-resource peaks, the sum of
    the loads to the 8th power (which lowers tied maxima one at a time)."""
    peaks = load.max(axis=0)
    return round(float(peaks.max()), 12), round(float(peaks.sum()), 12), round(float((load**8).sum()), 15)


def _load(*, cost: np.ndarray, holders: list[tuple[int, ...]], n: int) -> np.ndarray:
    """Per worker (rows), the summed cost vectors of the units it holds."""
    load = np.zeros((n, cost.shape[1]))
    for c, h in zip(cost, holders):
        load[list(h)] += c
    return load


def _layouts(*, sets: Sets, size: int, n: int, limit: int = 5000) -> list[Sets]:
    """Where an atom of ``size`` units may go: onto one set, or spread over the fewest sets (at most
    ``size``) that hold every worker together, so that its block's remainder is held by all n workers
    (the default group: no group of its own; first ``limit`` such combinations tried)."""
    out: list[Sets] = [(h,) for h in sets]
    for m in range(max(2, math.ceil(n / len(sets[0]))) if sets else size + 1, size + 1):
        covers = [c for c in itertools.islice(itertools.combinations(sets, m), limit)
                  if len({r for h in c for r in h}) == n]
        if covers:
            return out + covers
    return out


def _spread(atom: list[int], layout: Sets) -> list[tuple[int, tuple[int, ...]]]:
    """(unit, set) for every unit of ``atom`` laid out over ``layout``, round robin."""
    return [(u, layout[i % len(layout)]) for i, u in enumerate(atom)]


def _seed(*, cost: np.ndarray, fam: Sets, atoms: list[list[int]], n: int, fill: bool) -> list[tuple[int, ...]]:
    """Holders per unit: atoms largest first, each onto the layout that leaves the lowest objective;
    with ``fill``, onto a single set still unused once no more atoms are left than unused sets."""
    load = np.zeros((n, cost.shape[1]))
    holders: list[tuple[int, ...]] = [()] * len(cost)
    unused, layouts = set(fam), {size: _layouts(sets=fam, size=size, n=n) for size in {len(a) for a in atoms}}
    order = sorted(range(len(atoms)), key=lambda a: (-float(cost[atoms[a]].sum(axis=0).max()), a))
    for i, a in enumerate(order):
        options = layouts[len(atoms[a])]
        if fill and len(order) - i <= len(unused):
            options = [(h,) for h in fam if h in unused]
        best = None
        for layout in options:
            trial = load.copy()
            for u, h in _spread(atoms[a], layout):
                trial[list(h)] += cost[u]
            obj = _objective(trial)
            if best is None or obj < best[0]:
                best = (obj, layout, trial)
        _, layout, load = best
        for u, h in _spread(atoms[a], layout):
            holders[u] = h
            unused.discard(h)
    return holders


def _merge_down(*, cost: np.ndarray, holders: Sets, n: int, cap: int, unions: list[list[int]], connected: bool,
                covered: bool) -> list[list[tuple[int, ...]]]:
    """The balanced plan with its sets merged one at a time (every unit of one set onto another set in
    use: the merge that needs the fewest groups, then leaves the lowest objective), keeping the
    connection and the coverage: every plan on the way that fits ``cap``."""
    plan, out = list(holders), []
    rule = dict(n=n, unions=unions, connected=connected, covered=covered)
    while True:
        if meets(holders=plan, cap=cap, **rule):
            out.append(plan)
        best = None
        for a, b in itertools.permutations(sorted(set(plan)), 2):
            trial = [b if h == a else h for h in plan]
            if meets(holders=trial, cap=math.inf, **rule):
                key = (len(groups_needed(holders=trial, unions=unions, n=n)), _objective(_load(cost=cost, holders=trial, n=n)))
                if best is None or key < best[0]:
                    best = (key, trial)
        if best is None:
            return out
        plan = best[1]


def _improve(*, cost: np.ndarray, holders: list[tuple[int, ...]], atoms: list[list[int]], n: int,
             ok: Callable[[list[tuple[int, ...]]], bool]) -> tuple[tuple[float, float, float], list[tuple[int, ...]]]:
    """First-improvement local search over: a unit onto another set in use; a whole atom (a
    neuron-level block's units) onto a layout of the sets in use (:func:`_layouts`); two units exchanging
    sets; a set in use trading one worker for another, for all its units (which walks the family
    itself). A change is kept when it lowers the objective and ``ok`` accepts the plan (the cap, the
    coverage, the connection)."""
    load = _load(cost=cost, holders=holders, n=n)

    def apply(change: list[tuple[int, tuple[int, ...]]]) -> list[tuple[int, tuple[int, ...]]]:
        undo = [(u, holders[u]) for u, _ in change]
        for u, h in change:
            load[list(holders[u])] -= cost[u]
            load[list(h)] += cost[u]
            holders[u] = h
        return undo

    def changes() -> Iterator[list[tuple[int, tuple[int, ...]]]]:
        sets = tuple(sorted(set(holders)))
        for u in range(len(cost)):
            yield from ([(u, h)] for h in sets if h != holders[u])
        layouts = {size: _layouts(sets=sets, size=size, n=n) for size in {len(a) for a in atoms if len(a) > 1}}
        for atom in (a for a in atoms if len(a) > 1):
            for layout in layouts[len(atom)]:
                change = _spread(atom, layout)
                if any(holders[u] != h for u, h in change):
                    yield change
        for u, v in itertools.combinations(range(len(cost)), 2):
            if holders[u] != holders[v] and not np.array_equal(cost[u], cost[v]):
                yield [(u, holders[v]), (v, holders[u])]
        for h in sets:
            on = [u for u in range(len(cost)) if holders[u] == h]
            for a, b in itertools.product(h, sorted(set(range(n)) - set(h))):
                yield [(u, tuple(sorted((set(h) - {a}) | {b}))) for u in on]

    best = _objective(load)
    for _ in range(500):
        for change in changes():
            undo = apply(change)
            if (obj := _objective(load)) < best and ok(holders):
                best = obj
                break
            apply(undo)
        else:
            break
    return best, holders


def _within(*, costs: list[tuple[float, ...]], n: int, k: int, cap: int, used: Sets, unions: list[list[int]],
            connected: bool, covered: bool, improve: int = 3) -> Sets | None:
    """The best plan found within ``cap`` that connects and covers as asked, or None."""
    cost = np.asarray(costs, dtype=np.float64).reshape(len(costs), -1)
    whole = sorted({u for us in unions for u in us})
    atom_sets = [[[u] for u in range(len(costs))]]
    if unions:  # a block's units together: its remainder's holders are then one of the family's sets
        atom_sets.insert(0, [list(us) for us in unions if us] + [[u] for u in range(len(costs)) if u not in whole])

    def ok(holders: list[tuple[int, ...]]) -> bool:
        return meets(holders=holders, n=n, cap=cap, unions=unions, connected=connected, covered=covered)

    seeds = []
    for fam in families(n=n, k=k, cap=cap, connected=connected, covered=covered, used=used):
        for atoms in atom_sets:
            for fill in (False, True):
                holders = _seed(cost=cost, fam=fam, atoms=atoms, n=n, fill=fill)
                if ok(holders):
                    seeds.append((_objective(_load(cost=cost, holders=holders, n=n)), len(seeds), holders))
                    break
    for merged in _merge_down(cost=cost, holders=used, n=n, cap=cap, unions=unions, connected=connected,
                              covered=covered):
        seeds.append((_objective(_load(cost=cost, holders=merged, n=n)), len(seeds), merged))
    if not seeds:
        return None
    found = []
    for _, i, holders in sorted(seeds, key=lambda s: s[:2])[:improve]:
        obj, holders = _improve(cost=cost, holders=holders, atoms=atom_sets[0], n=n, ok=ok)
        found.append((obj, i, holders))
    return tuple(min(found, key=lambda f: f[:2])[2])


def cap_holder_sets(*, costs: list[tuple[float, ...]], holders: Sets, n: int, k: int, cap: int,
                    unions: list[list[int]]) -> Sets:
    """``holders`` unchanged if they need at most ``cap`` process groups, else a plan within the cap that
    keeps every worker busy and the workers connected (where any plan can); PlanError when none fits."""
    connected, covered = needs(n=n, k=k, units=len(costs))
    rule = dict(n=n, unions=unions, connected=connected, covered=covered)
    if meets(holders=holders, cap=cap, **rule):
        return holders
    found = _within(costs=costs, k=k, cap=cap, used=holders, **rule)
    if found is not None:
        return found
    top = len(groups_needed(holders=holders, unions=unions, n=n))
    assert meets(holders=holders, cap=top, **rule), f"balanced left {n} workers idle or disconnected: {holders}"
    low = max(cap + 1, fewest_sets(n=n, k=k, connected=connected, covered=covered))
    smallest = next(c for c in range(low, top + 1) if c == top or _within(costs=costs, k=k, cap=c, used=holders, **rule))
    what = " and connects every worker" if connected else ""
    raise PlanError(
        f"parallelism.max_holder_sets={cap} is too small: {n} workers with k={k} holders per unit "
        f"({len(costs)} units{', neuron-level block remainders' if unions else ''}) need at least {smallest} "
        f"holder sets (process groups) for a plan that gives every worker a unit{what}; allowed: an integer "
        f">= {smallest}, or null (no cap)")
