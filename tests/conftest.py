"""Shared test helpers: run ``sdp-train`` as a real subprocess (the real Hydra app and launcher) into a
temporary directory and read back the results contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    """A finished ``sdp-train`` process and the directory its results went to."""

    proc: subprocess.CompletedProcess
    run_dir: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def sdp_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["WANDB_MODE"] = "disabled"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_train(run_dir: Path, *overrides: str, timeout: float = 240, check: bool = True, multirun: bool = False) -> Job:
    """``python -m sdp.train`` with ``overrides`` writing into ``run_dir`` (sweep dir for multirun)."""
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    cmd = [sys.executable, "-m", "sdp.train", *(["-m"] if multirun else []), f"{dir_key}={run_dir}",
           "logger.wandb.mode=disabled", "logger.progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=sdp_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"sdp.train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return Job(proc=proc, run_dir=run_dir)


@pytest.fixture
def train_job(tmp_path: Path):
    """Factory fixture: ``train_job("parallelism=ddp", ...)`` runs a job into a fresh tmp dir."""
    counter = iter(range(1000))

    def make(*overrides: str, **kw) -> Job:
        return run_train(tmp_path / f"run{next(counter)}", *overrides, **kw)

    return make



# ---- test tiers ----------------------------------------------------------------------------------
# The multi-rank (``dist``) tests CI runs on every submission: the backbone of each part — equivalence
# of every strategy family with DDP or a single-process reference, SDP's masking and comm accounting,
# fail-fast, resume, the NaN guard, the planner and the multirun report. Every other ``dist`` test is in
# the slow tier (more ranks, more presets of the same property), run with ``pytest --runslow``; on 2
# shared CPU cores the whole multi-rank set takes far longer than a CI run may. An entry without a
# ``[param]`` suffix takes every parametrisation of that test.
CORE_DIST = {
    "tests/test_ddp.py::test_ddp_trains_and_follows_contract[2]",
    "tests/test_ddp.py::test_multirun_jobs_get_distinct_directories",
    "tests/test_ddp.py::test_rank_that_raises_ends_the_job_fast_with_its_traceback",
    "tests/test_ddp.py::test_inside_torchrun_it_does_not_spawn_again",
    "tests/test_sdp_equivalence.py::test_coverage_one_matches_ddp_every_step",
    "tests/test_sdp_equivalence.py::test_assembly_gap_is_zero_when_every_worker_holds_the_whole_model",
    "tests/test_sdp_ranks.py::test_backward_masking_grad_is_mean_over_holders_of_reference[block]",
    "tests/test_sdp_ranks.py::test_forward_masking_skips_prunes_and_narrows[neuron]",
    "tests/test_sdp_ranks.py::test_replicas_identical_after_10_steps[sdp_block_bwd]",
    "tests/test_sdp_ranks.py::test_comm_bytes_equal_analytic_bucket_sum[4-0.5]",
    "tests/test_sdp_redraw.py::test_redraws_keep_holders_identical[block-fwd-sgd]",  # issue 13: re-draws keep
    "tests/test_sdp_redraw.py::test_redraws_keep_holders_identical[neuron-bwd-adamw]",  # holders identical
    "tests/test_fsdp.py::test_fsdp_grads_equal_single_process_reference[fsdp2]",
    "tests/test_fsdp.py::test_fsdp_losses_match_ddp[fsdp2-resnet]",
    "tests/test_pipeline.py::test_stage_grads_equal_unsplit_reference[1f1b]",
    "tests/test_pipeline.py::test_pipeline_losses_match_ddp[gpipe]",
    "tests/test_ddp_ac.py::test_ddp_ac_losses_equal_ddp",
    "tests/test_ddp_drop.py::test_survival_one_is_ddp[ddp_stochastic_depth]",
    "tests/test_reliability.py::test_resume_after_sigkill_is_bit_identical[ddp]",
    "tests/test_reliability.py::test_resume_after_sigkill_is_bit_identical[sdp]",
    "tests/test_reliability.py::test_killed_rank_ends_the_job_fast_naming_the_rank",
    "tests/test_reliability.py::test_nan_loss_stops_the_run_naming_step_and_rank",
    "tests/test_report.py::test_multirun_ends_by_printing_the_table",
    "tests/test_rerun.py::test_committed_run_reruns_bit_for_bit",  # committed results match the code (issue 17)
    "tests/test_plan.py::test_prediction_matches_measurement",  # every strategy (~5 s each): a done-when of issue 5
    "tests/test_plugin_strategy.py::test_a_strategy_defined_outside_sdp_trains_plans_reports_and_is_flop_matched",  # ~24 s: done-when of issue 15
    "tests/test_data_train.py::test_llama_tiny_trains_on_shards_with_ddp",
    "tests/test_resume_schedule.py::test_changed_schedule_is_refused_naming_the_key[steps]",  # issue 19, part 4
    "tests/test_resume_schedule.py::test_extend_steps_continues_on_the_new_schedule",
    "tests/test_multinode.py::test_two_torchrun_agents_equal_one_node[sdp]",  # issue 19, part 3 (~30 s)
    "tests/test_multinode.py::test_a_node_in_a_world_of_its_own_fails_naming_the_variables",
    "tests/test_precision.py::test_bf16_tracks_fp32_for_every_strategy_and_sdp_c1_equals_ddp",  # ~26 s, 22 runs
    "tests/test_sdp_overlap.py::test_overlap_is_bit_identical_to_blocking_sync[sdp_neuron_bwd]",  # ~16 s, 4 ranks
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the slow tier (every multi-rank test; see CORE_DIST in tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection: every collected test is seen
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ids = {item.nodeid for item in items}
    # Files collected whole (a file picked by node id, ``file.py::test``, shows only part of its tests).
    picked = {Path(a.split("::")[0]).resolve() for a in config.args if "::" in a}
    files = {f for f in (i.split("::")[0] for i in ids) if (config.rootpath / f).resolve() not in picked}
    functions = {i.split("[")[0] for i in ids}
    unknown = sorted(n for n in CORE_DIST if n.split("::")[0] in files and n not in ids | functions)
    if unknown:  # a renamed core test must not silently drop out of CI
        raise pytest.UsageError(f"CORE_DIST names tests that do not exist: {unknown}")
    run_all = config.getoption("--runslow")
    for item in items:
        if "dist" in item.keywords and item.nodeid not in CORE_DIST and item.nodeid.split("[")[0] not in CORE_DIST:
            item.add_marker(pytest.mark.slow)
        if "slow" in item.keywords and not run_all:
            item.add_marker(pytest.mark.skip(reason="slow tier: run with pytest --runslow"))
