"""Checkpoint internals in one process (fast): state layouts round-trip through ``sdp.rank.checkpoint`` and
training continues exactly as if never stopped; RNG streams survive ``weights_only`` loading; resume
paths resolve; a resumed run's metrics hold each step once.

The ``sharded`` layout is exercised here with the recipe :mod:`sdp.parallel.fsdp` uses (``get_state_dict``
/ ``set_state_dict`` + ``torch.distributed.checkpoint``) on an unsharded model, in one process; every real
strategy (DDP, SDP, FSDP2, pipeline, stochastic depth) resumes end to end in ``test_reliability.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from sdp.rank import checkpoint, rng
from sdp.driver import checkpoint_resume
from sdp.errors import ConfigError
from sdp.metrics.timing import PhaseTimer
from sdp.models.mlp import MLP
from sdp.parallel.base import StepResult, Strategy
from sdp.core.distctx import DistContext
from sdp.parallel.job import JobFacts
from sdp.core.loss import loss_fn

KEY = {"seed": 0, "global_batch": 8, "num_samples": 64}


class Plain(Strategy):
    """One process, no wrapper: the default (DDP-family) checkpoint layout."""

    name = "plain"

    def setup(self, *, model, optimizer_factory) -> None:  # type: ignore[no-untyped-def]
        self.module = model
        self.optimizer = optimizer_factory(model.parameters())

    def train_step(self, *, inputs, targets, loss_fn, timer, step) -> StepResult:  # type: ignore[no-untyped-def]
        loss = loss_fn(self.module(inputs + 0.01 * torch.randn_like(inputs)), targets)  # uses the RNG stream
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return StepResult(loss_sum=loss.detach() * inputs.shape[0], count=inputs.shape[0])


class Sharded(Plain):
    """The FSDP2 recipe: DCP state dicts through get_state_dict / set_state_dict."""

    name = "sharded"

    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"sharded": {"model": model_sd, "optimizer": optim_sd}}

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        set_state_dict(self.module, self.optimizer, model_state_dict=state["sharded"]["model"],
                       optim_state_dict=state["sharded"]["optimizer"])


def make(cls: type[Strategy], seed: int) -> tuple[Strategy, Any]:
    torch.manual_seed(seed)
    s = cls(cfg=None, job=JobFacts(), ctx=DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo"))
    s.setup(model=MLP(num_classes=3, input_shape=(4,), dim=8, hidden=16, depth=2),
            optimizer_factory=lambda p: torch.optim.AdamW(p, lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda k: 1.0 / (k + 1))
    return s, sched


def steps(s: Strategy, sched: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        r = s.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=PhaseTimer(device=torch.device("cpu")), step=0)
        sched.step()
        out.append(float(r.loss_sum))
    return out


@pytest.mark.parametrize("cls", [Plain, Sharded])
def test_save_load_continues_exactly(cls: type[Strategy], tmp_path: Path) -> None:
    a, sa = make(cls, seed=0)
    steps(a, sa, 3)
    checkpoint.save(run_dir=tmp_path, step=3, strategy=a, scheduler=sa, train_state={"step": 3}, data_key=KEY, keep=2)
    expected = steps(a, sa, 3)  # the uninterrupted continuation (RNG stream included)
    b, sb = make(cls, seed=123)  # a different init: everything must come from the checkpoint
    train, record = checkpoint.load(path=checkpoint.step_dir(tmp_path, 3), strategy=b, scheduler=sb, data_key=KEY)
    assert train == {"step": 3} and record is None, (train, record)  # no record given to save: none handed back
    assert steps(b, sb, 3) == expected


def test_refuses_a_different_data_order(tmp_path: Path) -> None:
    a, sa = make(Plain, seed=0)
    checkpoint.save(run_dir=tmp_path, step=1, strategy=a, scheduler=sa, train_state={}, data_key=KEY, keep=0)
    with pytest.raises(ConfigError, match=r"seed=1 is invalid for resuming"):
        checkpoint.load(path=checkpoint.step_dir(tmp_path, 1), strategy=a, scheduler=sa, data_key={**KEY, "seed": 1})


def test_rng_streams_survive_weights_only(tmp_path: Path) -> None:
    rng.seed_rank_streams(7)
    torch.save(rng.capture(device=torch.device("cpu")), tmp_path / "rng.pt")
    first = (torch.rand(3).tolist(), random.random(), np.random.rand())
    rng.seed_rank_streams(99)
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True), device=torch.device("cpu"))
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == first


def test_resolve_and_retention(tmp_path: Path) -> None:
    a, sa = make(Plain, seed=0)
    assert checkpoint_resume.resolve(resume="auto", run_dir=tmp_path) is None  # auto with nothing: fresh start
    for k in (2, 4, 6):
        checkpoint.save(run_dir=tmp_path, step=k, strategy=a, scheduler=sa, train_state={}, data_key=KEY, keep=2)
    (tmp_path / "checkpoints" / "step_00000008.tmp").mkdir()  # a crash mid-write is never picked
    assert [k for k, _ in checkpoint.checkpoints(tmp_path)] == [4, 6]  # keep=2
    assert checkpoint_resume.resolve(resume="auto", run_dir=tmp_path).name == "step_00000006"
    assert checkpoint_resume.resolve(resume=str(tmp_path), run_dir=None).name == "step_00000006"
    assert checkpoint_resume.resolve(resume=str(tmp_path / "checkpoints" / "step_00000004"), run_dir=None).name == "step_00000004"
    assert checkpoint_resume.resolve(resume=None, run_dir=tmp_path) is None
    with pytest.raises(ConfigError, match="does not exist"):
        checkpoint_resume.resolve(resume=str(tmp_path / "nope"), run_dir=None)


def test_prepare_run_dir_keeps_each_step_once(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    a, sa = make(Plain, seed=0)
    for k in (3, 6):
        checkpoint.save(run_dir=old, step=k, strategy=a, scheduler=sa, train_state={}, data_key=KEY, keep=0)
    lines = [json.dumps({"step": k, "loss": float(k)}) for k in range(1, 8)] + ['{"step": 8, "lo']  # killed mid-line
    (old / "metrics.jsonl").write_text("\n".join(lines))
    # Into a new run directory: the rows up to the checkpoint are copied.
    assert checkpoint_resume.prepare_run_dir(ckpt=checkpoint.step_dir(old, 3), run_dir=new) == 3
    assert [json.loads(x)["step"] for x in (new / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    # In place: later rows and the now-stale later checkpoint go.
    assert checkpoint_resume.prepare_run_dir(ckpt=checkpoint.step_dir(old, 3), run_dir=old) == 3
    assert [json.loads(x)["step"] for x in (old / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [k for k, _ in checkpoint.checkpoints(old)] == [3]
