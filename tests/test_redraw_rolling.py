"""``parallelism.redraw=rolling`` (FedRolex, :mod:`sdp.subnet.rolling`): uniform k with equal unit counts each
draw, connected, deterministic; every worker holds every unit within max(n, g) draws; with a difference cover every
pair of units is trained together at some draw; its base set is the exhaustive optimum (checked by brute force on
small cases); the study models' rolling plans; and one multi-rank run whose re-draws land every rank on the same
plan with bit-identical shared pieces. The other rules, and every rule's refusals, are tests/test_redraw_modes.py's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sdp.subnet.assign import components
from sdp.subnet.plan import check
from sdp.subnet.rolling import base_set, differences, max_gap, rolling
from tests.redraw_plans import coheld, plan_of


CASES = [(8, 4, 2), (8, 4, 3), (8, 2, 1), (4, 4, 2), (6, 3, 2), (12, 4, 2), (16, 4, 2), (16, 8, 4), (24, 4, 2),
         (32, 8, 4), (16, 16, 8), (8, 4, 1), (16, 4, 1)]  # (units, workers, holders)


def _roll(U: int, n: int, k: int, draw: int):  # noqa: ANN202
    return rolling(blocks=list(range(U)), groups=[None] * U, n=n, k=k, draw=draw)


def test_rolling_example_from_the_issue() -> None:
    """U = 8 blocks, n = 4, k = 2: g = 2, S = {0, 1, 2, 5}, a difference cover: all 28 pairs of blocks."""
    holders, info = _roll(8, 4, 2, 0)
    assert info["families"][0]["base"] == [0, 1, 2, 5] and info["families"][0]["difference_cover"], info
    assert info["pair_coverage_over_draws"] == 1.0
    assert [sorted(u for u in range(8) if w in holders[u]) for w in range(4)] == [[0, 1, 2, 5], [2, 3, 4, 7],
                                                                                  [1, 4, 5, 6], [0, 3, 6, 7]]


@pytest.mark.parametrize(("U", "n", "k"), CASES, ids=[f"U{u}-n{n}-k{k}" for u, n, k in CASES])
def test_rolling_is_uniform_balanced_connected_and_covers(U: int, n: int, k: int) -> None:
    g = U // n
    _, info = _roll(U, n, k, 0)
    reach = info["draws_to_hold_every_unit"]
    if k >= 2:
        assert reach <= max(n, g), f"S={info['families'][0]['base']}: every unit only after {reach} draws"
    seen: list[set[int]] = [set() for _ in range(n)]
    pairs: set[tuple[int, int]] = set()
    for draw in range(2 * U):
        holders, _ = _roll(U, n, k, draw)
        base_set.cache_clear()
        assert _roll(U, n, k, draw)[0] == holders, "not deterministic"
        assert all(len(h) == k == len(set(h)) for h in holders), (draw, holders)
        counts = [sum(w in h for h in holders) for w in range(n)]
        assert counts == [k * g] * n, f"draw {draw}: units per worker {counts}"
        if k >= 2:
            assert components(holders=holders, n=n) == [tuple(range(n))], (draw, holders)
        if draw < reach:
            for w in range(n):
                seen[w] |= {u for u, h in enumerate(holders) if w in h}
            if draw == reach - 2:
                assert all(len(s) < U for s in seen), "held every unit before the draws reported"
        if draw < g:
            pairs |= coheld(holders)
    assert all(s == set(range(U)) for s in seen), f"after {reach} draws: {[sorted(s) for s in seen]}"
    assert len(pairs) / (U * (U - 1) // 2) == pytest.approx(info["pair_coverage_over_draws"])
    if info["families"][0]["difference_cover"]:
        assert info["pair_coverage_over_draws"] == 1.0
    for d in range(g, 3 * g):  # later draws train no pair the first g did not
        assert coheld(_roll(U, n, k, d)[0]) <= pairs


def _brute(U: int, n: int, k: int) -> tuple[int, ...]:
    g, limit, best = U // n, max(n, U // n), None
    for rest in itertools.combinations(range(1, U), k * g - 1):
        s = (0, *rest)
        if any(sum(a % g == x for a in s) != k for x in range(g)):
            continue
        score = (max_gap(s, U) <= limit, len(differences(s, U)), -max_gap(s, U))
        if best is None or score > best[0]:
            best = (score, s)
        if score[:2] == (True, U - 1):
            break
    assert best is not None
    return best[1]


def test_rolling_base_set_is_the_first_optimum() -> None:
    for U in range(1, 13):
        for n in (n for n in range(1, U + 1) if U % n == 0):
            for k in range(1, n + 1):
                assert base_set(U=U, n=n, k=k)[0] == _brute(U, n, k), (U, n, k)


def test_rolling_plans_of_the_study_models() -> None:
    """8 blocks on 4 workers at C = 0.5 (LLaMA, ResNet-18) and LLaMA at neuron level (4 groups a block)."""
    for name, level in (("llama8", "block"), ("resnet", "block"), ("llama8", "neuron")):
        seen: list[set[int]] = [set() for _ in range(4)]
        for draw in range(4):
            plan = plan_of(name, world_size=4, coverage=0.5, level=level, draw=draw, redraw="rolling")
            check(plan)
            assert plan.components() == [(0, 1, 2, 3)] and not plan.degenerate(), plan.degenerate()
            for w in range(4):
                seen[w] |= set(plan.held_units(w))
        assert all(len(s) == len(plan.units) for s in seen), (name, level, seen)
        expect = 1.0 if level == "block" else pytest.approx(23 / 31)  # 4 groups: S = {0, 1}, no difference cover
        assert plan.summary()["redraw_info"]["pair_coverage_over_draws"] == expect, plan.redraw_info


# ---- on ranks ----------------------------------------------------------------------------------------
def _train_rolling(rank: int, world: int, config: dict) -> tuple[dict, int, float]:
    from sdp.core.loss import loss_fn
    from tests.helpers import batch, make_strategy
    from tests.test_sdp_redraw import _NoTimer

    strategy, data, cfg = make_strategy(config, rank, world)
    loss = float("nan")
    for step in range(12):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        out = strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
        loss = float(out.loss_sum) / max(out.count, 1)
    return strategy.checkpoint_state()["local"], strategy.redraws, loss


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_rolling_redraws_on_four_ranks() -> None:
    """12 steps, a rolling re-draw every 5 (before steps 5 and 10) on 4 ranks, 8 blocks: every rank is at
    draw 2's rolling plan, every piece held by several ranks is bit-identical across them (parameters and
    optimizer state), and the loss is finite."""
    from omegaconf import OmegaConf

    from sdp.parallel.sdp_plan import plan_for, plan_lists
    from sdp.registry import build
    from tests.helpers import config_dict, spawn
    from tests.holders import compare, pieces_of

    config = config_dict(["model=mlp", "dataset=digits", "model.hidden=64", "model.depth=8", "train.batch_size=8",
                          "parallelism=sdp", "optim=sgd", "parallelism.resample_every=5", "parallelism.redraw=rolling",
                          "cluster.world_size=4"])
    got = spawn(_train_rolling, world=4, args=(config,))
    cfg = OmegaConf.create(config)
    with torch.device("meta"):
        model = build(cfg.model)
    want = plan_lists(plan_for(model=model, cfg=cfg.parallelism, world_size=4, draw=2))
    assert [g[1] for g in got] == [2] * 4, [g[1] for g in got]
    assert all(g[0]["extra"]["plan"] == want for g in got), (want, [g[0]["extra"]["plan"] for g in got])
    assert all(torch.isfinite(torch.tensor(g[2])) for g in got), [g[2] for g in got]
    res = compare([pieces_of(g[0], cfg=cfg, rank=r) for r, g in enumerate(got)])
    assert res["trained_by_several"] > 0 and not (res["params"] or res["state"] or res["missing_state"]), res
