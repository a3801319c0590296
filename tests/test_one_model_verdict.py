"""Issue 39's verdict lines (sdp/bench/one_model.py: OneModel.misses, one_model_section): met, or each part of the
target missed with its figure, and whether more seeds could meet it; on tests/test_one_model.py's copies of the
committed lm_text runs with known remedy losses and phase peaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdp.bench.one_model import FIXED, OneModel, one_model_section
from sdp.bench.study_report import Study
from sdp.report.stats import Paired, seeds_needed, t_half_width
from tests.test_one_model import CONS10, _study


def test_verdict_met_or_which_part_missed(tmp_path: Path) -> None:
    one = OneModel(study=Study(study_dir=_study(tmp_path), study="lm"))
    assert one.misses("consolidate f=0.2") == []
    assert one.misses("consolidate f=0.1") == [f"quality: upper 95 % end +{0.06 + t_half_width(list(CONS10)):.3f} > +0.03 "
                                               "nats (its mean is above it: at that mean no number of seeds would meet it)"]
    assert one.misses("calibrate 50 steps") == ["calibration peak 0.650x > 0.60x DDP's"], one.misses("calibrate 50 steps")
    assert one.misses(FIXED)[0].startswith("quality: upper 95 % end +0.3"), one.misses(FIXED)
    lines = one_model_section(study=one.st)
    text = "\n".join(lines)
    assert lines[0] == "## One model at DDP's quality (issue 39)"
    assert "- consolidate f=0.2: target met" in text and "**Verdict: target met** by consolidate f=0.2." in text, text
    assert "- calibrate 50 steps: not met (calibration peak 0.650x > 0.60x DDP's)" in text, text
    assert (one.st.dir / "one_model.csv").exists()


def test_a_miss_says_how_many_seeds_would_meet_the_target_if_the_mean_held(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    one = OneModel(study=Study(study_dir=_study(tmp_path), study="lm"))  # seeds_needed: tests/test_report_stats.py
    monkeypatch.setattr(one, "paired", lambda name: Paired(0.01, 0.05, 5))
    assert one.misses("consolidate f=0.2") == [f"quality: upper 95 % end +0.060 > +0.03 nats ("
                                               f"{seeds_needed(Paired(0.01, 0.05, 5), 0.02)} seeds would at the observed "
                                               "spread, if the mean held)"], one.misses("consolidate f=0.2")


def test_not_met_when_a_phase_did_not_run_inside_its_peak_run(tmp_path: Path) -> None:
    study = _study(tmp_path)
    path = study / "runs" / "onemodel" / "peaks" / "cons" / "0" / "summary.json"
    summary = json.loads(path.read_text())  # the switch fell after the run's last step: no consolidation peak
    for r in summary["memory"]["per_rank"]:
        del r["consolidate_peak_bytes"]
    path.write_text(json.dumps(summary))
    one = OneModel(study=Study(study_dir=study, study="lm"))
    assert one.misses("consolidate f=0.2") == ["consolidation peak not measured"], one.misses("consolidate f=0.2")
    assert "**Verdict: not met** by any of the 3 remedies run." in "\n".join(one_model_section(study=one.st))
