"""How a re-draw chooses the new plan (``parallelism.redraw``): pure functions of the units and the draw.

Why more than one rule: the default re-draw (``relabel``: a seeded permutation of the workers,
:func:`sdp.subnet.assign.relabel`) keeps the balance and the connectivity, but it also keeps every set of
units that is trained together: the same pairs of blocks always share a worker, only another one. SDP's
relatives change those sets, and the assembled model's quality may depend on it:

- ``shuffle``, after ResIST (Dun et al. 2022, "ResIST: Layer-wise decomposition of ResNets for distributed
  training"), which re-draws its random partition of residual blocks every round: here a seeded
  permutation of *interchangeable* units (identical cost vectors: whole blocks of one signature, then
  the groups within a block) before the relabelling. Every worker's load, the holder sets and the
  worker-overlap graph stay exactly those of the base plan; the pairs of units trained together change.
- ``rolling``, after FedRolex (Alam et al. 2022, "FedRolex: Model-Heterogeneous Federated Learning with
  Rolling Sub-Model Extraction"), which rolls a window over the units every round: deterministic, no
  seed. Within a family of U units (all units at block level, each block's groups at neuron level) on n
  workers with k holders, g = U / n: a base set S of k g unit indices with exactly k in each residue
  class mod g; worker w holds ``S + w g + d (mod U)`` at draw d. Each draw every unit has k holders and
  every worker k g units; over ``max_gap(S)`` consecutive draws every worker holds every unit; a pair of
  units is trained together at some draw iff its difference lies in S - S, so S is chosen to cover
  every non-zero difference (a difference cover) where one exists.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Sequence

import torch

from sdp.subnet.assign import PlanError, relabel

REDRAWS = ("relabel", "shuffle", "rolling")
Holders = tuple[tuple[int, ...], ...]


def check_redraw(redraw: str) -> None:
    if redraw not in REDRAWS:
        raise PlanError(f"parallelism.redraw={redraw!r} is invalid: allowed: {', '.join(REDRAWS)}")


# ---- shuffle ------------------------------------------------------------------------------------------
def shuffle(*, holders: Holders, blocks: Sequence[int], costs: Sequence[tuple[float, ...]],
            remainder: dict[int, int], n: int, seed: int, draw: int) -> tuple[Holders, dict[str, Any]]:
    """Draw ``draw`` from the base plan ``holders``: blocks of one signature (their units' cost vectors
    and their remainder, in order) permuted among themselves, then each block's units of one cost vector
    among themselves, then the workers relabelled (:func:`relabel`). A permuted block carries its units'
    holder sets along as a whole, so the holders of each block's remainder are those of some block of
    the base plan too: every worker keeps its load exactly. Draw 0 is the base plan."""
    by_block: dict[int, list[int]] = {}
    for u, b in enumerate(blocks):
        by_block.setdefault(b, []).append(u)
    sig = {b: (tuple(costs[u] for u in us), remainder.get(b, 0)) for b, us in by_block.items()}
    classes: dict[Any, list[int]] = {}
    for b in by_block:
        classes.setdefault(sig[b], []).append(b)
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + draw + 500_009)
    new = list(holders)
    if draw > 0:
        for members in classes.values():
            moved = [members[i] for i in torch.randperm(len(members), generator=gen).tolist()]
            for src, dst in zip(members, moved):  # block src's holder sets go to block dst
                units = by_block[src]
                order = _within(units=units, costs=costs, gen=gen)
                for i, j in enumerate(order):
                    new[by_block[dst][j]] = holders[units[i]]
    swappable = [m for m in classes.values() if len(m) > 1]
    movable = {u for m in swappable for b in m for u in by_block[b]}
    movable |= {u for us in by_block.values() for u in us if sum(costs[v] == costs[u] for v in us) > 1}
    info = {"interchangeable_blocks": swappable, "interchangeable_units": len(movable)}
    return relabel(holders=new, n=n, seed=seed, draw=draw), info


def _within(*, units: list[int], costs: Sequence[tuple[float, ...]], gen: torch.Generator) -> list[int]:
    """Target position of each of a block's units: positions of one cost vector permuted among themselves."""
    order = list(range(len(units)))
    same: dict[tuple[float, ...], list[int]] = {}
    for i, u in enumerate(units):
        same.setdefault(tuple(costs[u]), []).append(i)
    for pos in same.values():
        for i, p in zip(pos, torch.randperm(len(pos), generator=gen).tolist()):
            order[i] = pos[p]
    return order


# ---- rolling --------------------------------------------------------------------------------------
def families(*, blocks: Sequence[int], groups: Sequence[int | None]) -> list[list[int]]:
    """Unit indices per family: each block's groups (neuron level), and the whole-block units together."""
    out: dict[int, list[int]] = {}
    for u, (b, g) in enumerate(zip(blocks, groups)):
        out.setdefault(-1 if g is None else b, []).append(u)
    return list(out.values())


def differences(base: Sequence[int], U: int) -> set[int]:
    """The non-zero residues mod U that are differences of two elements of ``base``."""
    return {(a - b) % U for a, b in itertools.permutations(base, 2)} - {0}


def max_gap(base: Sequence[int], U: int) -> int:
    """The largest cyclic gap between consecutive elements: the draws after which every worker has held every unit."""
    s = sorted(base)
    return max(b - a for a, b in zip(s, s[1:] + [s[0] + U]))


@functools.lru_cache(maxsize=None)
def base_set(*, U: int, n: int, k: int, budget: int = 200_000) -> tuple[tuple[int, ...], str]:
    """(S, how it was found): the lexicographically first S (containing 0: translates are equivalent) of
    k g elements, exactly k per residue mod g, that maximises (max_gap(S) <= max(n, g), covered non-zero
    differences, -max_gap(S)), the search stopping at the first S that meets the first two (a difference
    cover held whole by every worker within max(n, g) draws), by a branch and bound within ``budget``
    nodes ("exhaustive"); past the budget the better of the best found and a greedy set, each element
    the one adding most differences ("greedy")."""
    g, m, limit = U // n, k * (U // n), max(n, U // n)
    best: list[Any] = [(-1, -1, -U), ()]
    count = [0] * U  # ordered differences of the current set
    nodes = 0

    def score(s: list[int]) -> tuple[int, int, int]:
        return int(max_gap(s, U) <= limit), len(differences(s, U)), -max_gap(s, U)

    def dfs(s: list[int], per: list[int], covered: int, gap: int) -> bool:
        nonlocal nodes
        if nodes > budget:
            return True
        if len(s) == m:
            if (sc := score(s)) > best[0]:
                best[:] = [sc, tuple(s)]
            return best[0][:2] == (1, U - 1)
        r = m - len(s)
        if (int(gap <= limit), min(U - 1, covered + 2 * r * len(s) + r * (r - 1)), -gap) <= best[0]:
            return False
        # residue x still needs k - per[x] elements, so its next one comes no later than bound[x]
        bound = {x: x + (n - k + per[x]) * g for x in range(g) if per[x] < k}
        first = sorted(bound.items(), key=lambda t: t[1])[:2]  # an e of residue c must precede the others'
        for e in range(s[-1] + 1, U):
            nodes, c = nodes + 1, e % g  # a node: one candidate element looked at
            if c not in bound or e > bound[c] or any(e > b for x, b in first if x != c):
                continue
            added = [(e - a) % U for a in s] + [(a - e) % U for a in s]
            new = sum(1 for d in set(added) if not count[d])
            for d in added:
                count[d] += 1
            per[c] += 1
            stop = dfs(s + [e], per, covered + new, max(gap, e - s[-1]))
            per[c] -= 1
            for d in added:
                count[d] -= 1
            if stop:
                return True
        return False

    per0 = [1 if x == 0 else 0 for x in range(g)]
    out_of_budget = dfs([0], per0, 0, 1) and nodes > budget
    if not out_of_budget:
        return best[1], "exhaustive"
    s, per, seen = [0], per0, set()
    while len(s) < m:
        e = max((e for e in range(U) if e not in s and per[e % g] < k),
                key=lambda e: (len(({(e - a) % U for a in s} | {(a - e) % U for a in s}) - seen), -e))
        seen |= {(e - a) % U for a in s} | {(a - e) % U for a in s}
        s, per[e % g] = sorted(s + [e]), per[e % g] + 1
    return (tuple(s) if score(s) > best[0] else best[1]), "greedy"


def rolling(*, blocks: Sequence[int], groups: Sequence[int | None], n: int, k: int,
            draw: int) -> tuple[Holders, dict[str, Any]]:
    """Draw ``draw``'s holders (worker w holds ``S + w g + draw`` of each family) and what the rolling
    achieves: per family size its S, the pair coverage over the draws (the fraction of unit pairs, across
    all families, that some worker holds together at some draw) and the draws after which every worker
    has held every unit. Raises PlanError when a family's units do not split evenly over the n workers."""
    fams = families(blocks=blocks, groups=groups)
    bases: dict[int, dict[str, Any]] = {}
    for fam in fams:
        U = len(fam)
        if U % n:
            what = "units" if groups[fam[0]] is None else f"groups of blocks.{blocks[fam[0]]}"
            raise PlanError(f"parallelism.redraw='rolling' needs each family's units to split evenly over the workers: "
                            f"{U} {what} on world_size={n} (g = {U}/{n}); allowed: a world size that divides {U} "
                            f"(at neuron level parallelism.groups a multiple of it), or redraw=relabel or shuffle")
        if U not in bases:
            S, how = base_set(U=U, n=n, k=k)
            bases[U] = {"units": U, "g": U // n, "base": list(S), "search": how,
                        "difference_cover": len(differences(S, U)) == U - 1, "draws_to_hold_every_unit": max_gap(S, U)}
    period = math.lcm(*(b["g"] for b in bases.values()))  # then the windows repeat, on other workers
    seen: set[tuple[int, int]] = set()
    for d in range(period):
        hs = windows(fams=fams, bases=bases, n=n, draw=d)
        seen |= {(a, b) for a, b in itertools.combinations(range(len(blocks)), 2) if set(hs[a]) & set(hs[b])}
    pairs = len(blocks) * (len(blocks) - 1) // 2
    info = {"families": list(bases.values()), "stride": 1,
            "pair_coverage_over_draws": len(seen) / pairs if pairs else 1.0,
            "draws_to_hold_every_unit": max(b["draws_to_hold_every_unit"] for b in bases.values())}
    return windows(fams=fams, bases=bases, n=n, draw=draw), info


def windows(*, fams: list[list[int]], bases: dict[int, dict[str, Any]], n: int, draw: int) -> Holders:
    """Holders of every unit at ``draw``: unit i of a family of U is held by each w with i - w g - draw in S."""
    out: dict[int, tuple[int, ...]] = {}
    for fam in fams:
        U, S = len(fam), set(bases[len(fam)]["base"])
        for i, u in enumerate(fam):
            out[u] = tuple(w for w in range(n) if (i - w * (U // n) - draw) % U in S)
    return tuple(out[u] for u in range(len(out)))
