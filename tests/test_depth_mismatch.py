"""The one-model section's depth table (sdp/bench/depth_mismatch.py), read from the committed LM study: each row's
training depth, re-composition and branch scales come from its own config, its interval is the paired difference
to DDP that the rest of the report prints."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from sdp.bench.depth_mismatch import averaged_over, blocks_per_step, branch_scales, depth_lines, recomposed
from sdp.bench.study_report import Study, interval
from sdp.report.stats import paired_difference

LM = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "cpu-study" / "lm"


def _cells(lines: list[str]) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in "\n".join(lines).splitlines() if line.startswith("| ") and not line.startswith("| row")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_rows_of_the_committed_lm_study() -> None:
    st = Study(study_dir=LM, study="lm")
    rows = _cells(depth_lines(study=st))
    ld, sd = rows["DDP+LayerDrop p=0.5"], rows["DDP+StochDepth p=0.5"]
    assert ld[:3] == ["Binomial(8, 0.5): 4 of 8 on average, varies per step", "every step, each rank its own draw", "1; 1"], ld
    assert sd[2] == "1/p = 2; 1", sd  # stochastic depth scales kept branches, LayerDrop does not
    fixed = rows["B-SDP C=0.5, fixed plan"]
    assert fixed[:3] == ["exactly 4 of 8 (a worker's subnetwork)", "never (fixed plan)", "1; k/n = 0.5"], fixed
    assert rows["B-SDP C=0.5 rescale=none, shuffle every 1"][1:3] == ["every 1 steps (shuffle)", "1; 1"]
    want = paired_difference(st.rows["DDP+LayerDrop p=0.5"].values("eval_loss"), st.ddp.values("eval_loss"))
    assert ld[4] == interval(want) and ld[5] == ",".join(map(str, sorted(st.rows["DDP+LayerDrop p=0.5"].runs))), ld
    assert rows["B-SDP C=0.5, fixed plan"][4] == interval(st.paired("B-SDP C=0.5")), fixed  # the main table's figure
    assert (ld[3], fixed[3]) == ("all 4 ranks", "its 2 holders of 4 ranks"), (ld, fixed)
    bb = rows["B_β-SDP C=0.5"]  # the full model's forward at every step, each block averaged over its holders
    assert bb[:4] == ["all 8 (backward masking: the full model's forward)", "never (the full model)", "1; 1",
                      "its 2 holders of 4 ranks"], bb
    from sdp.bench.one_model import OneModel  # the one-model section's consolidation rows, as the report adds them
    also = _cells(depth_lines(study=st, also=OneModel(study=st).depth_rows()))
    world = also["B-SDP C=0.5 consolidate=0.5 average=world"]
    assert world[3] == "its 2 holders of 4 ranks, then all 4 ranks", world


def test_depth_of_each_rule_from_the_config() -> None:
    def run(fraction: float | None = None, k: int | None = None, **flat: object) -> SimpleNamespace:
        info = {"plan": {"k": k}} if k else {}
        return SimpleNamespace(flat={"model.n_layers": 8, **flat},
                               summary=SimpleNamespace(strategy_info=info, coverage={"fraction": fraction}, world_size=4))
    exact = run(**{"parallelism.name": "ddp_layerdrop", "parallelism.survival_prob": 0.5, "parallelism.depth": "exact"})
    assert blocks_per_step(exact) == "exactly 4 of 8" and recomposed(exact) == "every step, each rank its own draw"
    # C = 0.3 asked, k / n = 0.25 realised (world 4, k = 1): the row reads the plan's, as the run recorded it
    sdp = run(0.25, **{"parallelism.name": "sdp", "parallelism.coverage": 0.3, "parallelism.rescale": "train",
                 "parallelism.resample_every": 200, "parallelism.redraw": "rolling"})
    assert blocks_per_step(sdp) == "exactly 2 of 8 (a worker's subnetwork)" and branch_scales(sdp) == "n/k = 4; 1"
    assert recomposed(sdp) == "every 200 steps (rolling)"


def test_consolidation_names_its_phases_and_its_holders() -> None:
    """Consolidation over the last half with LayerDrop inside, and from the first step at C = 1 (every rank a holder
    of every block: the gradient DDP+LayerDrop averages), each read from its config and plan."""
    def run(fraction: float, k: int, **par: object) -> SimpleNamespace:
        return SimpleNamespace(flat={"model.n_layers": 8, "parallelism.name": "sdp", **{f"parallelism.{key}": v for key, v in par.items()}},
                               summary=SimpleNamespace(strategy_info={"rescale": par["rescale"], "plan": {"k": k}},
                                                       coverage={"fraction": fraction}, world_size=4))
    half = run(0.5, 2, consolidate=0.5, consolidate_survival=0.5, rescale="none")
    assert blocks_per_step(half) == ("exactly 4 of 8 (a worker's subnetwork), then the assembled model, Binomial(8, 0.5): "
                                     "4 of 8 on average, varies per step (the last 0.5 of the budget)"), blocks_per_step(half)
    assert recomposed(half) == "never (fixed plan), then every step, each rank its own draw" and branch_scales(half) == "1, then 1; 1"
    assert averaged_over(half) == "its 2 holders of 4 ranks"
    whole = run(1.0, 4, consolidate=1.0, consolidate_survival=0.5, rescale="none")
    assert blocks_per_step(whole).startswith("the assembled model, Binomial(8, 0.5)") and averaged_over(whole) == "all 4 ranks"
    assert recomposed(whole) == "every step, each rank its own draw", recomposed(whole)
    # world-averaged consolidation (consolidate_average=world): the holders' average in phase 1 only
    world = run(0.5, 2, consolidate=0.5, rescale="eval", consolidate_average="world")
    assert averaged_over(world) == "its 2 holders of 4 ranks, then all 4 ranks", averaged_over(world)
    assert averaged_over(run(0.5, 2, consolidate=1.0, rescale="eval", consolidate_average="world")) == "all 4 ranks"
    # without drops, at k / n's scale: the assembled model whole, at the evaluation's scale in training too
    scaled = run(0.5, 2, consolidate=1.0, rescale="eval")
    assert (blocks_per_step(scaled), recomposed(scaled), branch_scales(scaled)) == \
        ("the assembled model, all 8", "never (the assembled model)", "k/n = 0.5; k/n = 0.5")
