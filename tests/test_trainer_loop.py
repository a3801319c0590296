"""The trainer's loop in one process, around a stand-in strategy (no process group): after each step it logs,
then the guard may stop the run, then it evaluates (in the ``eval`` memory phase), then it checkpoints, at
the steps :class:`sdp.rank.schedule.Cadence` names. Evaluation and the checkpoint writer are recorded, not
run: what they do is tested in their own files; here it is when and in which order they are called."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from sdp.metrics.timing import PhaseTimer
from sdp.parallel import DistContext
from sdp.parallel.base import StepResult
from sdp.rank import guards
from sdp.registry import build
from tests.helpers import compose


class Recorder:
    """The logger and the peak tracker of the run, writing one event list."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.current = "setup"

    def log(self, row: dict[str, Any]) -> None:
        self.events.append(("log", row["step"], "nonfinite" in row))

    def watch(self, models: Any) -> None:
        pass

    def set_phase(self, name: str) -> None:
        self.current = name

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        prev, self.current = self.current, name
        try:
            yield
        finally:
            self.current = prev

    def start_measuring(self) -> None:
        self.current = "train"

    @contextmanager
    def host_side(self) -> Iterator[None]:
        """The batch's host work (sdp.rank.device_batches): nothing to record."""
        yield

    def on_device(self, tensors: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """The peak tracker's record a checkpoint keeps (``Trainer.record``): nothing to keep in this stand-in."""
        return {}


def fit(overrides: list[str], *, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[list[tuple[Any, ...]], Any]:
    """Runs ``fit`` on digits with a linear model; the events in order, and the final state (or the error)."""
    from sdp.rank import checkpoint
    from sdp.rank.trainer import Trainer

    cfg = compose(["model=mlp", "dataset=digits", "train.batch_size=4", "cluster.world_size=1", *overrides])
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    data = build(cfg.dataset)
    torch.manual_seed(0)
    module = nn.Linear(data.train[0][0].numel(), 10)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def train_step(*, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any, timer: Any, step: int) -> StepResult:
        loss = loss_fn(module(inputs.float().flatten(1)), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return StepResult(loss_sum=loss.detach() * inputs.shape[0], count=int(inputs.shape[0]))

    rec = Recorder()
    monkeypatch.setattr(checkpoint, "save", lambda **kw: rec.events.append(("save", kw["step"], kw["train_state"]["step"])))
    strategy = SimpleNamespace(ctx=ctx, module=module, optimizer=opt, data_parallel=lambda: (0, 1), name="stand-in",
                               train_step=train_step, post_training_steps=lambda: 0)
    trainer = Trainer(cfg=cfg, strategy=strategy, data=data, logger=rec, timer=PhaseTimer(device=ctx.device),  # type: ignore[arg-type]
                      peak=rec, run_dir=tmp_path)  # type: ignore[arg-type]
    monkeypatch.setattr(trainer, "evaluate", lambda: rec.events.append(("evaluate", trainer.state.step, rec.current)))
    try:
        return rec.events, trainer.fit()
    except guards.NonFiniteError as e:
        return rec.events, e


def test_logs_evaluates_and_checkpoints_at_the_cadences_steps_in_that_order(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    events, state = fit(["train.steps=7", "train.log_every=3", "train.eval_every=2", "train.checkpoint_every=3"],
                        monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert events == [("evaluate", 2, "eval"), ("log", 3, False), ("save", 3, 3), ("evaluate", 4, "eval"),
                      ("log", 6, False), ("evaluate", 6, "eval"), ("save", 6, 6),
                      ("log", 7, False), ("evaluate", 7, "eval"), ("save", 7, 7)], events
    assert (state.step, state.samples_seen) == (7, 28), state


def test_a_nonfinite_step_is_logged_then_stops_the_run_before_its_checkpoint(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    fault = ["train.debug.fault=nan_loss", "train.debug.fault_step=4", "train.debug.fault_rank=0", "train.steps=6",
             "train.log_every=5", "train.checkpoint_every=2", "train.eval_every=4"]
    events, err = fit(fault, monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert isinstance(err, guards.NonFiniteError) and str(err).startswith("step 4: non-finite loss"), err
    assert events == [("save", 2, 2), ("log", 4, True)], f"logged, then stopped: no evaluation, no checkpoint: {events}"
    events, state = fit([*fault, "train.nan_policy=skip"], monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert events == [("save", 2, 2), ("log", 4, True), ("evaluate", 4, "eval"), ("save", 4, 4), ("log", 5, False),
                      ("log", 6, False), ("evaluate", 6, "eval"), ("save", 6, 6)], events
    assert state.skipped_steps == 1, state


def test_activations_are_counted_in_the_first_measured_step_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The saved-tensor meter wraps one step, the first after ``train.warmup_steps`` (its hooks would otherwise
    run inside every timed step); ``activation_bytes`` is that step's."""
    from sdp.rank import trainer as trainer_module

    metered: list[int] = []
    real = trainer_module.measure_saved_tensors

    @contextmanager
    def counted(**kw: Any) -> Iterator[Any]:
        with real(**kw) as meter:
            yield meter
        metered.append(meter.bytes)

    monkeypatch.setattr(trainer_module, "measure_saved_tensors", counted)
    fit(["train.steps=6", "train.warmup_steps=2", "train.eval_every=0", "train.checkpoint_every=0"],
        monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert len(metered) == 1 and metered[0] > 0, f"the meter wrapped {len(metered)} steps (bytes {metered}), want 1"
