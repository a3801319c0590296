"""How a re-draw chooses the new plan (``parallelism.redraw``), pure and fast: one process, no ranks.

- ``relabel`` (default) gives, draw by draw, the holders the planner gave before the key existed (golden
  values recorded from that code, seed 3);
- ``shuffle`` keeps every worker's cost vector (params with remainders, FLOPs, activation bytes) and the
  holder sets (so the overlap graph), up to a relabelling of the workers, and changes which units are
  trained together, which a relabelling never does;
- ``rolling`` (FedRolex) is tests/test_redraw_rolling.py's; here only its refusals and its line in the plan
  summary, beside the other rules'.
"""

from __future__ import annotations

import functools
import itertools

import pytest

from sdp.subnet import plan as plan_module
from sdp.subnet.assign import assign
from sdp.subnet.plan import Plan, PlanError, check
from tests.redraw_plans import coheld, model_costs, plan_of


@functools.lru_cache(maxsize=None)
def _assign(costs: tuple, world_size: int, k: int, method: str, seed: int, draw: int) -> tuple:
    return assign(costs=list(costs), world_size=world_size, k=k, method=method, seed=seed, draw=draw)


@pytest.fixture(autouse=True)
def _memo_assign(monkeypatch: pytest.MonkeyPatch) -> None:
    """The balanced search takes a second for 8 equal blocks; it is pure, so each (costs, n, k, draw) runs once."""
    monkeypatch.setattr(plan_module, "assign", lambda *, costs, world_size, k, method, seed=0, draw=0:
                        _assign(tuple(costs), world_size, k, method, seed, draw))


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
        default, explicit = plan_of(name, **kw), plan_of(name, redraw="relabel", **kw)
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
    base = plan_of(name, redraw="shuffle", **kw)
    assert base.holders == plan_of(name, **kw).holders, "draw 0 of shuffle is the base plan"
    changed = 0
    for draw in range(1, 6):
        plan = plan_of(name, redraw="shuffle", draw=draw, **kw)
        check(plan)
        assert _relabelling(base, plan) is not None, f"{name} {level} draw {draw}: loads or holder sets changed"
        assert len(plan.components()) == len(base.components()) == 1, (draw, plan.components())
        assert len(plan.holder_sets()) == len(base.holder_sets()), draw
        changed += coheld(plan.holders) != coheld(base.holders)
        if draw <= 2:  # a relabelling keeps the co-held pairs: what shuffle is for
            assert coheld(plan_of(name, draw=draw, **kw).holders) == coheld(base.holders), f"relabel draw {draw}"
    assert changed == changes, f"{name} {level}: {changed} of 5 shuffled draws train other pairs together"
    assert base.summary()["redraw"] == "shuffle" and base.redraw_info["interchangeable_units"] > 0


def test_shuffle_moves_only_interchangeable_blocks() -> None:
    """ResNet-18 at block level: only the two stage-1 blocks have one cost vector; the rest stay put."""
    base = plan_of("resnet", world_size=4, coverage=0.5, redraw="shuffle")
    assert base.redraw_info["interchangeable_blocks"] == [[0, 1]], base.redraw_info
    for draw in range(1, 6):
        plan = plan_of("resnet", world_size=4, coverage=0.5, redraw="shuffle", draw=draw)
        perm = _relabelling(base, plan)
        assert perm is not None
        for u in range(2, 8):  # every other block keeps its holders, up to the relabelling
            assert tuple(sorted(perm[r] for r in base.holders[u])) == plan.holders[u], (draw, u)


def test_format_plan_summary_names_the_rule() -> None:
    from sdp.parallel.sdp_plan import format_plan_summary

    text = format_plan_summary(plan_of("llama8", world_size=4, coverage=0.5, redraw="rolling").summary())
    assert "re-draws: rolling" in text and "S={0,1,2,5}" in text and "100% of unit pairs" in text, text
    assert "re-draws: relabel" in format_plan_summary(plan_of("llama8", world_size=4, coverage=0.5).summary())
    assert "re-draws: shuffle" in format_plan_summary(plan_of("llama8", world_size=4, coverage=0.5, redraw="shuffle").summary())


# ---- refusals ----------------------------------------------------------------------------------------
def test_bad_redraw_values_are_refused() -> None:
    with pytest.raises(PlanError, match=r"parallelism.redraw='roll' is invalid: allowed: relabel, shuffle, rolling"):
        plan_of("llama8", world_size=4, coverage=0.5, redraw="roll")
    with pytest.raises(PlanError, match=r"redraw='rolling' needs .* 8 units on world_size=3 .* divides 8"):
        plan_of("llama8", world_size=3, coverage=0.67, redraw="rolling")
    with pytest.raises(PlanError, match=r"groups of blocks.0 on world_size=8"):
        plan_of("llama8", world_size=8, coverage=0.5, level="neuron", redraw="rolling")  # 4 groups on 8 workers
    with pytest.raises(PlanError, match=r"max_holder_sets=3 is invalid with parallelism.redraw='rolling'"):
        plan_of("resnet", world_size=4, coverage=0.5, max_holder_sets=3, redraw="rolling")


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


@pytest.mark.parametrize("rule,cap", [("rolling", None), ("shuffle", None), ("relabel", 4), ("shuffle", 4)])
def test_a_redraw_reuses_the_block_costs_and_draw_0s_assignment(rule: str, cap: int | None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's re-draw (:func:`sdp.parallel.sdp_plan.next_plan`) reuses the block costs it measured once and
    draw 0's holders (the driver's plan), and gives the plan built from nothing: measuring the costs (one meta
    forward per block) and the balanced assignment were most of a re-draw's time when redone every draw."""
    from omegaconf import OmegaConf

    from sdp.parallel.sdp_plan import next_plan, plan_for

    model, _ = model_costs("llama")
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
