"""The LM study's baseline stage (issue 38, item 2; sdp/bench/cpu_study.py): every baseline runs FLOP-matched in
its own sweep, seeds 0-2, and once more in the peak and timing sweeps, appended after the methods already there
(so the committed sweeps' job numbers, which train.skip_done checks, stay as they were); each composes with the
study's experiment and passes the driver's validation before any rank would start."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdp.bench import cpu_study


def _variants(args: list[str]) -> list[str]:
    return next(a for a in args if a.startswith("variant=")).removeprefix("variant=").split(",")


def test_the_baselines_have_a_sweep_and_are_appended_to_the_peak_and_timing_sweeps(tmp_path: Path) -> None:
    got = dict(cpu_study.stages(study="lm", out=tmp_path))
    sweeps = [args for name, args in got.items() if name.startswith("extras-") and
              _variants(args) == cpu_study.LM_BASELINES]
    assert len(sweeps) == 1 and "seed=0,1,2" in sweeps[0], list(got)
    before = [v for v in cpu_study.sweep_variants("cpu_study_lm") if not v.endswith("_iters")] + ["fsdp"]
    for stage in ("peaks", "timing"):
        assert _variants(got[stage]) == before + cpu_study.LM_BASELINES, (stage, got[stage])


@pytest.mark.parametrize("variant", cpu_study.LM_BASELINES)
def test_each_baseline_validates_flop_matched_in_the_lm_study(variant: str) -> None:
    from sdp.driver.config import validate
    from tests.helpers import compose

    cfg = compose(["experiment=cpu_study_lm", f"variant={variant}", "seed=0"])
    assert cfg.train.budget == "flops", cfg.train.budget
    validate(cfg, launching=False)
