"""Issue 38's verdicts against the baselines (sdp/bench/baseline_verdicts.py) from run directories: copies of the
committed lm_text study's runs with losses edited to known values, so that each pairing, each resource and the
dominance lines can be checked against a hand computation."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import yaml

from sdp.bench.baseline_verdicts import agreement, baseline_lines, ensemble_cost, loss_twin, small_dense, worker_depth
from sdp.bench.frontier import frontier_points
from sdp.bench.study_report import Study
from sdp.report.runs import Run

LM = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "cpu-study" / "lm_text" / "runs"
SMALL = (0.30, 0.25, 0.35)  # the dense model of a worker's depth, above DDP by seed
BSDP = (0.40, 0.45, 0.50)   # B-SDP C = 0.5's assembled model, above DDP by seed
WORKERS = (0.20, 0.20, 0.25)  # its workers' own subnetworks, above DDP by seed
AC = (-0.10, -0.12, -0.08)  # a DDP+AC row made to beat DDP (its loss is DDP's by construction in a real run)


def _copy(src: Path, dst: Path, *, final: dict, cfg_edit: dict | None = None, seed: int | None = None) -> None:
    shutil.copytree(src, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    for key, value in (cfg_edit or {}).items():
        node, leaf = key.split(".")
        cfg[node][leaf] = value
    cfg["seed"] = cfg["seed"] if seed is None else seed
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = json.loads((dst / "summary.json").read_text())
    summary["final"].update(final)
    (dst / "summary.json").write_text(json.dumps(summary))


def _loss(job: int) -> dict:
    return json.loads((LM / "main" / str(job) / "summary.json").read_text())["final"]


def _study(tmp_path: Path, *, ac: bool = True) -> Study:
    runs = tmp_path / "lm" / "runs"
    shutil.copytree(LM / "peaks", runs / "peaks")
    full = int(yaml.safe_load((LM / "main" / "0" / "config.yaml").read_text())["model"]["n_layers"])
    for seed in range(3):
        ddp = _loss(seed)["eval_loss"]
        shutil.copytree(LM / "main" / str(seed), runs / "main" / str(seed))
        _copy(LM / "main" / str(6 + seed), runs / "main" / f"bsdp-{seed}",  # B-SDP C = 0.5 of that seed
              final={"eval_loss": ddp + BSDP[seed], "eval_loss_workers": ddp + WORKERS[seed]})
        _copy(LM / "main" / str(seed), runs / "main" / f"small-{seed}", final={"eval_loss": ddp + SMALL[seed]},
              cfg_edit={"model.n_layers": full // 2, "train.flops_reference": {"n_layers": full}})
        if ac:
            _copy(LM / "peaks" / "9", runs / "main" / f"ac-{seed}", final={"eval_loss": ddp + AC[seed]}, seed=seed)
    return Study(study_dir=tmp_path / "lm", study="lm")


def test_sdp_is_paired_with_the_dense_model_of_a_workers_depth(tmp_path: Path) -> None:
    st = _study(tmp_path)
    full = int(st.ddp.runs[0].flat["model.n_layers"])
    assert worker_depth(st.rows["B-SDP C=0.5"].runs[0]) == full // 2
    assert worker_depth(st.ddp.runs[0]) is None  # DDP has no plan
    dense = small_dense(st, st.rows["B-SDP C=0.5"].runs[0])
    assert dense == f"DDP n_layers={full // 2} (FLOP-matched to n_layers={full})", dense
    text = "\n".join(baseline_lines(st, unit="nats"))
    assembled = statistics.fmean(b - s for b, s in zip(BSDP, SMALL))
    workers = statistics.fmean(w - s for w, s in zip(WORKERS, SMALL))
    assert f"assembled model − dense: higher by {assembled:.3f}" in text, text
    assert f"workers' own subnetworks − dense: lower by {-workers:.3f}" in text, text
    plan = st.rows["B-SDP C=0.5"].runs[0].summary.strategy_info["plan"]
    assert ensemble_cost(st.rows["B-SDP C=0.5"].runs[0]) == (
        f"{plan['world_size']} subnetworks of {full // 2} blocks: {plan['k']}x the assembled model's blocks at inference")


def test_each_baseline_with_its_spend_and_the_methods_that_dominate(tmp_path: Path) -> None:
    """DDP+AC (peak below B-SDP's, loss resolved below it) is named on the peak axis; DDP (peak above) and the small
    dense model (no peak run in these copies) are not."""
    st = _study(tmp_path)
    text = "\n".join(baseline_lines(st, unit="nats"))
    gap = statistics.fmean(b - a for b, a in zip(BSDP, AC))
    peak = st.ratio("DDP+AC", "train_peak_bytes", source="peaks")
    assert f"- DDP+AC (peak {peak:.3f}x DDP's; wire bytes per token " in text, text
    assert f"B-SDP C=0.5 − DDP+AC: higher by {gap:.3f}" in text, text
    line = next(x for x in text.splitlines() if x.startswith("- at or below B-SDP C=0.5's training peak"))
    named = [entry.split(" (")[0] for entry in line.split("assembled model: ")[1].split("; ")]
    assert named == ["DDP+AC"], (named, line)
    assert "FSDP+AC (peak " in text and "no main runs yet" in text, text  # measured peak, no main runs


def test_without_its_own_runs_ddp_ac_is_read_from_ddps_and_other_baselines_say_so(tmp_path: Path) -> None:
    """DDP+AC without main runs: DDP's losses and bytes by construction (its peak run is DDP's config with
    checkpointing on), its own measured peak; FSDP+AC's base (FSDP) has no main runs here, so it has no pairs."""
    st = _study(tmp_path, ac=False)
    assert loss_twin(st, "DDP+AC") == "DDP" and loss_twin(st, "FSDP+AC") is None and loss_twin(st, "DDP") is None
    text = "\n".join(baseline_lines(st, unit="nats"))
    assert "DDP+AC" not in frontier_points(st), sorted(frontier_points(st))  # its twin point is this section's only
    gap = statistics.fmean(BSDP)
    assert f"B-SDP C=0.5 − DDP+AC: higher by {gap:.3f}" in text and "DDP's runs, by construction" in text, text
    assert "B-SDP C=0.5 − FSDP+AC: no paired runs" in text, text
    peak = st.ratio("DDP+AC", "train_peak_bytes", source="peaks")
    line = next(x for x in text.splitlines() if x.startswith("- at or below B-SDP C=0.5's training peak"))
    assert f"DDP+AC ({peak:.3f}x DDP's, lower by {gap:.3f}" in line, line
    wire = next(x for x in text.splitlines() if x.startswith("- DDP+AC ("))
    assert "wire bytes per token 1.000x DDP's" in wire, wire


def test_no_worker_depth_off_the_block_level(tmp_path: Path) -> None:
    st = _study(tmp_path, ac=False)
    run = st.rows["B-SDP C=0.5"].runs[0]
    run.summary.strategy_info["plan"]["level"] = "neuron"
    assert worker_depth(run) is None and small_dense(st, run) is None


def _losses(tmp: Path, name: str, losses: dict[int, float]) -> Run:
    run_dir = tmp / name
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    return Run(path=run_dir, config={"seed": 0}, overrides=[], summary=None)


def test_agreement_names_the_last_agreeing_and_the_first_parting_common_step(tmp_path: Path) -> None:
    a = _losses(tmp_path, "a", {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6})
    b = _losses(tmp_path, "b", {1: 1.0, 3: 0.8, 4: 0.7 + 3e-6, 5: 0.6, 6: 0.5})  # step 2 unlogged, 4 parts, 5 agrees
    assert agreement(a, b, tol=1e-6) == "training losses within 1e-06 through step 3 of 5, first apart at step 4 by -3.0e-06"
    first = _losses(tmp_path, "c", {1: 1.1, 3: 0.8})  # parts at the first common step: none agreed before it
    assert agreement(a, first, tol=1e-6) == "training losses within 1e-06 through step 0 of 3, first apart at step 1 by -1.0e-01"
    assert agreement(a, a, tol=1e-6) == "training losses within 1e-06 at all 5 common steps"
    assert agreement(a, _losses(tmp_path, "d", {9: 0.1}), tol=1e-6) == "no training loss logged at a common step"
