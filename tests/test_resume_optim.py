"""A resume whose optimizer or model hyper-parameters differ from the checkpoint's is refused before any
rank starts, naming the first key that differs (issue 26, item 5).

Before, only the LR schedule was compared: resuming with ``optim.optimizer.weight_decay=0.5
optim.optimizer.momentum=0.5 train.extend_steps=true`` wrote the new values into ``config.yaml`` and then
trained with the checkpoint's (``optimizer.load_state_dict`` restores ``param_groups``), logging exactly
the losses of the unchanged resume. The keys that must match are :data:`sdp.rank.checkpoint.RESUME_KEYS`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdp.rank import checkpoint
from sdp.driver import checkpoint_resume
from sdp.errors import ConfigError
from sdp.results.rundir import checkpoint_meta
from tests.helpers import compose, run_job

pytestmark = pytest.mark.timeout(300)

BASE = ["experiment=smoke", "parallelism=ddp", "cluster.world_size=2", "train.eval_every=0"]
EXTEND = ["train.steps=12", "train.extend_steps=true"]  # the one allowed change, so the optimizer is what differs


def written_with(tmp_path: Path, overrides: list[str], *, legacy: bool = False) -> Path:
    """A checkpoint directory at step 6 whose meta.json records the config of ``overrides`` (what
    :func:`sdp.rank.checkpoint.save` records); ``legacy``: as written before the optimizer and model were
    recorded (the schedule's keys only, under ``schedule``)."""
    key = checkpoint.resume_key(compose([*BASE, "train.steps=6", *overrides]))
    if legacy:
        key = {k: v for k, v in key.items()
               if not k.startswith(("model.", "optim.optimizer.")) or k == "optim.optimizer.lr"}
    ckpt = checkpoint.step_dir(tmp_path, 6)
    ckpt.mkdir(parents=True)
    meta = {"step": 6, "world_size": 2, "strategy": "ddp", "data_key": {},
            ("schedule" if legacy else "resume_key"): key}
    checkpoint_meta(ckpt).write_text(json.dumps(meta))
    return ckpt


@pytest.mark.parametrize(("base", "change", "named"), [
    ([], ["optim.optimizer.weight_decay=0.5", "optim.optimizer.momentum=0.5"],  # the command line
     "optim.optimizer.momentum=0.5 is invalid for resuming .* written with optim.optimizer.momentum=0.9"),
    ([], ["optim.optimizer.weight_decay=0.5"],
     "optim.optimizer.weight_decay=0.5 .* with optim.optimizer.weight_decay=0.0005"),
    ([], ["~optim.optimizer.nesterov"], "optim.optimizer.nesterov='<absent>' .* with optim.optimizer.nesterov=True"),
    (["optim=adamw"], ["optim.optimizer.betas=[0.9,0.99]"],
     r"optim.optimizer.betas=\[0.9, 0.99\] .* with optim.optimizer.betas=\[0.9, 0.95\]"),
    ([], ["model.hidden=128"],
     "model.hidden=128 is invalid for resuming .* with model.hidden=256 and the checkpoint's weights"),
    ([], ["optim.optimizer.lr=0.1"], "optim.optimizer.lr=0.1 .* and the LR schedule depends on it"),
], ids=["issue-command", "weight-decay", "key-removed", "adamw-betas", "model", "peak-lr"])
def test_changed_hyper_parameter_is_refused_naming_it(tmp_path: Path, base: list[str], change: list[str],
                                                      named: str) -> None:
    ckpt = written_with(tmp_path, base)
    with pytest.raises(ConfigError, match=named):
        checkpoint_resume.check_resume(ckpt=ckpt, cfg=compose([*BASE, *base, *EXTEND, *change]))


def test_unchanged_resume_passes(tmp_path: Path) -> None:
    checkpoint_resume.check_resume(ckpt=written_with(tmp_path, ["optim=adamw"]), cfg=compose([*BASE, "optim=adamw", *EXTEND]))


def test_checkpoint_without_optimizer_record_is_compared_on_what_it_recorded(tmp_path: Path) -> None:
    """Written before this change: the schedule's keys are still compared; the others cannot be."""
    ckpt = written_with(tmp_path, [], legacy=True)
    checkpoint_resume.check_resume(ckpt=ckpt, cfg=compose([*BASE, *EXTEND, "optim.optimizer.momentum=0.5"]))
    with pytest.raises(ConfigError, match="optim.optimizer.lr=0.1 is invalid for resuming"):
        checkpoint_resume.check_resume(ckpt=ckpt, cfg=compose([*BASE, *EXTEND, "optim.optimizer.lr=0.1"]))


@pytest.mark.dist
def test_driver_refuses_before_any_rank_starts(tmp_path: Path) -> None:
    """The issue's case end to end: a real checkpoint, the resume with a changed optimizer refused in the
    driver (no rank_logs), the unchanged one accepted."""
    run_job([*BASE, "train.steps=3", "train.checkpoint_every=3"], run_dir=tmp_path / "first")
    changed = [*BASE, *EXTEND, "optim.optimizer.weight_decay=0.5", "optim.optimizer.momentum=0.5",
               f"train.resume={tmp_path / 'first'}"]
    with pytest.raises(ConfigError, match="optim.optimizer.momentum=0.5 is invalid for resuming"):
        run_job(changed, run_dir=tmp_path / "changed")
    assert not (tmp_path / "changed" / "rank_logs").exists(), "refused in the driver: no rank may start"
    _, rows = run_job([*BASE, *EXTEND, f"train.resume={tmp_path / 'first'}"], run_dir=tmp_path / "same")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))
