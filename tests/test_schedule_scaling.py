"""Under ``train.budget=flops`` the schedule keeps its shape (issue 26, item 6): the step-denominated keys
(LR warm-up, evaluation and checkpoint cadence) scale with the steps, so DDP and a FLOP-matched SDP run
reach the peak LR, evaluate and checkpoint at the same fractions of their runs.

Before, only ``train.steps`` scaled: on digits, 4 ranks, ``train.steps=24 optim.warmup_steps=6``, DDP
reached its peak LR 25 % into its run and SDP C = 0.5 (48 steps) 12.5 % into its own, and a fixed
``eval_every`` evaluated SDP twice as often. DDP's schedule (scale 1) and every run whose scaled keys
are 0 are unchanged, so the committed CPU-study runs are still re-used by ``train.skip_done``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from sdp.driver import budget as budgets
from sdp.rank import checkpoint
from sdp.driver import checkpoint_resume
from sdp.driver.rerun import rerun_argv
from sdp.results.contract import scrub
from sdp.driver.sweep import first_difference
from sdp.rank.schedule import eval_steps, lr_lambda
from tests.helpers import REPO, compose, run_job

# The measurement of the issue: digits, 4 ranks, 24 DDP steps with 6 warm-up steps (the default model is
# ResNet-18 CIFAR; the MLP has the same block structure for the budget and builds faster).
BASE = ["model=mlp", "cluster.world_size=4", "train.budget=flops", "train.steps=24", "optim.warmup_steps=6",
        "train.eval_every=6", "train.checkpoint_every=12", "train.eval_points=null"]
STUDY = REPO / "benchmarks" / "results" / "cpu-study"


def resolved(*overrides: str):
    """The config as the driver leaves it after the budget (what config.yaml records), and the budget info."""
    cfg = compose([*BASE, *overrides])
    info = budgets.apply(cfg)
    return cfg, info


def peak_step(cfg) -> int:
    """The first (1-based) step trained at the peak LR."""
    f = lr_lambda(schedule=str(cfg.optim.schedule), warmup_steps=int(cfg.optim.warmup_steps),
                  total_steps=int(cfg.train.steps), min_lr_ratio=float(cfg.optim.min_lr_ratio))
    return next(s + 1 for s in range(int(cfg.train.steps)) if f(s) == 1.0)


def eval_fractions(cfg) -> list[float]:
    steps = int(cfg.train.steps)
    return sorted(s / steps for s in eval_steps(steps=steps, eval_every=int(cfg.train.eval_every), eval_points=None))


def test_ddp_and_sdp_reach_the_peak_lr_and_evaluate_at_the_same_fractions() -> None:
    ddp, _ = resolved("parallelism=ddp")
    sdp, info = resolved("variant=b_sdp_c50")
    assert (int(ddp.train.steps), int(sdp.train.steps)) == (24, 48)
    assert peak_step(ddp) / 24 == peak_step(sdp) / 48 == 0.25, (peak_step(ddp), peak_step(sdp))
    assert eval_fractions(ddp) == eval_fractions(sdp) == [0.25, 0.5, 0.75, 1.0]
    assert (int(sdp.optim.warmup_steps), int(sdp.train.eval_every), int(sdp.train.checkpoint_every)) == (12, 12, 24)
    # what a reader sees: summary.json's budget holds both values, config.yaml the scaled ones
    assert info["schedule"] == {"optim.warmup_steps": {"base": 6, "scaled": 12}, "train.eval_every": {"base": 6, "scaled": 12},
                                "train.checkpoint_every": {"base": 12, "scaled": 24}}


@pytest.mark.parametrize("variant", ["b_sdp_c25", "b_sdp_c75", "sd_c50"])
def test_every_coverage_keeps_ddps_evaluation_count_and_warmup_share(variant: str) -> None:
    ddp, _ = resolved("parallelism=ddp")
    other, info = resolved(f"variant={variant}")
    steps = int(other.train.steps)
    assert steps > 24, info
    assert len(eval_fractions(other)) == len(eval_fractions(ddp)) == 4, (variant, eval_fractions(other))
    for ours, theirs in zip(eval_fractions(other), eval_fractions(ddp)):
        assert abs(ours - theirs) <= 1 / steps + 1e-12, (variant, eval_fractions(other))
    assert abs(peak_step(other) / steps - 0.25) <= 1 / steps, (variant, peak_step(other), steps)


@pytest.mark.parametrize(("steps", "every", "count"), [(500, 50, 10), (40, 4, 9)])
def test_a_measured_ratio_never_adds_an_evaluation(steps: int, every: int, count: int) -> None:
    """flops_ratio=measured gives a ratio with no whole inverse (here 1 / 0.557...): a cadence rounded to the
    nearest step (40 DDP steps every 4 -> 72 steps every 7) would fit an 11th evaluation 2 steps before the
    last; rounded up (every 8) it never fits more than DDP's, at worst one fewer where no whole cadence fits
    DDP's count (10 in 72 steps); train.eval_points places exactly that many."""
    ddp, _ = resolved("parallelism=ddp", "train.flops_ratio=measured", f"train.steps={steps}", f"train.eval_every={every}")
    sdp, info = resolved("variant=b_sdp_c50", "train.flops_ratio=measured", f"train.steps={steps}", f"train.eval_every={every}")
    assert round(1 / info["step_ratio"], 6) != round(1 / info["step_ratio"]), f"want a ratio with no whole inverse: {info}"
    assert len(eval_fractions(ddp)) == 10 and len(eval_fractions(sdp)) == count, eval_fractions(sdp)
    exact, _ = resolved("variant=b_sdp_c50", "train.flops_ratio=measured", f"train.steps={steps}", "train.eval_points=10")
    assert len(eval_steps(steps=int(exact.train.steps), eval_every=0, eval_points=10)) == 10


def test_ddp_and_other_budgets_keep_their_values() -> None:
    for overrides in (["parallelism=ddp"], ["variant=b_sdp_c50", "train.budget=iterations"]):
        cfg, info = resolved(*overrides)
        assert all(v["base"] == v["scaled"] for v in info["schedule"].values()), (overrides, info["schedule"])
        assert int(cfg.optim.warmup_steps) == 6 and int(cfg.train.eval_every) == 6, overrides


def test_zero_stays_zero_and_scaled_values_never_round_to_zero() -> None:
    cfg = compose([*BASE, "variant=b_sdp_c50", "optim.warmup_steps=0", "train.eval_every=0", "train.checkpoint_every=0"])
    assert {k: v["scaled"] for k, v in budgets.scaled_schedule(cfg, step_ratio=0.5).items()} == dict.fromkeys(budgets.SCALED_KEYS, 0)
    cfg = compose([*BASE, "optim.warmup_steps=3", "train.eval_every=1"])
    scaled = budgets.scaled_schedule(cfg, step_ratio=0.3)
    assert scaled["optim.warmup_steps"]["scaled"] == 10, "3 / 0.3 is 10.000000000000002 in floating point, not 11"
    assert budgets.scaled_schedule(cfg, step_ratio=4.0)["train.eval_every"]["scaled"] == 1


def test_resume_and_extend_steps_see_the_scaled_schedule(tmp_path: Path) -> None:
    """A checkpoint records the scaled schedule (sdp.rank.checkpoint.resume_key reads the resolved config): the
    same job resumes; extending train.steps leaves the scaled warm-up as it was (the factor does not depend on
    the base steps), so train.extend_steps still only changes train.steps."""
    short, _ = resolved("variant=b_sdp_c50")
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    from sdp.results.rundir import checkpoint_meta

    checkpoint_meta(ckpt).write_text(json.dumps({"step": 10, checkpoint.RESUME_KEY: checkpoint.resume_key(short)}))
    checkpoint_resume.check_resume(ckpt=ckpt, cfg=short)
    longer, _ = resolved("variant=b_sdp_c50", "train.steps=36", "train.extend_steps=true")
    assert int(longer.optim.warmup_steps) == int(short.optim.warmup_steps) == 12
    checkpoint_resume.check_resume(ckpt=ckpt, cfg=longer)


def test_rerun_puts_the_schedules_base_values_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 48, "budget": "flops"}}))
    schedule = {"optim.warmup_steps": {"base": 6, "scaled": 12}, "train.eval_every": {"base": 0, "scaled": 0}}
    (run / "summary.json").write_text(json.dumps({"budget": {"budget": "flops", "base_steps": 24, "steps": 48, "schedule": schedule}}))
    args = rerun_argv(run_dir=run, out=tmp_path / "again", overrides=[])
    assert {"train.steps=24", "optim.warmup_steps=6", "train.eval_every=0"} <= set(args), args


def committed_runs() -> list[tuple[Path, dict, dict]]:
    out = []
    for cfg_file in sorted(STUDY.rglob("config.yaml")):
        if ".hydra" in cfg_file.parts or not (cfg_file.parent / "summary.json").exists():
            continue
        out.append((cfg_file.parent, yaml.safe_load(cfg_file.read_text()),
                    json.loads((cfg_file.parent / "summary.json").read_text())))
    return out


def test_committed_cpu_study_runs_keep_their_schedule() -> None:
    """Every committed CPU-study run resolves to the schedule it ran with: its scheduled keys as the command gave
    them (summary.json's budget.schedule bases; runs recorded before it: scale 1 or keys at 0) scale to the values
    config.yaml records, so the config skip_done compares is the one config.yaml records."""
    runs = committed_runs()
    extended = [p for p, _, s in runs if (s.get("budget") or {}).get("step_ratio", 1.0) != 1.0]
    assert len(runs) > 100 and len(extended) > 30, (len(runs), len(extended))
    for path, cfg, summary in runs:
        base = OmegaConf.create(cfg)  # the keys as the command gave them: config.yaml records them scaled
        for key, rec in ((summary["budget"].get("schedule")) or {}).items():
            OmegaConf.update(base, key, rec["base"])
        scaled = budgets.scaled_schedule(base, step_ratio=summary["budget"]["step_ratio"])
        for key, values in scaled.items():
            section, leaf = key.split(".")
            assert values["scaled"] == cfg[section][leaf], (path, key, values)


@pytest.mark.parametrize("run", ["image/runs/main/0", "image/runs/main/6", "lm_text/runs/main/6"])  # DDP, B-SDP C = 0.5
def test_committed_study_run_is_still_the_same_job_for_skip_done(run: str) -> None:
    """The driver's whole resolution (budget, scaled keys) of a committed run's own config gives config.yaml back."""
    path = STUDY / run
    then = yaml.safe_load((path / "config.yaml").read_text())
    summary = json.loads((path / "summary.json").read_text())
    cfg = OmegaConf.create(then)
    cfg.train.steps = summary["budget"]["base_steps"]
    budgets.apply(cfg)
    now = scrub(OmegaConf.to_container(cfg, resolve=True))
    assert first_difference(now=now, then=then) is None, (run, first_difference(now=now, then=then))


@pytest.mark.dist  # slow tier: two 2-rank jobs; the unit tests above are the default tier's
@pytest.mark.timeout(300)
def test_logged_lr_peaks_and_evaluations_at_the_same_fractions(tmp_path: Path) -> None:
    common = ["model=mlp", "train.budget=flops", "train.steps=8", "optim.warmup_steps=2", "train.eval_every=2",
              "train.eval_points=null", "train.warmup_steps=1", "optim.schedule=constant"]
    runs = {}
    for name, overrides in (("ddp", ["parallelism=ddp"]), ("sdp", ["parallelism=sdp"])):
        summary, rows = run_job([*common, *overrides], run_dir=tmp_path / name, world=2)
        steps = summary["steps"]
        peak = min(r["step"] for r in rows if "lr" in r and r["lr"] == max(x["lr"] for x in rows if "lr" in x))
        evals = [r["step"] / steps for r in rows if "eval_loss" in r]
        runs[name] = (steps, peak / steps, evals, summary["budget"]["schedule"])
    assert (runs["ddp"][0], runs["sdp"][0]) == (8, 16), runs
    assert runs["ddp"][1] == runs["sdp"][1] == 0.25 and runs["ddp"][2] == runs["sdp"][2] == [0.25, 0.5, 0.75, 1.0], runs
    assert runs["sdp"][3]["optim.warmup_steps"] == {"base": 2, "scaled": 4}, runs
