"""The remedies section (sdp/bench/remedies.py) computed from run directories: built from copies of the
committed LM study's runs, with the remedy runs' config and summary edited to known values, so every
figure the section prints can be checked against a hand computation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from sdp.bench.remedies import Remedies, remedies_section
from sdp.report.stats import t_half_width
from sdp.bench.study_report import Study

LM = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "cpu-study" / "lm_text" / "runs"


def _run(src: Path, dst: Path, *, config: dict | None = None, final: dict | None = None,
         resample_bytes: int = 0, resample_s: float = 0.0) -> None:
    shutil.copytree(src, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    for key, value in (config or {}).items():
        node, leaf = key.split(".")
        cfg[node][leaf] = value
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = json.loads((dst / "summary.json").read_text())
    summary["final"].update(final or {})
    for r in summary["comm"]["per_rank"]:
        r["outside_training"] = {"resample": {"bytes": resample_bytes, "collectives": 1}} if resample_bytes else {}
    for r in summary["time"]["per_rank"]:
        r["phases_s_total"] = {"resample": resample_s}
    (dst / "summary.json").write_text(json.dumps(summary))


def _study(tmp_path: Path) -> Path:
    runs = tmp_path / "lm" / "runs"
    ddp = {}
    for i in range(3):  # DDP seeds 0-2 (the main sweep's first jobs)
        _run(LM / "main" / str(i), runs / "main" / str(i))
        ddp[i] = json.loads((LM / "main" / str(i) / "summary.json").read_text())["final"]["eval_loss"]
    for i in range(6, 9):  # the main sweep's B-SDP C=0.5, seeds 0-2: what the fixed plan's re-run must reproduce
        _run(LM / "main" / str(i), runs / "main" / str(i))
    shutil.copytree(LM / "peaks", runs / "peaks")
    for seed in range(3):
        src = LM / "main" / str(6 + seed)  # B-SDP C=0.5, seeds 0-2
        _run(src, runs / "remedies" / f"seed-{seed}" / "0", final={"eval_loss_ensemble": ddp[seed] + 0.01 * (seed + 1)})
        _run(src, runs / "remedies" / f"seed-{seed}" / "1",
             config={"parallelism.resample_every": 50, "parallelism.redraw": "rolling"},
             final={"eval_loss": ddp[seed] + 0.02, "eval_loss_ensemble": ddp[seed] - 0.01},
             resample_bytes=10_000_000, resample_s=1.0)
    return tmp_path / "lm"


def test_remedy_rows_pair_with_ddp_by_seed_and_count_redraw_cost(tmp_path: Path) -> None:
    st = Study(study_dir=_study(tmp_path), study="lm")
    rem = Remedies(study=st)
    assert sorted(rem.rows) == ["B-SDP C=0.5, fixed plan", "B-SDP C=0.5, rolling every 50"], sorted(rem.rows)
    ens = rem.paired("B-SDP C=0.5, fixed plan", "eval_loss_ensemble")
    assert ens.n == 3 and abs(ens.mean - 0.02) < 1e-12, ens
    assert abs(ens.half_width - t_half_width([0.01, 0.02, 0.03])) < 1e-12, ens
    rolled = rem.paired("B-SDP C=0.5, rolling every 50", "eval_loss")
    assert abs(rolled.mean - 0.02) < 1e-12 and rolled.half_width < 1e-9, rolled  # the same +0.02 on every seed
    records = {r["remedy (B-SDP C=0.5)"]: r for r in rem.records()}
    fixed, rolling = records["fixed plan"], records["rolling every 50"]
    # the re-draws' traffic and time are spread over the steps: more bytes and seconds per step than the fixed plan
    assert float(rolling["comm/step x DDP (incl. re-draws)"]) > float(fixed["comm/step x DDP (incl. re-draws)"]), records
    assert float(rolling["step s x fixed plan (incl. re-draws)"]) > 1.0 == float(fixed["step s x fixed plan (incl. re-draws)"])
    assert fixed["train peak x DDP"] != "–" and fixed["assembly gap"] != "–", fixed
    lines = "\n".join(rem.lines())
    assert "largest |Δ eval loss| over 3 seeds 0.00e+00" in lines, lines  # the fixed re-run is the main sweep's run


def test_no_section_without_remedy_runs(tmp_path: Path) -> None:
    study = _study(tmp_path)
    shutil.rmtree(study / "runs" / "remedies")
    assert remedies_section(study=Study(study_dir=study, study="lm")) == []
    assert not (study / "remedies.csv").exists()


def test_step_time_comes_from_the_quiet_timing_runs_when_the_study_has_them(tmp_path: Path) -> None:
    """With runs/remedies/timing, a row's step time is its rule's timing-run median plus one re-draw's
    seconds over the row's period R, over the fixed plan's timing median: not the sweep's own median step. One
    re-draw's seconds: the mean over the row's own re-draws (1.0 s over 4: 0.25 s), not the timing run's two
    (1.5 s each, first-time costs included)."""
    study = _study(tmp_path)
    for seed in range(3):
        own = study / "runs" / "remedies" / f"seed-{seed}" / "1" / "summary.json"
        summary = json.loads(own.read_text())
        summary["strategy_info"]["redraws"] = 4
        own.write_text(json.dumps(summary))
    src = LM / "main" / "6"
    timing = study / "runs" / "remedies" / "timing"
    _run(src, timing / "0")  # the fixed plan
    _run(src, timing / "1", config={"parallelism.resample_every": 50, "parallelism.redraw": "rolling"}, resample_s=3.0)
    summary = json.loads((timing / "1" / "summary.json").read_text())
    summary["strategy_info"]["redraws"] = 2  # two re-draws of 1.5 s each
    (timing / "1" / "summary.json").write_text(json.dumps(summary))
    medians = [r["step_s_median"] for r in summary["time"]["per_rank"]]
    rem = Remedies(study=Study(study_dir=study, study="lm"))
    assert sorted(rem.timing) == ["fixed", "rolling"], sorted(rem.timing)
    assert sorted(rem.rows) == ["B-SDP C=0.5, fixed plan", "B-SDP C=0.5, rolling every 50"], sorted(rem.rows)  # timing runs are not rows
    records = {r["remedy (B-SDP C=0.5)"]: r for r in rem.records()}
    expected = (max(medians) + 0.25 / 50) / max(medians)
    assert records["rolling every 50"]["step s x fixed plan (incl. re-draws)"] == f"{expected:.3f}", (records, expected)
    assert records["fixed plan"]["step s x fixed plan (incl. re-draws)"] == "1.000", records


def test_the_fixed_plan_is_the_main_row_whose_runs_kept_their_weights(tmp_path: Path) -> None:
    """A study whose B-SDP C = 0.5 runs kept their final weights (runs/main/kept, the LM study's kept-<s> stages)
    re-runs no fixed plan: the section's fixed-plan row is the main row itself (the same runs, no self-check)."""
    study = _study(tmp_path)
    runs = study / "runs"
    for seed in range(3):
        shutil.rmtree(runs / "remedies" / f"seed-{seed}" / "0")
        shutil.move(runs / "main" / str(6 + seed), runs / "main" / "kept" / f"seed-{seed}" / "0")
        _keep(runs / "main" / "kept" / f"seed-{seed}" / "0")
    st = Study(study_dir=study, study="lm")
    assert st.kept == "B-SDP C=0.5" and sorted(st.rows[st.kept].runs) == [0, 1, 2], (st.kept, sorted(st.rows))
    rem = Remedies(study=st)
    assert list(rem.rows) == ["B-SDP C=0.5, fixed plan", "B-SDP C=0.5, rolling every 50"], list(rem.rows)
    assert rem.rows[rem.fixed] is st.rows["B-SDP C=0.5"]
    assert rem.paired(rem.fixed, "eval_loss").mean == st.paired("B-SDP C=0.5").mean
    assert not any("re-run" in line for line in rem.lines()), rem.lines()
    for seed in range(3):  # kept runs of another row (here: rescale=none) are not the re-draws' fixed plan
        cfg_file = runs / "main" / "kept" / f"seed-{seed}" / "0" / "config.yaml"
        cfg = yaml.safe_load(cfg_file.read_text())
        cfg["parallelism"]["rescale"] = "none"
        cfg_file.write_text(yaml.safe_dump(cfg))
    other = Study(study_dir=study, study="lm")
    assert other.kept == "B-SDP C=0.5 rescale=none" and list(Remedies(study=other).rows) == ["B-SDP C=0.5, rolling every 50"]
    shutil.rmtree(runs / "main" / "kept")  # neither kept runs nor a re-run: no fixed-plan row, no invented one
    assert list(Remedies(study=Study(study_dir=study, study="lm")).rows) == ["B-SDP C=0.5, rolling every 50"]


def _keep(run: Path) -> None:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["save_final"] = "fp32"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_a_rows_label_keeps_what_sets_it_apart_from_the_fixed_plan() -> None:
    """Two scale rules of one re-draw (rescale=none and the default) must not read alike in the table."""
    rem = Remedies.__new__(Remedies)
    rem.fixed = "B-SDP C=0.5, fixed plan"
    assert rem.label("B-SDP C=0.5, shuffle every 50") == "shuffle every 50"
    assert rem.label("B-SDP C=0.5 rescale=none, shuffle every 50") == "rescale=none, shuffle every 50"
    assert rem.label("B-SDP C=0.5, fixed plan") == "fixed plan"
    rem.fixed = None  # no fixed plan in the study: the whole name
    assert rem.label("B-SDP C=0.5 rescale=none, shuffle every 50") == "B-SDP C=0.5 rescale=none, shuffle every 50"
