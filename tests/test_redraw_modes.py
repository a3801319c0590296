"""How a re-draw chooses the new plan (``parallelism.redraw``, :mod:`sdp.subnet.rolling`), pure and fast
apart from one multi-rank smoke run.

- ``relabel`` (default) gives, draw by draw, the holders the planner gave before the key existed (golden
  values recorded from that code, seed 3);
- ``shuffle`` keeps every worker's cost vector (params with remainders, FLOPs, activation bytes) and the
  holder sets (so the overlap graph), up to a relabelling of the workers, and changes which units are
  trained together, which a relabelling never does;
- ``rolling`` (FedRolex) is uniform k with equal unit counts each draw, connected, deterministic; every
  worker holds every unit within max(n, g) draws; with a difference cover every pair of units is trained
  together at some draw; its base set is the exhaustive optimum (checked by brute force on small cases).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from sdp.models.llama import LLaMA
from sdp.models.resnet import ResNetCIFAR
from sdp.subnet import plan as plan_module
from sdp.subnet.assign import assign, components
from sdp.subnet.plan import Plan, PlanError, build_plan, check, measure_block_costs
from sdp.subnet.rolling import base_set, differences, max_gap, rolling


@functools.lru_cache(maxsize=None)
def _model(name: str) -> tuple[torch.nn.Module, dict[int, tuple[float, float]]]:
    with torch.device("meta"):
        model = (ResNetCIFAR(num_classes=10, width=16) if name == "resnet" else
                 LLaMA(vocab_size=256, max_seq_len=32, dim=64, n_layers=8, n_heads=4, n_kv_heads=2, hidden=176))
    return model, measure_block_costs(model)


@functools.lru_cache(maxsize=None)
def _assign(costs: tuple, world_size: int, k: int, method: str, seed: int, draw: int) -> tuple:
    return assign(costs=list(costs), world_size=world_size, k=k, method=method, seed=seed, draw=draw)


@pytest.fixture(autouse=True)
def _memo_assign(monkeypatch: pytest.MonkeyPatch) -> None:
    """The balanced search takes a second for 8 equal blocks; it is pure, so each (costs, n, k, draw) runs once."""
    monkeypatch.setattr(plan_module, "assign", lambda *, costs, world_size, k, method, seed=0, draw=0:
                        _assign(tuple(costs), world_size, k, method, seed, draw))


def _plan(name: str, **kw) -> Plan:  # noqa: ANN003
    model, costs = _model(name)
    return build_plan(model=model, block_costs=costs, groups=4, seed=3, **kw)


def _coheld(holders: tuple[tuple[int, ...], ...]) -> set[tuple[int, int]]:
    return {(a, b) for a, b in itertools.combinations(range(len(holders)), 2) if set(holders[a]) & set(holders[b])}


# ---- relabel: unchanged ---------------------------------------------------------------------------
# (model, n, C, level, assignment, max_holder_sets) -> holders of draws 0..3 (one string a unit), recorded
# from the planner before parallelism.redraw existed
GOLDEN = {
    ("llama8", 4, 0.5, "block", "balanced", None): ["01 12 23 03 01 12 23 03", "03 01 12 23 03 01 12 23",
                                                    "23 13 01 02 23 13 01 02", "23 12 01 03 23 12 01 03"],
    ("llama8", 4, 0.5, "block", "random", None): ["02 01 02 02 23 23 12 03", "03 01 23 23 12 13 01 23",
                                                  "23 23 03 03 12 13 23 23", "23 13 23 12 03 13 12 12"],
    ("resnet", 4, 0.5, "block", "balanced", 3): ["23 01 23 01 12 23 23 01", "12 03 12 03 01 12 12 03",
                                                 "01 23 01 23 13 01 01 23", "01 23 01 23 12 01 01 23"],
    ("resnet", 8, 0.5, "block", "balanced", None): ["0567 1234 0123 4567 0123 4567 4567 0123",
                                                    "1235 0467 0347 1256 0347 1256 1256 0347",
                                                    "0126 3457 2357 0146 2357 0146 0146 2357",
                                                    "0367 1245 2345 0167 2345 0167 0167 2345"],
    ("resnet", 4, 0.5, "neuron", "balanced", None): [" ".join([s] * 8) for s in
                                                     ("01 12 23 03", "03 01 12 23", "23 13 01 02", "23 12 01 03")],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=["-".join(map(str, k)) for k in GOLDEN])
def test_relabel_is_the_default_and_gives_the_old_plans(key: tuple) -> None:
    name, n, c, level, assignment, cap = key
    for draw, want in enumerate(GOLDEN[key]):
        kw = dict(world_size=n, coverage=c, level=level, assignment=assignment, max_holder_sets=cap, draw=draw)
        default, explicit = _plan(name, **kw), _plan(name, redraw="relabel", **kw)
        got = " ".join("".join(map(str, h)) for h in default.holders)
        assert got == want, f"{key} draw {draw}: {got} != {want}"
        assert explicit.holders == default.holders and default.redraw == "relabel", (key, draw)


# ---- shuffle ---------------------------------------------------------------------------------------
def _worker_vectors(plan: Plan) -> list[tuple]:
    return [(c["params"], round(c["flops"], 3), round(c["act_bytes"], 3), c["units"]) for c in plan.worker_costs()]


def _relabelling(base: Plan, other: Plan) -> tuple[int, ...] | None:
    """A worker permutation that maps base's holder sets onto other's and every worker's cost vector onto
    its image's; None if there is none."""
    want, vb, vo = sorted(other.holders), _worker_vectors(base), _worker_vectors(other)
    for perm in itertools.permutations(range(base.world_size)):
        if sorted(tuple(sorted(perm[r] for r in h)) for h in base.holders) == want and \
                all(vb[r] == vo[perm[r]] for r in range(base.world_size)):
            return perm
    return None


# (model, level, max_holder_sets, draws of 1..5 that train other pairs together). ResNet-18 at block level:
# its one pair of interchangeable blocks (stage 1) has complementary holder sets in the balanced plan, each
# meeting every other block's, so swapping them trains no new pair together (as a relabelling)
SHUFFLED = [("llama8", "block", None, 5), ("llama8", "neuron", None, 5), ("resnet", "block", None, 0),
            ("resnet", "neuron", None, 5), ("resnet", "block", 3, 3)]


@pytest.mark.parametrize(("name", "level", "cap", "changes"), SHUFFLED, ids=["-".join(map(str, c[:3])) for c in SHUFFLED])
def test_shuffle_keeps_loads_and_overlap_graph_and_changes_coheld_pairs(name: str, level: str, cap: int | None,
                                                                         changes: int) -> None:
    kw = dict(world_size=4, coverage=0.5, level=level, max_holder_sets=cap)
    base = _plan(name, redraw="shuffle", **kw)
    assert base.holders == _plan(name, **kw).holders, "draw 0 of shuffle is the base plan"
    changed = 0
    for draw in range(1, 6):
        plan = _plan(name, redraw="shuffle", draw=draw, **kw)
        check(plan)
        assert _relabelling(base, plan) is not None, f"{name} {level} draw {draw}: loads or holder sets changed"
        assert len(plan.components()) == len(base.components()) == 1, (draw, plan.components())
        assert len(plan.holder_sets()) == len(base.holder_sets()), draw
        changed += _coheld(plan.holders) != _coheld(base.holders)
        if draw <= 2:  # a relabelling keeps the co-held pairs: what shuffle is for
            assert _coheld(_plan(name, draw=draw, **kw).holders) == _coheld(base.holders), f"relabel draw {draw}"
    assert changed == changes, f"{name} {level}: {changed} of 5 shuffled draws train other pairs together"
    assert base.summary()["redraw"] == "shuffle" and base.redraw_info["interchangeable_units"] > 0


def test_shuffle_moves_only_interchangeable_blocks() -> None:
    """ResNet-18 at block level: only the two stage-1 blocks have one cost vector; the rest stay put."""
    base = _plan("resnet", world_size=4, coverage=0.5, redraw="shuffle")
    assert base.redraw_info["interchangeable_blocks"] == [[0, 1]], base.redraw_info
    for draw in range(1, 6):
        plan = _plan("resnet", world_size=4, coverage=0.5, redraw="shuffle", draw=draw)
        perm = _relabelling(base, plan)
        assert perm is not None
        for u in range(2, 8):  # every other block keeps its holders, up to the relabelling
            assert tuple(sorted(perm[r] for r in base.holders[u])) == plan.holders[u], (draw, u)


# ---- rolling ---------------------------------------------------------------------------------------
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
            pairs |= _coheld(holders)
    assert all(s == set(range(U)) for s in seen), f"after {reach} draws: {[sorted(s) for s in seen]}"
    assert len(pairs) / (U * (U - 1) // 2) == pytest.approx(info["pair_coverage_over_draws"])
    if info["families"][0]["difference_cover"]:
        assert info["pair_coverage_over_draws"] == 1.0
    for d in range(g, 3 * g):  # later draws train no pair the first g did not
        assert _coheld(_roll(U, n, k, d)[0]) <= pairs


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
            plan = _plan(name, world_size=4, coverage=0.5, level=level, draw=draw, redraw="rolling")
            check(plan)
            assert plan.components() == [(0, 1, 2, 3)] and not plan.degenerate(), plan.degenerate()
            for w in range(4):
                seen[w] |= set(plan.held_units(w))
        assert all(len(s) == len(plan.units) for s in seen), (name, level, seen)
        expect = 1.0 if level == "block" else pytest.approx(23 / 31)  # 4 groups: S = {0, 1}, no difference cover
        assert plan.summary()["redraw_info"]["pair_coverage_over_draws"] == expect, plan.redraw_info


def test_format_plan_summary_names_the_rule() -> None:
    from sdp.parallel.sdp_plan import format_plan_summary

    text = format_plan_summary(_plan("llama8", world_size=4, coverage=0.5, redraw="rolling").summary())
    assert "re-draws: rolling" in text and "S={0,1,2,5}" in text and "100% of unit pairs" in text, text
    assert "re-draws: relabel" in format_plan_summary(_plan("llama8", world_size=4, coverage=0.5).summary())
    assert "re-draws: shuffle" in format_plan_summary(_plan("llama8", world_size=4, coverage=0.5, redraw="shuffle").summary())


# ---- refusals ----------------------------------------------------------------------------------------
def test_bad_redraw_values_are_refused() -> None:
    with pytest.raises(PlanError, match=r"parallelism.redraw='roll' is invalid: allowed: relabel, shuffle, rolling"):
        _plan("llama8", world_size=4, coverage=0.5, redraw="roll")
    with pytest.raises(PlanError, match=r"redraw='rolling' needs .* 8 units on world_size=3 .* divides 8"):
        _plan("llama8", world_size=3, coverage=0.67, redraw="rolling")
    with pytest.raises(PlanError, match=r"groups of blocks.0 on world_size=8"):
        _plan("llama8", world_size=8, coverage=0.5, level="neuron", redraw="rolling")  # 4 groups on 8 workers
    with pytest.raises(PlanError, match=r"max_holder_sets=3 is invalid with parallelism.redraw='rolling'"):
        _plan("resnet", world_size=4, coverage=0.5, max_holder_sets=3, redraw="rolling")


@pytest.mark.parametrize(("overrides", "expect"), [
    (["parallelism.redraw=roll"], ["parallelism.redraw='roll'", "allowed: relabel, shuffle, rolling"]),
    (["parallelism.redraw=rolling", "cluster.world_size=3"], ["redraw='rolling'", "4 units on world_size=3", "model=mlp"]),
    (["parallelism.redraw=rolling", "parallelism.max_holder_sets=3"], ["parallelism.max_holder_sets=3", "redraw=rolling"]),
])
def test_config_refuses_bad_redraw_before_any_rank(overrides: list[str], expect: list[str]) -> None:
    from sdp.driver.config import validate
    from sdp.errors import ConfigError
    from tests.hydra_cfg import compose_config

    with pytest.raises(ConfigError) as info:
        validate(compose_config("experiment=smoke", "model=mlp", "parallelism=sdp", *overrides))
    assert all(e in str(info.value) for e in expect), str(info.value)


@pytest.mark.parametrize("variant", ["b_sdp_c50_shuffle50", "b_sdp_c50_shuffle200", "b_sdp_c50_roll50", "b_sdp_c50_roll200"])
def test_study_variants(variant: str) -> None:
    from sdp.driver.config import validate
    from tests.hydra_cfg import compose_config

    cfg = compose_config("experiment=smoke", "model=mlp", f"variant={variant}", "cluster.world_size=4")
    validate(cfg)
    p = cfg.parallelism
    assert (p.name, p.level, p.masking, p.coverage) == ("sdp", "block", "forward", 0.5), p
    assert p.resample_every == int(variant[len(variant.rstrip("0123456789")):]), p
    assert p.redraw == ("shuffle" if "shuffle" in variant else "rolling")


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


@pytest.mark.parametrize("rule,cap", [("rolling", None), ("shuffle", None), ("relabel", 4), ("shuffle", 4)])
def test_a_redraw_reuses_the_block_costs_and_draw_0s_assignment(rule: str, cap: int | None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's re-draw (:func:`sdp.parallel.sdp_plan.next_plan`) reuses the block costs it measured once and
    draw 0's holders (the driver's plan), and gives the plan built from nothing: measuring the costs (one meta
    forward per block) and the balanced assignment were most of a re-draw's time when redone every draw."""
    from omegaconf import OmegaConf

    from sdp.parallel.sdp_plan import next_plan, plan_for

    model, _ = _model("llama")
    cfg = OmegaConf.create({"coverage": 0.5, "level": "block", "assignment": "balanced", "groups": 1,
                            "drop_downsample": True, "plan_seed": 0, "balance": {"params": 1.0, "flops": 1.0, "activations": 1.0},
                            "max_holder_sets": cap, "redraw": rule})
    fresh = [plan_for(model=model, cfg=cfg, world_size=4, draw=d) for d in range(5)]
    first, costs = fresh[0], None
    plan, costs = next_plan(model=model, cfg=cfg, world_size=4, draw=1, first=first, costs=costs)  # measures once
    assert plan.holders == fresh[1].holders, (plan.holders, fresh[1].holders)
    monkeypatch.setattr(plan_module, "measure_block_costs", lambda m: pytest.fail("block costs measured again"))
    if rule != "relabel" or cap is not None:  # these rules start from draw 0's assignment: not searched again
        monkeypatch.setattr(plan_module, "assign", lambda **kw: pytest.fail("draw 0's assignment searched again"))
    for d in range(2, 5):
        plan, costs = next_plan(model=model, cfg=cfg, world_size=4, draw=d, first=first, costs=costs)
        assert plan.holders == fresh[d].holders, (d, plan.holders, fresh[d].holders)
    assert len({p.holders for p in fresh}) > 1, "the draws should differ"
