"""The training loop, identical for every strategy.

The trainer owns what all strategies share: data order (step-indexed global batches), the LR
schedule, logging, evaluation of the full model on the sharded validation set, and measurement
(phase timer, comm counter windows, memory). Everything strategy-specific happens behind
:class:`sdp.parallel.base.Strategy`; no strategy is ever named here.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig

from sdp.rank import checkpoint, evaluation, guards, hostmem
from sdp.data.base import DataBundle, GlobalBatchSampler, train_batches
from sdp.rank.device_batches import device_batches
from sdp.rank.faults import Faults
from sdp.rank.schedule import Cadence, lr_lambda
from sdp.results.evalresult import EvalResult
from sdp.results.loggers import Logger, ProgressBar
from sdp.rank.eval_ops import world_sum
from sdp.core.loss import loss_fn
from sdp.metrics.activations import measure_saved_tensors
from sdp.metrics.memory import PeakTracker
from sdp.metrics.timing import PhaseTimer
from sdp.parallel.base import StepResult, Strategy


def global_batch_size(cfg: DictConfig) -> int:
    """Samples per step, for every strategy: ``train.batch_size`` x ``cluster.world_size``."""
    return int(cfg.train.batch_size) * int(cfg.cluster.world_size)


@dataclass(frozen=True)
class StepDone:
    """What a finished step leaves for the decisions after it: its metrics row's figures and the guard's
    verdict (``problem``: None, or the message naming the step and the ranks that saw a non-finite value)."""

    n: int
    loss: float
    lr: float
    step_s: float
    problem: str | None


@dataclass
class TrainState:
    """What the loop produced; the worker turns it into summary.json."""

    step: int = 0
    last_loss: float | None = None
    last_eval: dict[str, Any] = field(default_factory=dict)
    """The last evaluation's metrics row (its step and :meth:`EvalResult.row`): plain, as a checkpoint keeps it."""
    samples_seen: int = 0
    skipped_steps: int = 0


class Trainer:
    """Runs ``train.steps`` steps of ``strategy`` on ``data``; logs rank 0 only.

    Reliability hooks, one call site each: ``train.resume`` is loaded at the end of ``__init__``
    (:mod:`sdp.rank.checkpoint`), every step runs inside :func:`sdp.rank.guards.naming_step` with the
    :class:`~sdp.rank.guards.NumericsGuard` check, ``train.debug`` faults fire before a step
    (:mod:`sdp.rank.faults`), and checkpoints are written after a step's logging and evaluation."""

    def __init__(
        self, *, cfg: DictConfig, strategy: Strategy, data: DataBundle, logger: Logger, timer: PhaseTimer,
        run_dir: Path | None = None, peak: PeakTracker | None = None, budget: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.data = data
        self.logger = logger
        self.timer = timer
        self.ctx = strategy.ctx
        tc = cfg.train
        self.replica, self.replicas = strategy.data_parallel()
        self.global_batch = global_batch_size(cfg)
        self.sampler = GlobalBatchSampler(num_samples=len(data.train), global_batch=self.global_batch, seed=int(cfg.seed))
        assert strategy.optimizer is not None, f"strategy {strategy.name!r} built no optimizer"
        # Before the scheduler: it wraps optimizer.step too, and warns when the step is replaced after it.
        self.guard = guards.NumericsGuard(policy=str(tc.nan_policy), ctx=self.ctx, optimizer=strategy.optimizer)
        oc = cfg.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            strategy.optimizer,
            lr_lambda(
                schedule=str(oc.schedule),
                warmup_steps=int(oc.warmup_steps),
                total_steps=int(tc.steps),
                min_lr_ratio=float(oc.min_lr_ratio),
            ),
        )
        self.state = TrainState()
        self.cadence = Cadence.of(train=tc, budget=budget)  # budget: the driver's
        self.run_dir = run_dir
        self.peak = peak
        self.activation_bytes: int | None = None  # saved for backward in the first measured step
        self.tokens_per_sample: int | None = None  # LM: targets per sequence; None for classification
        self.faults = Faults(debug=tc.get("debug"), rank=self.ctx.rank)
        if peak is not None:
            peak.watch(lambda: (strategy.module, strategy.optimizer))  # labels CPU peaks by category
        if tc.get("resume"):
            if peak is not None:
                peak.set_phase("resume")  # loading is not the run's set-up (that was measured before the checkpoint)
            saved, record = checkpoint.load(path=Path(str(tc.resume)), strategy=strategy, scheduler=self.scheduler,
                                            data_key=self.data_key())
            self.state = TrainState(**saved)
            self.guard.skipped_steps = self.state.skipped_steps
            if record is not None:  # None: a checkpoint from before records were kept (counts since resuming)
                self._adopt(record)

    def record(self) -> dict[str, Any]:
        """What this rank has measured so far, kept in each checkpoint (:func:`sdp.rank.checkpoint.save`) so that
        a resumed run's summary counts the whole run, as the uninterrupted run's does: comm records (train and
        outside), memory peaks (re-draw peaks included), the bytes saved for backward."""
        return {"comm": self.ctx.comm.state_dict(), "memory": self.peak.state_dict() if self.peak is not None else None,
                "activation_bytes": self.activation_bytes}

    def _adopt(self, record: dict[str, Any]) -> None:
        self.ctx.comm.adopt(record["comm"])
        if self.peak is not None and record["memory"] is not None:
            self.peak.adopt(record["memory"])
        self.activation_bytes = record["activation_bytes"]  # None: the checkpoint came before the first measured step

    def data_key(self) -> dict[str, Any]:
        """What the data order depends on besides the step (see :mod:`sdp.rank.checkpoint`)."""
        return {"seed": int(self.cfg.seed), "global_batch": self.global_batch, "num_samples": self.sampler.num_samples}

    # ---- loop -----------------------------------------------------------------------------------
    def fit(self) -> TrainState:
        """Steps from ``state.step`` (0, or the resumed step) to ``train.steps``. Each step reads as what
        happens in it, in order; whether to log, evaluate or checkpoint after it is :class:`Cadence`'s call,
        whether to stop the guard's, whether a fault fires the :class:`Faults`'."""
        tc = self.cfg.train
        steps, warmup = self.cadence.steps, int(tc.warmup_steps)
        bar = ProgressBar(total=steps, enabled=self.ctx.rank == 0 and bool(self.cfg.logger.progress))
        batches = device_batches(train_batches(
            self.data, sampler=self.sampler, start=self.state.step, stop=steps,
            replica=self.replica, replicas=self.replicas, num_workers=int(tc.num_workers),
        ), device=self.ctx.device, peak=self.peak)
        if self.ctx.device.type == "cpu":
            hostmem.retain_freed_memory()  # steps reuse freed activation pages instead of faulting them in anew
        if self.peak is not None:
            self.peak.set_phase("warmup")  # the set-up peak ends where the first step begins
        first_measured = max(warmup, self.state.step)  # counts activations, starts the train peak (``_step``)
        try:
            for step in range(self.state.step, steps):
                n = step + 1  # 1-based, as in metrics rows, messages and train.debug.fault_step
                self.faults.before_step(n)
                with guards.naming_step(step=n, rank=self.ctx.rank, timeout_s=float(self.cfg.cluster.timeout_s)):
                    self.ctx.comm.measuring = step >= warmup
                    self.timer.start_step()
                    inputs, targets = self._batch(batches=batches)
                    result = self._step(inputs=inputs, targets=targets, loss=self.faults.loss_fn(loss_fn, n), step=step,
                                        measured=step == first_measured)
                    done = self._account(n=n, result=result)
                    if self.cadence.logs(n, problem=done.problem):
                        self._log(done=done, bar=bar)
                    self.guard.stop_if(problem=done.problem)
                    if n == steps and self.strategy.post_training_steps():
                        self._post_training(steps=steps)
                    if self.cadence.evaluates(n):
                        with self._memory_phase("eval"):
                            self.evaluate()
                    if self.run_dir is not None and self.cadence.checkpoints(n):
                        self._checkpoint(run_dir=self.run_dir)
        finally:
            bar.close()
        return self.state

    def _post_training(self, *, steps: int) -> None:
        """The strategy's phase after the last step (:meth:`~sdp.parallel.base.Strategy.post_training`) on fresh training
        samples: the global batches of the steps after the run's last, this rank's shard as a step reads it."""
        count = self.strategy.post_training_steps()
        batches = device_batches(train_batches(
            self.data, sampler=self.sampler, start=steps, stop=steps + count, replica=self.replica, replicas=self.replicas,
            num_workers=int(self.cfg.train.num_workers)), device=self.ctx.device, peak=self.peak)
        for row in self.strategy.post_training(batches=batches, loss_fn=loss_fn):
            self.logger.log({"step": steps, **row})

    def _batch(self, *, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (inputs, targets) on this rank's device (:func:`device_batches`), timed as the ``data`` phase."""
        with self.timer.phase("data"):
            return next(batches)

    def _account(self, *, n: int, result: StepResult) -> StepDone:
        """Closes step ``n``: LR schedule, step timer, comm window, the guard's global loss and numerics check
        (one all-reduce, measurement traffic), then the state a checkpoint saves."""
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        step_s = self.timer.end_step()
        self.ctx.comm.end_step()
        loss, problem = self.guard.check(step=n, result=result)
        self.state.step = n
        self.state.samples_seen += self.global_batch
        self.state.skipped_steps = self.guard.skipped_steps
        return StepDone(n=n, loss=loss, lr=lr, step_s=step_s, problem=problem)

    def _log(self, *, done: StepDone, bar: ProgressBar) -> None:
        """Step ``done.n``'s metrics row (with ``nonfinite`` where the guard flagged it) and the progress bar."""
        self.state.last_loss = done.loss
        row = {"step": done.n, "loss": done.loss, "lr": done.lr, "samples_per_s": self.global_batch / done.step_s,
               "step_s": done.step_s}
        self.logger.log({**row, "nonfinite": done.problem} if done.problem else row)
        bar.update(done.n, loss=done.loss, samples_per_s=self.global_batch / done.step_s)

    def _memory_phase(self, name: str) -> AbstractContextManager[None]:
        """The peak tracker's phase ``name`` around a block (nothing without a tracker)."""
        return self.peak.phase(name) if self.peak is not None else nullcontext()

    def _checkpoint(self, *, run_dir: Path) -> None:
        """The state after ``state.step`` under ``run_dir``; what it holds and keeps is
        :func:`sdp.rank.checkpoint.save`'s call."""
        tc = self.cfg.train
        checkpoint.save(run_dir=run_dir, step=self.state.step, strategy=self.strategy, scheduler=self.scheduler,
                        train_state=asdict(self.state), data_key=self.data_key(), keep=int(tc.checkpoint_keep),
                        resume_key=checkpoint.resume_key(self.cfg), timeout_s=float(checkpoint.io_timeout_s(self.cfg)),
                        record=self.record())

    def _step(self, *, inputs: torch.Tensor, targets: torch.Tensor, loss: Any, step: int, measured: bool) -> Any:
        """One strategy step; the first measured step also counts the bytes saved for backward (one
        meter around every strategy's step, so activations are measured the same way for all) and
        starts the ``train`` memory phase, so its peak covers the measured steps only (evaluations are
        their own phase)."""
        if not measured:
            return self.strategy.train_step(inputs=inputs, targets=targets, loss_fn=loss, timer=self.timer, step=step)
        if self.peak is not None:
            self.peak.start_measuring()
        if targets.dim() > 1:
            self.tokens_per_sample = int(targets[0].numel())
        with measure_saved_tensors(exclude=list(self.strategy.module.parameters())) as meter:  # type: ignore[union-attr]
            result = self.strategy.train_step(inputs=inputs, targets=targets, loss_fn=loss, timer=self.timer, step=step)
        if self.activation_bytes is None:  # a resumed run keeps the one its first measured step counted
            self.activation_bytes = meter.bytes
        return result

    # ---- evaluation -----------------------------------------------------------------------------
    def calibration(self, *, every_replica: bool) -> list[Callable[[], Iterator[torch.Tensor]]]:
        """The BatchNorm calibration set of the evaluation at this step (``eval.bn=reestimate``): the
        global batches of :func:`sdp.rank.evaluation.calibration_steps` at this evaluation point's fraction of
        the budget, the same samples for every strategy. One callable per replica shard (this rank's
        replica, or ``every_replica``: all of them, in replica order), each regenerating the shard's
        inputs from the step-indexed sampler: nothing is cached, and a resumed run calibrates alike."""
        steps = evaluation.calibration_steps(fraction=self.cadence.fraction(self.state.step),
                                             reference_steps=self.cadence.reference_steps,
                                             count=int(self.cfg.eval.bn_batches))
        return [partial(self._inputs, steps=steps, replica=r)
                for r in (range(self.replicas) if every_replica else (self.replica,))]

    def _inputs(self, *, steps: range, replica: int) -> Iterator[torch.Tensor]:
        for x, _ in device_batches(train_batches(self.data, sampler=self.sampler, start=steps.start, stop=steps.stop,
                                                 replica=replica, replicas=self.replicas,
                                                 num_workers=int(self.cfg.train.num_workers)),
                                   device=self.ctx.device, peak=self.peak):
            yield x

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """Full model on the whole validation set, sharded over ranks, summed over the world, under the
        one evaluation protocol of every strategy (:mod:`sdp.rank.evaluation`); where the strategy has
        workers' own subnetworks, with ``eval.subnetworks`` each of them on the whole set, calibrated and
        batched as the full model is, and with ``eval.ensemble`` their ensemble, in the same pass
        (:func:`sdp.rank.evaluation.own_totals`). Sums stay on the device until one read at the end, which
        :func:`sdp.rank.evaluation.result` turns into the figures; ``state.last_eval`` keeps them as the metrics row."""
        ec, ctx, tc = self.cfg.eval, self.ctx, self.cfg.train
        bn = str(ec.bn)
        common = dict(bn=bn, ctx=ctx, data=self.data, batch_size=int(tc.eval_batch_size), num_workers=int(tc.num_workers))
        # evaluation forwards in the run's precision, as training's: one protocol for every strategy (FSDP2's
        # bf16 policy unshards bf16 parameters, which a float32 input outside autocast cannot meet)
        with self.strategy.eval_module() as full, self.strategy.autocast():
            mine = evaluation.totals(full, bn_batches=self.calibration(every_replica=False)[0], rank=ctx.rank,
                                     world_size=ctx.world_size, part_batches=int(evaluation.part_batches(self.cfg)), **common)
        with ctx.comm.phase_as("eval"):  # the sums' gathers are evaluation traffic, not the step's
            figures = {"full": world_sum(mine, ctx=ctx)}
        workers, ensemble = bool(ec.subnetworks), bool(evaluation.ensemble(self.cfg))
        if workers or ensemble:
            with self.strategy.subnetwork_module() as own:
                if own is not None:  # the same answer on every rank: the strategy decides
                    with self.strategy.autocast():
                        t, ens = evaluation.own_totals(own, calibration=self.calibration(every_replica=True),
                                                       world_size=ctx.world_size, ensemble=ensemble, **common)
                    if workers:
                        with ctx.comm.phase_as("eval"):
                            figures["workers"] = world_sum(evaluation.worker_figures(t), ctx=ctx) / ctx.world_size
                    if ens is not None:  # the same totals on every rank
                        figures["ensemble"] = torch.stack([ens[0] / ens[2], ens[1] / ens[2]])
        flat = iter(torch.cat(list(figures.values())).tolist())  # the one read of the evaluation
        values = {name: [next(flat) for _ in range(len(t))] for name, t in figures.items()}
        result = evaluation.result(values=values, classify=self.data.task == "classification",
                                   groups=self.data.eval_groups)
        row = {"step": self.state.step, **result.row()}
        self.state.last_eval = row
        self.logger.log(row)
        return result
