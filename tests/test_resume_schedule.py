"""A resume refuses a changed LR schedule before any rank starts, naming the key; ``train.extend_steps``
is the explicit way to train on for more steps, with a defined schedule (issue 19, part 4).

Before, resuming a 6-step run with ``train.steps=12`` loaded the old scheduler: the logged LR was 0.0
at step 7 (the end of the 6-step cosine), then jumped to the 12-step cosine value.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sdp.rank.schedule import lr_lambda
from tests.helpers import core_cases, run_train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

BASE = ["experiment=smoke", "parallelism=ddp", "cluster.world_size=2", "train.eval_every=0",
        "train.checkpoint_every=3", "optim.warmup_steps=0"]
PEAK = 0.05  # conf/optim/sgd.yaml optimizer.lr


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step run with checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("six") / "run"
    run_train(run_dir, *BASE, "train.steps=6")
    return run_dir


@pytest.mark.parametrize(("override", "key", "then"), core_cases([
    ("train.steps=12", "train.steps=12", "train.steps=6"),
    ("optim.optimizer.lr=0.1", "optim.optimizer.lr=0.1", "optim.optimizer.lr=0.05"),
    ("optim.schedule=linear", "optim.schedule='linear'", "optim.schedule='cosine'"),
    ("optim.warmup_steps=2", "optim.warmup_steps=2", "optim.warmup_steps=0"),
], ids=["steps", "peak-lr", "schedule", "warmup"], core={"steps"}))  # steps: issue 19, part 4
def test_changed_schedule_is_refused_naming_the_key(six: Path, tmp_path: Path, override: str, key: str, then: str) -> None:
    job = run_train(tmp_path / "r", *BASE, "train.steps=6", override, f"train.resume={six}", check=False)
    assert job.proc.returncode != 0, "a resume with a changed schedule must fail"
    out = job.output
    assert f"{key} is invalid for resuming" in out and then in out, out[-3000:]
    assert not (tmp_path / "r" / "rank_logs").exists(), "refused in the driver: no rank may start"


@pytest.mark.dist  # slow tier (CI time): the refused-schedule case stays in the default tier
def test_extend_steps_continues_on_the_new_schedule(six: Path, tmp_path: Path) -> None:
    job = run_train(tmp_path / "r", *BASE, "train.steps=12", "train.extend_steps=true", f"train.resume={six}")
    assert "resuming from" in job.output and "step_00000006" in job.output
    lrs = {r["step"]: r["lr"] for r in job.metrics if "loss" in r}
    assert sorted(lrs) == list(range(1, 13)), f"each step once, got {sorted(lrs)}"
    old = lr_lambda(schedule="cosine", warmup_steps=0, total_steps=6, min_lr_ratio=0.0)
    new = lr_lambda(schedule="cosine", warmup_steps=0, total_steps=12, min_lr_ratio=0.0)
    assert [lrs[s] for s in range(1, 7)] == [PEAK * old(s - 1) for s in range(1, 7)], "steps 1-6: the 6-step cosine"
    assert [lrs[s] for s in range(7, 13)] == [PEAK * new(s - 1) for s in range(7, 13)], "steps 7-12: the 12-step cosine"
    assert lrs[7] > 0.0, f"step 7 must not train at the old schedule's final LR 0.0: {lrs[7]}"
    # The extended run's checkpoints record the new schedule: resuming it again with train.steps=12 passes the check.
    again = run_train(tmp_path / "r2", *BASE, "train.steps=12", f"train.resume={tmp_path / 'r'}", check=False)
    assert "is invalid for resuming" not in again.output, again.output[-3000:]
