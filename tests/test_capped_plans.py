"""The holder-set cap (``parallelism.max_holder_sets``, :mod:`sdp.subnet.capped`), unit level (no ranks):
a capped plan keeps k holders per unit, every worker busy and the workers connected wherever a plan
within the cap can; a cap no such plan fits is refused before any rank starts, naming the smallest cap
that works; the balance within the cap is the exhaustive optimum on small cases."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from sdp.models.resnet import ResNetCIFAR
from sdp.subnet.assign import assign, components, connectable
from sdp.subnet.capped import cap_holder_sets, fewest_sets, groups_needed, meets, needs
from sdp.subnet.plan import Plan, PlanError, build_plan, measure_block_costs


@functools.lru_cache(maxsize=None)
def _resnet18() -> tuple[ResNetCIFAR, dict[int, tuple[float, float]]]:
    with torch.device("meta"):
        model = ResNetCIFAR(num_classes=10, width=16)
    return model, measure_block_costs(model)


def _plan(*, n: int, c: float, level: str = "block", cap: int | None = None, draw: int = 0) -> Plan:
    model, costs = _resnet18()
    return build_plan(model=model, world_size=n, coverage=c, level=level, block_costs=costs, max_holder_sets=cap,
                      draw=draw)


def _unions(plan: Plan) -> list[list[int]]:
    return [[i for i, u in enumerate(plan.units) if u.block == b] for b in plan.remainder if plan.remainder[b]]


def _groups(plan: Plan) -> int:
    return len(groups_needed(holders=plan.holders, unions=_unions(plan), n=plan.world_size))


def _unit_costs(plan: Plan) -> list[tuple[float, ...]]:
    """What build_plan balances (balance weights 1, 1, 1): each resource normalised by its total."""
    keys = ("params", "flops", "act_bytes")
    tot = [sum(getattr(u, a) for u in plan.units) for a in keys]
    return [tuple(getattr(u, a) / t for a, t in zip(keys, tot)) for u in plan.units]


def _peak(costs: list[tuple[float, ...]], holders: tuple[tuple[int, ...], ...], n: int) -> float:
    load = np.zeros((n, len(costs[0])))
    for c, h in zip(costs, holders):
        load[list(h)] += c
    return float(load.max())


@pytest.mark.parametrize(("n", "c", "cap"), [(4, 0.5, 3), (8, 0.25, 7), (8, 0.375, 4)])
def test_issue_cases_stay_connected_and_use_every_worker(n: int, c: float, cap: int) -> None:
    """ResNet-18 (block level) under the caps where the old planner made islands ({0,1} {2,3}; four
    pairs) or left workers 3 and 7 without a unit."""
    plan = _plan(n=n, c=c, cap=cap)
    assert _groups(plan) <= cap, plan.holders
    assert plan.components() == [tuple(range(n))], plan.holders
    assert all(w["units"] > 0 for w in plan.worker_costs()), plan.holders
    assert plan.degenerate() == [], plan.degenerate()
    if (n, cap) == (4, 3):
        assert set(plan.holders) == {(0, 1), (1, 2), (2, 3)}  # the chain: the only connected 3-set family but the star


@pytest.mark.parametrize("level", ["block", "neuron"])
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("c", [0.25, 0.375, 0.5, 0.75])
def test_capped_plans_or_refusals_over_n_and_coverage(level: str, n: int, c: float) -> None:
    """Caps from 1 to past what the uncapped plan needs (around the set-count bound and the top): a plan
    that keeps k holders per unit, needs at most the cap (unit sets and neuron-level remainders),
    connects and covers the workers wherever they can be; or a PlanError naming the cap and the
    smallest cap that works, which then does work and lies between the set-count bound and the top.
    The cap is applied to the uncapped plan as build_plan does (its units, costs and remainders)."""
    free = _plan(n=n, c=c, level=level)
    top, k, costs, unions = _groups(free), free.k, _unit_costs(free), _unions(free)
    connected, covered = needs(n=n, k=k, units=len(free.units))
    low = fewest_sets(n=n, k=k, connected=connected, covered=covered)

    def capped(cap: int) -> tuple[tuple[int, ...], ...]:
        return cap_holder_sets(costs=costs, holders=free.holders, n=n, k=k, cap=cap, unions=unions)

    for cap in sorted({1, low - 1, low, low + 1, (low + top) // 2, top - 1, top, top + 1} - {0, -1}):
        try:
            holders = capped(cap)
        except PlanError as exc:
            smallest = int(str(exc).split("need at least ")[1].split()[0])
            assert f"parallelism.max_holder_sets={cap} is too small" in str(exc) and smallest > cap, str(exc)
            assert low <= smallest <= top, (low, smallest, top)
            assert len(groups_needed(holders=capped(smallest), unions=unions, n=n)) <= smallest
            continue
        assert all(len(set(h)) == k for h in holders)
        assert len(groups_needed(holders=holders, unions=unions, n=n)) <= cap, (cap, holders)
        assert not connected or len(components(holders=holders, n=n)) == 1, (cap, holders)
        assert not covered or {r for h in holders for r in h} == set(range(n)), (cap, holders)
        if cap >= top:
            assert holders == free.holders  # the cap does not bind: the balanced plan itself


def test_caps_at_and_above_the_bound_always_work_without_remainders() -> None:
    """Block level (no remainder groups), the set-count bound is exact: ceil((n-1)/(k-1)) sets connect,
    one fewer cannot, and the refusal names the bound."""
    for n, c in itertools.product([4, 8], [0.375, 0.5, 0.75]):
        free = _plan(n=n, c=c)
        low = fewest_sets(n=n, k=free.k, connected=True, covered=True)
        assert low == -(-(n - 1) // (free.k - 1))
        if low < _groups(free):
            assert _groups(_plan(n=n, c=c, cap=low)) <= low
        with pytest.raises(PlanError, match=rf"max_holder_sets={low - 1} is too small.* need at least {low} holder sets"):
            _plan(n=n, c=c, cap=low - 1)


def _optimum(costs: list[tuple[float, ...]], n: int, k: int, cap: int) -> float:
    """The exhaustive minimax optimum over every plan with at most ``cap`` distinct k-sets that connects
    and covers the workers (every family of sets, every assignment onto it)."""
    cost = np.asarray(costs)
    best = np.inf
    for m in range(1, cap + 1):
        for fam in itertools.combinations(itertools.combinations(range(n), k), m):
            if not meets(holders=fam, n=n, cap=cap, unions=[], connected=True, covered=True):
                continue
            member = np.zeros((m, n))
            for i, h in enumerate(fam):
                member[i, list(h)] = 1
            where = np.array(list(itertools.product(range(m), repeat=len(costs))))
            loads = np.einsum("auw,ud->awd", member[where], cost)
            best = min(best, float(loads.max(axis=(1, 2)).min()))
    return best


@pytest.mark.parametrize(("k", "seed"), [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1)])
def test_capped_balance_is_the_exhaustive_optimum_on_four_workers(k: int, seed: int) -> None:
    g = np.random.default_rng(seed)
    costs = [tuple(float(x) for x in g.random(3) ** 2) for _ in range(6)]
    free = assign(costs=costs, world_size=4, k=k, method="balanced")
    assert connectable(n=4, k=k, units=6)
    for cap in range(fewest_sets(n=4, k=k, connected=True, covered=True), len(set(free))):
        capped = cap_holder_sets(costs=costs, holders=free, n=4, k=k, cap=cap, unions=[])
        assert _peak(costs, capped, 4) == pytest.approx(_optimum(costs, 4, k, cap), abs=1e-9), (k, cap, capped)


@pytest.mark.parametrize(("n", "units", "cap", "peak"), [(4, 8, 3, 5), (8, 16, 7, 5)])
def test_equal_units_on_pairs_reach_the_path_optimum(n: int, units: int, cap: int, peak: int) -> None:
    """k = 2 and n - 1 sets: the sets are the edges of a spanning tree. Perfect balance (4 units per
    worker) would need every leaf's one edge to carry 4 units and then its neighbour holds more, so the
    optimum is 5: the path with light middle links (4 workers: edges 4, 1, 3; 8 workers: 4,1,3,1,3,1,3)."""
    costs = [(1.0, 1.0, 1.0)] * units
    free = assign(costs=costs, world_size=n, k=2, method="balanced")
    capped = cap_holder_sets(costs=costs, holders=free, n=n, k=2, cap=cap, unions=[])
    assert len(set(capped)) <= cap and len(components(holders=capped, n=n)) == 1
    assert _peak(costs, capped, n) == peak


def test_redraws_of_a_capped_plan_relabel_it() -> None:
    """A re-draw is the capped draw-0 plan with the workers relabelled: same group count, same loads,
    still connected, and not the same holders."""
    first = _plan(n=8, c=0.375, cap=4)
    for draw in (1, 2):
        again = _plan(n=8, c=0.375, cap=4, draw=draw)
        assert again.holders != first.holders and _groups(again) == _groups(first) <= 4
        assert len(again.components()) == 1
        assert sorted(first.worker_costs(), key=str) == sorted(again.worker_costs(), key=str)


def test_validation_refuses_a_cap_without_a_connected_plan_naming_the_smallest() -> None:
    from sdp.driver.config import validate
    from sdp.errors import ConfigError
    from tests.helpers import compose

    base = ["parallelism=sdp", "model=resnet18_cifar", "model.width=8", "cluster.world_size=8"]  # k = 4
    with pytest.raises(ConfigError, match=r"parallelism.max_holder_sets=2 is too small.*need at least 3 holder sets"
                                          r".*connects every worker.*model=resnet18_cifar"):
        validate(compose([*base, "parallelism.max_holder_sets=2"]))
    validate(compose([*base, "parallelism.max_holder_sets=3"]))
