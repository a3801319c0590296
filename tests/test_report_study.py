"""The CPU study's report (sdp/bench/study_report.py, verdicts.py) from run directories written by hand: paired
differences by seed with Student t intervals, resolved vs not resolved verdicts, the training peak taken
from the peak runs, time to target, and the plots."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from sdp.bench.study_report import Study, row_name
from sdp.bench.verdicts import claims, write_report

MIB = 2**20
DDP = {"name": "ddp"}
BSDP = {"name": "sdp", "level": "block", "masking": "forward", "coverage": 0.5, "rescale": "auto"}
BBSDP = {"name": "sdp", "level": "block", "masking": "backward", "coverage": 0.5, "rescale": "none"}


def run_dir(root: Path, job: int, *, seed: int, par: dict, losses: list[float], steps: int, flops_per_step: float,
            peak_mib: float = 100.0, budget: str = "flops", gap: float | None = None, step_s: float = 0.1,
            n_layers: int = 8, commit: str = "abc") -> None:
    d = root / str(job)
    d.mkdir(parents=True)
    cfg = {"seed": seed, "model": {"name": "llama", "n_layers": n_layers}, "parallelism": par, "cluster": {"world_size": 4},
           "train": {"steps": steps, "budget": budget}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    every = steps // len(losses)
    rows = [{"step": s, "loss": 2.0, "step_s": 0.1} for s in range(1, steps + 1)]
    rows += [{"step": every * (i + 1), "eval_loss": v} for i, v in enumerate(losses)]
    rows.sort(key=lambda r: (r["step"], "eval_loss" in r))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    per_rank = [{"rank": r, "param_bytes": peak_mib / 4 * MIB, "grad_bytes": 0, "optim_bytes": 0,
                 "train_peak_bytes": peak_mib * MIB * (1 + 0.01 * r)} for r in range(4)]
    summary = {"strategy": par["name"], "world_size": 4, "steps": steps, "model": "llama", "seed": seed,
               "final": {"eval_loss": losses[-1], "eval_accuracy": None, "assembly_gap": gap,
                         "eval_loss_workers": None if gap is None else losses[-1] - gap},
               "memory": {"per_rank": per_rank}, "comm": {"per_rank": [{"rank": 0, "bytes_per_step": MIB}]},
               "time": {"step_s_median": step_s}, "versions": {"git_commit": commit, "git_dirty": False},
               "budget": {"flops_per_step": flops_per_step, "total_flops": flops_per_step * steps}}
    (d / "summary.json").write_text(json.dumps(summary))


DDP_FINAL = (2.00, 2.10, 1.95)
BSDP_FINAL = (2.05, 2.16, 1.99)   # +0.05, +0.06, +0.04: resolved
BB_FINAL = (2.10, 2.00, 1.96)     # +0.10, -0.10, +0.01: not resolved


@pytest.fixture
def study(tmp_path: Path) -> Path:
    main, peaks = tmp_path / "lm" / "runs" / "main", tmp_path / "lm" / "runs" / "peaks"
    job = 0
    for seed in range(3):
        run_dir(main, job, seed=seed, par=DDP, losses=[3.0, DDP_FINAL[seed]], steps=100, flops_per_step=10.0)
        run_dir(main, job + 1, seed=seed, par=BSDP, losses=[2.02, BSDP_FINAL[seed]], steps=200, flops_per_step=5.0,
                gap=0.2 + 0.01 * seed)
        run_dir(main, job + 2, seed=seed, par=BBSDP, losses=[3.1, BB_FINAL[seed]], steps=100, flops_per_step=7.0,
                budget="iterations")
        job += 3
    run_dir(peaks, 0, seed=0, par=DDP, losses=[3.0], steps=20, flops_per_step=10.0, peak_mib=200.0, budget="iterations")
    run_dir(peaks, 1, seed=0, par=BSDP, losses=[3.0], steps=20, flops_per_step=5.0, peak_mib=110.0, budget="iterations")
    run_dir(peaks, 2, seed=0, par=BBSDP, losses=[3.0], steps=20, flops_per_step=7.0, peak_mib=170.0)
    timing = tmp_path / "lm" / "runs" / "timing"
    run_dir(timing, 0, seed=0, par=DDP, losses=[3.0], steps=60, flops_per_step=10.0, step_s=0.2)
    run_dir(timing, 1, seed=0, par=BSDP, losses=[3.0], steps=60, flops_per_step=5.0, step_s=0.05, budget="iterations")
    return tmp_path / "lm"


def test_rows_pair_by_seed_and_say_whether_resolved(study: Path) -> None:
    st = Study(study_dir=study, study="lm")
    assert sorted(st.rows) == ["B-SDP C=0.5", "B_β-SDP C=0.5 (same iterations)", "DDP"]
    p = st.paired("B-SDP C=0.5")
    d = [b - a for a, b in zip(DDP_FINAL, BSDP_FINAL)]
    assert p.n == 3 and p.mean == pytest.approx(statistics.fmean(d))
    assert p.half_width == pytest.approx(4.302652729911275 * statistics.stdev(d) / math.sqrt(3))
    assert p.resolved
    assert not st.paired("B_β-SDP C=0.5 (same iterations)").resolved
    table = {r["method"]: r for r in st.table()}
    assert "not resolved" not in table["B-SDP C=0.5"]["Δ loss vs DDP (95 % CI)"]
    assert "not resolved" in table["B_β-SDP C=0.5 (same iterations)"]["Δ loss vs DDP (95 % CI)"]
    # peaks come from runs/peaks (largest rank), matched to the same-iteration row by its method
    assert table["B-SDP C=0.5"]["train peak x DDP"] == "0.550"
    assert table["B_β-SDP C=0.5 (same iterations)"]["train peak x DDP"] == "0.850"
    assert table["B-SDP C=0.5"]["FLOPs x DDP"] == "1.00" and table["B_β-SDP C=0.5 (same iterations)"]["FLOPs x DDP"] == "0.70"
    # target = mean DDP final x 1.02 = 2.057: B-SDP reaches it at its first evaluation in seeds 0 and 2 only
    assert table["B-SDP C=0.5"]["to DDP loss x 1.02"] == "100 st / 5 s (3/3)"  # first evaluation; x 0.05 s (timing)
    assert table["B-SDP C=0.5"]["step s x DDP"] == "0.250" and table["B_β-SDP C=0.5 (same iterations)"]["step s x DDP"] == "–"
    assert table["B_β-SDP C=0.5 (same iterations)"]["to DDP loss x 1.02"].endswith("(2/3)")
    assert table["B-SDP C=0.5"]["assembly gap"].startswith("+0.210 ±")


def test_verdicts_and_files(study: Path) -> None:
    st = Study(study_dir=study, study="lm")
    text = "\n".join(claims(st))
    assert "B-SDP C=0.5 (assembled model) − DDP: higher by 0.050" in text and "(n = 3, resolved)" in text
    assert "its workers' own subnetworks − DDP: lower by 0.160" in text  # 0.2-0.22 gap: workers 1.85 vs 2.0
    assert "B_β-SDP C=0.5 (same iterations) − DDP: not resolved" in text
    assert "measured training peak 0.550x DDP's, inside the claimed" in text
    assert "by construction" in text
    assert "NOT met" in text and "about 4 seeds would meet it" in text  # half-width 0.025 > 0.02
    files = write_report(study_dir=study, study="lm")
    assert all(f.exists() and f.stat().st_size > 0 for f in files)
    assert {f.name for f in files} == {"REPORT.md", "table.csv", "curves.png", "frontier.png"}


def test_row_names_from_configs(tmp_path: Path) -> None:
    from sdp.report.runs import load_run

    run_dir(tmp_path, 0, seed=0, par={"name": "ddp_stochastic_depth", "survival_prob": 0.5, "decay": "linear"}, losses=[1.0], steps=10,
            flops_per_step=1.0)
    run_dir(tmp_path, 1, seed=0, par={**BSDP, "rescale": "none"}, losses=[1.0], steps=10, flops_per_step=1.0)
    assert row_name(load_run(tmp_path / "0")) == "DDP+StochDepth p=0.5"
    assert row_name(load_run(tmp_path / "1")) == "B-SDP C=0.5 rescale=none"
    # consolidation (issue 39): the share of the budget and the distillation weight set the row apart
    run_dir(tmp_path, 2, seed=0, par={**BSDP, "consolidate": 0.2, "distill_alpha": 0}, losses=[1.0], steps=10, flops_per_step=1.0)
    run_dir(tmp_path, 3, seed=0, par={**BSDP, "consolidate": 0.2, "distill_alpha": 0.5}, losses=[1.0], steps=10, flops_per_step=1.0)
    assert row_name(load_run(tmp_path / "2")) == "B-SDP C=0.5 consolidate=0.2"
    assert row_name(load_run(tmp_path / "3")) == "B-SDP C=0.5 consolidate=0.2 distill=0.5"


def test_rescale_rules_gap_against_depth_and_commits(study: Path) -> None:
    """Issue 17, item 8: every rescale rule's gap and its paired difference to rescale=eval; the gap at each
    depth of runs/depth beside the main sweep's; the header names which runs each commit made."""
    extras, depth = study / "runs" / "extras" / "1", study / "runs" / "depth"
    none_final = (2.15, 2.26, 2.09)  # rescale=none: +0.10 on every seed over rescale=eval (BSDP_FINAL)
    for seed in range(3):
        run_dir(extras, seed, seed=seed, par={**BSDP, "rescale": "none"}, losses=[3.0, none_final[seed]], steps=200,
                flops_per_step=5.0, gap=0.3, commit="def")
        run_dir(depth, seed, seed=seed, par=BSDP, losses=[3.0, 2.5], steps=200, flops_per_step=5.0,
                gap=(0.10, 0.12, 0.11)[seed], n_layers=4, commit="def")
    st = Study(study_dir=study, study="lm")
    assert "B-SDP C=0.5 rescale=none" in st.rows and list(st.gap_by_depth("B-SDP C=0.5")) == [4, 8]
    text = "\n".join(claims(st))
    assert "- rescale=eval (auto): assembly gap +0.210 ± " in text
    assert "- rescale=none: assembly gap +0.300 ± 0.000 nats (n = 3); assembled − DDP: higher by 0.150" in text
    assert "assembled − rescale=eval: higher by 0.100 ± 0.000 nats (n = 3, resolved)" in text
    assert "- 4 blocks: assembled 2.500 ± 0.000, workers' own 2.390 ± 0.010, gap +0.110 ± 0.025 nats (n = 3)" in text
    assert "- 8 blocks: assembled" in text
    # the trend, paired by seed: 8-block gaps 0.20, 0.21, 0.22 minus 4-block gaps 0.10, 0.12, 0.11
    assert "- gap at 8 blocks − gap at 4 blocks (paired by seed): higher by 0.100 ± 0.025 nats (n = 3, resolved)" in text, text
    write_report(study_dir=study, study="lm")
    head = next(line for line in (study / "REPORT.md").read_text().splitlines() if "code at commit(s)" in line)
    assert "abc (main seeds 0,1,2; peaks seeds 0; timing seeds 0)" in head, head
    assert "def (depth seeds 0,1,2; extras seeds 0,1,2)" in head, head


def test_rescale_none_is_read_from_the_kept_weights_of_every_diagnosed_seed(study: Path) -> None:
    """rescale=none acts at evaluation only: each diagnosed fixed-plan run's scale sweep at branch scale 1 is its
    assembled loss (all seeds, no training again); a rescale=none run of a seed is printed as the check against it,
    and its own n = 1 line gives way to the kept weights' line."""
    none_final = (2.15, 2.26, 2.09)  # the kept weights at scale 1: +0.10 over rescale=eval (BSDP_FINAL) on every seed
    main = study / "runs" / "main"
    for seed in range(3):
        job = 3 * seed + 1  # the fixture's B-SDP run of this seed
        sweep = {"scales": [0.25, 0.5, 1.0], "loss": [9.0, BSDP_FINAL[seed], none_final[seed]]}
        (main / str(job) / "diagnosis.json").write_text(json.dumps({"rescale": "eval", "scale_sweep": sweep}))
    run_dir(study / "runs" / "extras" / "1", 0, seed=0, par={**BSDP, "rescale": "none"}, losses=[3.0, 2.15 + 1e-7],
            steps=200, flops_per_step=5.0, gap=0.3)
    text = "\n".join(claims(Study(study_dir=study, study="lm")))
    line = next(x for x in text.splitlines() if x.startswith("- rescale=none"))
    assert "kept final weights at branch scale 1" in line and "(n = 3)" in line, line
    assert "assembled − rescale=eval: higher by 0.100 ± 0.000 nats (n = 3, resolved)" in line, line
    assert "assembled − DDP: higher by 0.150" in line, line  # DDP_FINAL + 0.15 on every seed
    assert line.endswith("its rescale=none runs' assembled loss − this: seed 0 +1.0e-07"), line
    assert sum(x.startswith("- rescale=none") for x in text.splitlines()) == 1, text


def test_fsdp_check_prints_the_differences(study: Path) -> None:
    run_dir(study / "runs" / "extras" / "0", 0, seed=0, par={"name": "fsdp"}, losses=[3.0, DDP_FINAL[0] + 2e-6],
            steps=100, flops_per_step=10.0)
    text = "\n".join(claims(Study(study_dir=study, study="lm")))
    assert "- seed 0, FSDP − DDP: training losses within 1e-06 at all 100 common steps; final eval_loss +2.00e-06 " \
           "(2.00000 vs 2.00000)" in text, text


def test_fsdp_check_names_the_first_step_the_training_losses_part(study: Path) -> None:
    """Long runs drift apart from float summation order: the check says where, not only how far at the end."""
    run_dir(study / "runs" / "extras" / "0", 0, seed=0, par={"name": "fsdp"}, losses=[3.0, DDP_FINAL[0] - 0.01],
            steps=100, flops_per_step=10.0)
    metrics = study / "runs" / "extras" / "0" / "0" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    for r in rows:
        if "loss" in r and r["step"] >= 40:
            r["loss"] += 5e-9 * 10 ** (r["step"] - 40)  # 5e-9 at step 40, 5e-7 at 42, 5e-6 at 43
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = next(x for x in claims(Study(study_dir=study, study="lm")) if x.startswith("- seed 0, FSDP"))
    assert line.startswith("- seed 0, FSDP − DDP: training losses within 1e-06 through step 42 of 100, first apart "
                           "at step 43 by +5.0e-06; final eval_loss -1.00e-02"), line


def test_without_fsdp_runs_the_check_reads_fsdp_ac_whose_losses_are_fsdps(study: Path) -> None:
    """Checkpointing changes no loss (tests/test_ac.py, FSDP included): FSDP+AC's runs are FSDP's check."""
    run_dir(study / "runs" / "extras" / "2", 0, seed=0, par={"name": "fsdp"}, losses=[3.0, DDP_FINAL[0] - 3e-6],
            steps=100, flops_per_step=10.0)
    cfg_file = study / "runs" / "extras" / "2" / "0" / "config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text())
    cfg["train"] |= {"ac": "full", "ac_every": 1}
    cfg_file.write_text(yaml.safe_dump(cfg))
    st = Study(study_dir=study, study="lm")
    assert "FSDP+AC" in st.rows and "FSDP" not in st.rows, sorted(st.rows)
    text = "\n".join(claims(st))
    assert "### Check: FSDP against DDP (the same updates; only the float summation order differs)\n\n- seed 0, " \
           "FSDP+AC − DDP: training losses within 1e-06 at all 100 common steps; final eval_loss -3.00e-06 " \
           "(2.00000 vs 2.00000)" in text, text


def test_only_forward_masked_rows_are_called_assembled(study: Path) -> None:
    """Backward masking runs the full model in every worker: its verdict must not speak of an assembled model."""
    for seed in range(3):
        run_dir(study / "runs" / "main", 9 + seed, seed=seed, par=BBSDP, losses=[3.1, BB_FINAL[seed]], steps=140,
                flops_per_step=7.0)
    text = "\n".join(claims(Study(study_dir=study, study="lm")))
    assert "B_β-SDP C=0.5 (the full model every worker ran) − DDP: not resolved" in text, text
    assert "B_β-SDP C=0.5 (assembled model)" not in text and "B-SDP C=0.5 (assembled model) − DDP" in text


def test_ensemble_columns_and_verdicts_only_where_runs_have_an_ensemble(study: Path) -> None:
    """eval.ensemble: the study's table gets the ensemble's columns and the verdicts an "ensemble − DDP" only
    when some run has one ("–" in rows without: absent, never 0), so a study of older runs renders as before;
    the sweep table's column is dropped when empty, as every column."""
    from sdp.report.render import to_markdown
    from sdp.report.runs import find_runs
    from sdp.report.tables import build_tables

    def sweep_md() -> str:
        return "\n".join(to_markdown(t) for t in build_tables(find_runs(study / "runs" / "main")))

    before = Study(study_dir=study, study="lm")
    assert not before.ensembled and "workers' ensemble loss" not in before.table()[0], before.table()[0]
    assert "ensemble" not in "\n".join(claims(before)) and "ensemble" not in sweep_md()
    ens = (1.95, 2.07, 1.90)  # B-SDP's ensemble: DDP - 0.05, -0.03, -0.05
    for d in sorted((study / "runs" / "main").iterdir()):
        s = json.loads((d / "summary.json").read_text())
        if yaml.safe_load((d / "config.yaml").read_text())["parallelism"] == BSDP:
            s["final"].update(eval_loss_ensemble=ens[s["seed"]], eval_accuracy_ensemble=None)
            (d / "summary.json").write_text(json.dumps(s))
    st = Study(study_dir=study, study="lm")
    table = {r["method"]: r for r in st.table()}
    assert st.ensembled and table["B-SDP C=0.5"]["workers' ensemble loss"] == "1.973 ± 0.087", table["B-SDP C=0.5"]
    assert table["B-SDP C=0.5"]["Δ ensemble loss vs DDP"].startswith("-0.043 ± "), table["B-SDP C=0.5"]
    for name in ("DDP", "B_β-SDP C=0.5 (same iterations)"):
        assert table[name]["workers' ensemble loss"] == table[name]["Δ ensemble loss vs DDP"] == "–", table[name]
    text = "\n".join(claims(st))
    assert "  - the ensemble of its workers' subnetworks (mean probability) − DDP: lower by 0.043 ± " in text, text
    assert "; ensemble − DDP: lower by 0.043 ± " in text and text.count("ensemble − DDP") == 1, text
    assert "| workers' ensemble eval loss |" in sweep_md()


def test_the_memory_verdict_sets_sdp_against_activation_checkpointing(study: Path) -> None:
    """A peak run with train.ac=full is its own row (label +AC) and the memory verdict names each AC peak run's
    ratio to DDP's beside SDP's: B-SDP with AC and DDP with AC (the memory baseline a reviewer asks for)."""
    peaks = study / "runs" / "peaks"
    for job, (par, mib) in enumerate(((BSDP, 60.0), (DDP, 80.0)), start=3):
        run_dir(peaks, job, seed=0, par=par, losses=[3.0], steps=20, flops_per_step=5.0, peak_mib=mib, budget="iterations")
        cfg = yaml.safe_load((peaks / str(job) / "config.yaml").read_text())
        cfg["train"]["ac"] = "full"
        (peaks / str(job) / "config.yaml").write_text(yaml.safe_dump(cfg))
    st = Study(study_dir=study, study="lm")
    assert {"B-SDP+AC C=0.5", "B-SDP C=0.5"} <= set(st.peaks), sorted(st.peaks)
    text = "\n".join(claims(st))
    assert "measured training peak 0.550x DDP's, inside the claimed" in text, text  # the plain row unchanged
    assert "against activation checkpointing" in text and "DDP+AC 0.400x, B-SDP+AC C=0.5 0.300x DDP's." in text, text
