"""Statistics in sdp-report: paired differences to DDP with Student t intervals, time to target, and
tables split by evaluation protocol (including runs written before ``eval.bn`` existed)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from sdp.report.build import make_report
from sdp.report.runs import find_runs
from sdp.report.stats import paired_difference, t_half_width, time_to_target
from sdp.report.tables import build_tables
from tests.test_report import BSDP, DDP, fake_run


def test_paired_difference_interval_by_hand() -> None:
    ours = {0: 1.10, 1: 1.30, 2: 1.05}
    ref = {0: 1.00, 1: 1.20, 2: 1.00, 3: 9.0}  # seed 3 has no partner: left out
    p = paired_difference(ours, ref)
    d = [0.10, 0.10, 0.05]
    assert p.n == 3 and p.mean == pytest.approx(statistics.fmean(d))
    t975_df2 = 4.302652729911275  # Student t quantile, 2 degrees of freedom
    assert p.half_width == pytest.approx(t975_df2 * statistics.stdev(d) / math.sqrt(3))
    assert p.resolved  # 0.0833 +- 0.0717 excludes 0
    noisy = paired_difference({0: 1.0, 1: 1.4}, {0: 1.1, 1: 1.1})  # +0.15 +- 2.5: contains 0
    assert noisy.n == 2 and not noisy.resolved
    single = paired_difference({0: 1.0}, {0: 0.5})
    assert single.half_width is None and not single.resolved, "one pair has no interval"
    assert t_half_width([1.0]) is None


def test_time_to_target_counts_steps_and_logged_seconds() -> None:
    rows = [{"step": s, "loss": 1.0, "step_s": 0.5} for s in (1, 2)] + [{"step": 2, "eval_loss": 0.9}]
    rows += [{"step": 4, "loss": 0.8, "step_s": 1.0}, {"step": 4, "eval_loss": 0.6}]  # logged every 2 steps here
    assert time_to_target(rows, target=0.95) == (2, 1.0)
    assert time_to_target(rows, target=0.7) == (4, 3.0)  # step 4's row stands for steps 3 and 4
    assert time_to_target(rows, target=0.1) == (None, None)


def _with_eval_curve(run_dir: Path, losses: list[float]) -> None:
    rows = []
    for step, loss in enumerate(losses, start=1):
        rows += [{"step": step, "loss": loss, "step_s": 0.25}, {"step": step, "eval_loss": loss}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["final"]["eval_loss"] = losses[-1]
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_table_gives_paired_deltas_and_time_to_target(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    job = 0
    for seed in range(3):
        _with_eval_curve(fake_run(root, job, seed=seed, parallelism=DDP, acc=0.9, state_mib=30, comm_mib=10, step_s=1.0),
                         [2.0, 1.0, 0.50 + 0.02 * seed])
        _with_eval_curve(fake_run(root, job + 1, seed=seed, parallelism=BSDP, acc=0.8 + 0.01 * seed, state_mib=15,
                                  comm_mib=4, step_s=0.5), [2.0, 1.5, 0.80, 0.52 + 0.02 * seed])
        job += 2
    (table,) = build_tables(find_runs(root))
    ddp, sdp = table.rows
    assert ddp.method == "DDP" and not ddp.paired
    loss = sdp.paired["eval_loss"]
    assert loss.n == 3 and loss.mean == pytest.approx(0.02) and loss.resolved  # identical offsets: zero spread
    assert sdp.paired["eval_accuracy"].mean == pytest.approx(-9.0)  # points: 90 vs 80, 81, 82
    # target = DDP's mean final loss 0.52 x 1.02 = 0.5304: DDP seeds 0 and 1 (0.50, 0.52) reach it at step 3,
    # seed 2 (0.54) never; B-SDP only seed 0 (0.52, at step 4 = 4 x 0.25 s), seeds 1, 2 (0.54, 0.56) never
    assert ddp.reached == (2, 3) and ddp.to_target["steps"].mean == 3 and ddp.to_target["seconds"].mean == 0.75
    assert sdp.reached == (1, 3) and sdp.to_target["steps"].mean == 4 and sdp.to_target["seconds"].mean == 1.0
    report = make_report(sweep_dir=root)
    assert "+0.0200 ± 0.0000" in report.markdown and "(1 of 3)" in report.markdown, report.markdown


def test_rows_evaluated_differently_never_share_a_table(tmp_path: Path) -> None:
    """A sweep over eval.bn splits into one table per protocol; a legacy run (no eval node) counts as
    what the code did then: SDP's own parallelism.bn, average for every other strategy."""
    root = tmp_path / "sweep"
    legacy_sdp = fake_run(root, 0, seed=0, parallelism={**BSDP, "bn": "reestimate"}, acc=0.86, state_mib=15, comm_mib=4, step_s=0.5)
    fake_run(root, 1, seed=0, parallelism=DDP, acc=0.77, state_mib=30, comm_mib=10, step_s=1.0)
    assert "eval" not in yaml.safe_load((legacy_sdp / "config.yaml").read_text())
    tables = build_tables(find_runs(root))
    assert sorted(t.context["eval.bn"] for t in tables) == ["average", "reestimate"], [t.context for t in tables]
    for t in tables:
        assert len(t.rows) == 1, f"{t.title}: rows evaluated differently share a table"
        assert "eval BN=" in t.title
