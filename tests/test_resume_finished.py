"""Resuming a finished run (issue 35, item 1): the driver sees, before any rank starts, that the checkpoint a
resume names is at ``train.steps``; the run directory is then left byte-identical and the command exits 0 saying
so, and a run that ended without its ``summary.json`` gets one rebuilt from its checkpoint and config, marked as
rebuilt, never one measured by a process that trained nothing (:mod:`sdp.driver.finished`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sdp.errors import ConfigError
from tests.helpers import compose, run_train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

JOB = ["experiment=smoke", "parallelism=ddp", "cluster.world_size=2", "train.steps=6", "train.checkpoint_every=3"]
HYDRA_OWN = (".hydra", "train.log")  # Hydra's record of each invocation (its overrides, its log), not the run's


def files(run_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of the run directory but Hydra's own records."""
    return {p.relative_to(run_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.relative_to(run_dir).parts[0] not in HYDRA_OWN}


@pytest.mark.slow  # slow tier (CI time: ~20-35 s)
def test_a_finished_run_is_left_as_it_is_and_a_missing_summary_is_rebuilt(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_train(run_dir, *JOB)
    before, summary = files(run_dir), first.summary
    assert summary["time"]["step_s_median"] is not None and summary["steps"] == 6, summary["time"]

    # what a requeued Slurm job runs: the same command with train.resume=auto
    again = run_train(run_dir, *JOB, "train.resume=auto")
    assert "is finished (checkpoint step_00000006 at train.steps=6, summary.json complete)" in again.output, again.output[-3000:]
    assert "world:" not in again.output, "no rank may start for a finished run"
    assert files(run_dir) == before, "a finished run's directory must be left byte-identical"

    # stopped between its final checkpoint and its summary: train.skip_done resumes it, the driver rebuilds the summary
    (run_dir / "summary.json").unlink()
    redo = run_train(run_dir, *JOB, "train.skip_done=true")
    assert "had no complete summary.json: rebuilt it" in redo.output, redo.output[-3000:]
    rebuilt = json.loads((run_dir / "summary.json").read_text())
    assert rebuilt["rebuilt"] and "checkpoints/step_00000006" in rebuilt["rebuilt"], rebuilt["rebuilt"]
    same = ("strategy", "label", "coverage", "model", "dataset", "world_size", "steps", "skipped_steps", "global_batch",
            "seed", "precision", "final", "eval_protocol", "budget", "run_dir")
    assert {k: rebuilt[k] for k in same} == {k: summary[k] for k in same}, (rebuilt, summary)
    assert rebuilt["memory"]["per_rank"] == [] and rebuilt["time"].get("step_s_median") is None, \
        "what only the ranks measured is absent, not made up"
    assert "note: rebuilt by the driver" in redo.output and "step_s_median=n/a" in redo.output, redo.output[-3000:]
    done = files(run_dir)
    assert {k: v for k, v in done.items() if k != "summary.json"} == {k: v for k, v in before.items() if k != "summary.json"}

    # the rebuilt summary is complete: the sweep skips the job from now on, changing nothing
    skip = run_train(run_dir, *JOB, "train.skip_done=true")
    assert "is complete (summary.json, same config): skipped" in skip.output, skip.output[-3000:]
    assert files(run_dir) == done

    # a finished checkpoint of another run directory: nothing to train, refused before any rank starts
    from sdp.driver.train import run

    with pytest.raises(ConfigError, match=r"train.resume=.* is invalid: .*step_00000006 is at step 6, train.steps=6: "
                                          r"nothing is left to train"):
        run(compose([*JOB, f"train.resume={run_dir}"]), run_dir=tmp_path / "other")
