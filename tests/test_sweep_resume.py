"""Resumable sweeps (issue 19, part 1): the same ``sdp-train -m ...`` command run again with the same
``hydra.sweep.dir`` and ``train.skip_done=true`` skips finished jobs, resumes interrupted ones from
their checkpoint, starts missing ones, and refuses a directory that holds another config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sdp.driver import sweep
from tests.helpers import run_train

SWEEP = ["parallelism=ddp", "seed=0,1,2", "model=mlp", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
         "train.checkpoint_every=2"]


def curve(run_dir: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r.get("loss"), r.get("lr"), r.get("eval_loss")) for r in rows]


def test_first_difference_names_the_first_key_and_ignores_run_control() -> None:
    then = {"train": {"steps": 4, "resume": None, "debug": {"fault": "kill"}}, "optim": {"optimizer": {"lr": 0.05}}}
    now = {"train": {"steps": 4, "resume": "/x/checkpoints/step_00000002", "debug": {"fault": None}},
           "optim": {"optimizer": {"lr": 0.05}}}
    assert sweep.first_difference(now=now, then=then) is None
    now["optim"]["optimizer"]["lr"] = 0.1
    assert sweep.first_difference(now=now, then=then) == ("optim.optimizer.lr", 0.1, 0.05)
    assert sweep.first_difference(now={**now, "extra": 1}, then={**now}) == ("extra", 1, "<absent>")
    # a key added after the run was recorded, at the value that computes what the run did, is the same job
    added = {**now, "plugins": [], "eval": {"part_batches": 1}}
    assert sweep.first_difference(now=added, then=now) is None
    assert sweep.first_difference(now={**added, "eval": {"part_batches": 3}}, then=now) == ("eval.part_batches", 3, "<absent>")
    # the holder-set cap came after the CPU study's first LM sweep (d566c73): uncapped is what those runs did
    assert sweep.first_difference(now={**now, "parallelism": {"max_holder_sets": None}}, then=now) is None
    assert sweep.first_difference(now={**now, "parallelism": {"max_holder_sets": 4}}, then=now) == (
        "parallelism.max_holder_sets", 4, "<absent>")


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_rerun_of_a_sweep_skips_resumes_starts_and_refuses(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    run_train(root, *SWEEP, multirun=True, timeout=400)
    sweep_record = (root / "multirun.yaml").read_text()
    uninterrupted = curve(root / "1")
    # Job 1 as if killed after step 3 (its step-2 checkpoint survives, no summary); job 2 never ran.
    shutil.rmtree(root / "1" / "checkpoints" / "step_00000004")
    (root / "1" / "summary.json").unlink()
    rows = (root / "1" / "metrics.jsonl").read_text().splitlines()
    (root / "1" / "metrics.jsonl").write_text("\n".join(r for r in rows if json.loads(r)["step"] <= 3) + "\n")
    shutil.rmtree(root / "2")

    again = run_train(root, *SWEEP, "train.skip_done=true", multirun=True, timeout=400)
    out = again.proc.stdout
    assert f"skip_done: {root / '0'} is complete (summary.json, same config): skipped" in out, out[-3000:]
    assert out.count("skip_done:") == 1, "one line per skipped job, nothing for the others"
    assert "resuming from" in out and "step_00000002" in out, out[-3000:]
    assert curve(root / "1") == uninterrupted, "the resumed job logs each step once, exactly as before"
    assert json.loads((root / "2" / "summary.json").read_text())["steps"] == 4, "the missing job ran"
    assert "| DDP | 3 |" in out, f"the multirun-end report covers every job, skipped ones included:\n{out[-3000:]}"
    assert (root / "multirun.yaml").read_text() == sweep_record, "the sweep's first record is kept (SweepRecord)"
    launches = list(root.glob("multirun.launch-*.yaml"))
    assert len(launches) == 1 and "train.skip_done=true" in launches[0].read_text(), launches

    changed = run_train(root, *SWEEP, "optim.optimizer.lr=0.1", "train.skip_done=true", multirun=True, check=False)
    assert changed.proc.returncode != 0
    assert f"optim.optimizer.lr=0.1 is invalid for re-using {root / '0'}" in changed.output, changed.output[-3000:]
    assert "its config.yaml has optim.optimizer.lr=0.05" in changed.output
    assert (root / "multirun.yaml").read_text() == sweep_record, "a launch stopped by a refused job restores it too"
    assert len(list(root.glob("multirun.launch-*.yaml"))) == 2
