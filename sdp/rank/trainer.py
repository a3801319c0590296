"""The training loop, identical for every strategy.

The trainer owns what all strategies share: data order (step-indexed global batches), the LR
schedule, logging, evaluation of the full model on the sharded validation set, and measurement
(phase timer, comm counter windows, memory). Everything strategy-specific happens behind
:class:`sdp.parallel.base.Strategy`; no strategy is ever named here.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig

from sdp.rank import checkpoint, evaluation, guards, hostmem
from sdp.data.base import DataBundle, GlobalBatchSampler, train_batches
from sdp.rank.faults import Faults
from sdp.results.loggers import Logger, ProgressBar
from sdp.rank.loss import loss_fn  # noqa: F401 (re-exported: sdp.rank.trainer.loss_fn is used widely)
from sdp.metrics.activations import measure_saved_tensors
from sdp.metrics.memory import PeakTracker
from sdp.metrics.timing import PhaseTimer
from sdp.parallel.base import Strategy


def global_batch_size(cfg: DictConfig) -> int:
    """Samples per step, for every strategy: ``train.batch_size`` x ``cluster.world_size``."""
    return int(cfg.train.batch_size) * int(cfg.cluster.world_size)


def lr_lambda(*, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Multiplier on the base LR at each step: linear warm-up then constant, cosine or linear decay."""
    allowed = ("constant", "cosine", "linear")
    if schedule not in allowed:
        raise ValueError(f"optim.schedule={schedule!r} not in {allowed}")

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(max(step - warmup_steps, 0) / max(total_steps - warmup_steps, 1), 1.0)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_lr_ratio + (1 - min_lr_ratio) * decay

    return f


def eval_fractions(*, steps: int, eval_every: int, eval_points: int | None,
                   cadence: Fraction | None = None) -> dict[int, Fraction]:
    """The 1-based steps after which the model is evaluated (always including the last), each with its
    fraction of the run's budget (what picks the BatchNorm calibration set, :func:`sdp.rank.evaluation.calibration_steps`).

    ``eval_points`` (when set) places that many evaluations evenly over the run's *resolved* step count, so
    every method of a budget-matched sweep is evaluated at the same fractions of its budget (a FLOP-matched
    SDP run at C = 0.25 runs 4x DDP's steps; a fixed ``eval_every`` would evaluate it 4x as often and cost
    it 4x the evaluation time): point i of N is fraction i / N. Otherwise every ``eval_every`` steps (0:
    only at the end), the k-th at fraction k x ``cadence`` (default ``eval_every / steps``; under a FLOP
    budget DDP's cadence, :func:`budget_clock`: the budget scales ``eval_every`` up to whole steps, and
    the k-th evaluation stands for DDP's k-th), the last at 1."""
    if eval_points is not None:
        points = min(int(eval_points), steps)
        return {-(-i * steps // points): Fraction(i, points) for i in range(1, points + 1)}
    per = cadence if cadence is not None else Fraction(eval_every, steps)
    every = range(eval_every, steps + 1, eval_every) if eval_every > 0 else range(0)
    return {**{s: min(k * per, Fraction(1)) for k, s in enumerate(every, start=1)}, steps: Fraction(1)}


def eval_steps(*, steps: int, eval_every: int, eval_points: int | None) -> frozenset[int]:
    """The 1-based steps after which the model is evaluated (:func:`eval_fractions`)."""
    return frozenset(eval_fractions(steps=steps, eval_every=eval_every, eval_points=eval_points))


def budget_clock(*, budget: dict[str, Any] | None, steps: int) -> tuple[int, Fraction | None]:
    """(reference steps, cadence) that place an evaluation within the budget for calibration: under
    ``train.budget=flops``, where methods run different step counts, DDP's step count (the budget's
    ``base_steps``) and, where the budget scaled ``train.eval_every``, DDP's cadence as a fraction of it;
    otherwise the run's own steps (every method runs the same) and None. ``budget``: the driver's
    resolution (:mod:`sdp.planning.budget`)."""
    if budget is None or budget.get("budget") != "flops":
        return steps, None
    base = int(budget["base_steps"])
    every = ((budget.get("schedule") or {}).get("train.eval_every") or {}).get("base")
    return base, Fraction(int(every), base) if every else None


@dataclass
class TrainState:
    """What the loop produced; the worker turns it into summary.json."""

    step: int = 0
    last_loss: float | None = None
    last_eval: dict[str, Any] = field(default_factory=dict)
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
        self.reference_steps, cadence = budget_clock(budget=budget, steps=int(tc.steps))  # budget: the driver's
        self.eval_at = eval_fractions(steps=int(tc.steps), eval_every=int(tc.eval_every), eval_points=tc.get("eval_points"),
                                      cadence=cadence)
        self.run_dir = run_dir
        self.peak = peak
        self.activation_bytes: int | None = None  # saved for backward in the first measured step
        self.tokens_per_sample: int | None = None  # LM: targets per sequence; None for classification
        self.faults = Faults(debug=tc.get("debug"), rank=self.ctx.rank)
        if peak is not None:
            peak.watch(lambda: (strategy.module, strategy.optimizer))  # labels CPU peaks by category
        if tc.get("resume"):
            saved = checkpoint.load(path=Path(str(tc.resume)), strategy=strategy, scheduler=self.scheduler,
                                    data_key=self.data_key())
            self.state = TrainState(**saved)
            self.guard.skipped_steps = self.state.skipped_steps

    def data_key(self) -> dict[str, Any]:
        """What the data order depends on besides the step (see :mod:`sdp.rank.checkpoint`)."""
        return {"seed": int(self.cfg.seed), "global_batch": self.global_batch, "num_samples": self.sampler.num_samples}

    # ---- loop -----------------------------------------------------------------------------------
    def fit(self) -> TrainState:
        tc = self.cfg.train
        steps, warmup = int(tc.steps), int(tc.warmup_steps)
        log_every = int(tc.log_every)
        eval_at = self.eval_at
        bar = ProgressBar(total=steps, enabled=self.ctx.rank == 0 and bool(self.cfg.logger.progress))
        batches = train_batches(
            self.data, sampler=self.sampler, start=self.state.step, stop=steps,
            replica=self.replica, replicas=self.replicas, num_workers=int(tc.num_workers),
        )
        comm = self.ctx.comm
        ckpt_every = int(tc.checkpoint_every)
        if self.ctx.device.type == "cpu":
            hostmem.retain_freed_memory()  # steps reuse freed activation pages instead of faulting them in anew
        if self.peak is not None:
            self.peak.set_phase("warmup")  # the set-up peak ends where the first step begins
        try:
            for step in range(self.state.step, steps):
                n = step + 1  # 1-based, as in metrics rows, messages and train.debug.fault_step
                self.faults.before_step(n)
                with guards.naming_step(step=n, rank=self.ctx.rank, timeout_s=float(self.cfg.cluster.timeout_s)):
                    comm.measuring = step >= warmup
                    self.timer.start_step()
                    with self.timer.phase("data"):
                        inputs, targets = next(batches)
                        inputs = inputs.to(self.ctx.device, non_blocking=True)
                        targets = targets.to(self.ctx.device, non_blocking=True)
                    result = self._step(inputs=inputs, targets=targets, loss=self.faults.loss_fn(loss_fn, n), step=step,
                                        measured=step == max(warmup, self.state.step))
                    lr = self.scheduler.get_last_lr()[0]
                    self.scheduler.step()
                    step_s = self.timer.end_step()
                    comm.end_step()
                    # Mean loss over the global batch + numerics check: one all-reduce, measurement traffic.
                    loss, problem = self.guard.check(step=n, result=result)
                    self.state.step = n
                    self.state.samples_seen += self.global_batch
                    self.state.skipped_steps = self.guard.skipped_steps
                    if n % log_every == 0 or n == steps or problem:
                        self.state.last_loss = loss
                        row = {"step": n, "loss": loss, "lr": lr, "samples_per_s": self.global_batch / step_s, "step_s": step_s}
                        self.logger.log({**row, "nonfinite": problem} if problem else row)
                        bar.update(n, loss=loss, samples_per_s=self.global_batch / step_s)
                    if problem and self.guard.policy == "stop":
                        raise guards.NonFiniteError(f"{problem} (rank {self.ctx.rank} reporting)")
                    if n in eval_at:
                        with self.peak.phase("eval") if self.peak is not None else nullcontext():
                            self.evaluate()
                    if self.run_dir is not None and ckpt_every > 0 and (n % ckpt_every == 0 or n == steps):
                        checkpoint.save(run_dir=self.run_dir, step=n, strategy=self.strategy, scheduler=self.scheduler,
                                        train_state=asdict(self.state), data_key=self.data_key(),
                                        keep=int(tc.checkpoint_keep), resume_key=checkpoint.resume_key(self.cfg),
                                        timeout_s=float(checkpoint.io_timeout_s(self.cfg)))
        finally:
            bar.close()
        return self.state

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
        self.activation_bytes = meter.bytes
        return result

    # ---- evaluation -----------------------------------------------------------------------------
    def calibration(self, *, every_replica: bool) -> list[Callable[[], Iterator[torch.Tensor]]]:
        """The BatchNorm calibration set of the evaluation at this step (``eval.bn=reestimate``): the
        global batches of :func:`sdp.rank.evaluation.calibration_steps` at this evaluation point's fraction of
        the budget, the same samples for every strategy. One callable per replica shard (this rank's
        replica, or ``every_replica``: all of them, in replica order), each regenerating the shard's
        inputs from the step-indexed sampler: nothing is cached, and a resumed run calibrates alike."""
        step = self.state.step
        fraction = self.eval_at.get(step, Fraction(step, int(self.cfg.train.steps)))
        steps = evaluation.calibration_steps(fraction=fraction, reference_steps=self.reference_steps,
                                             count=int(self.cfg.eval.bn_batches))
        return [partial(self._inputs, steps=steps, replica=r)
                for r in (range(self.replicas) if every_replica else (self.replica,))]

    def _inputs(self, *, steps: range, replica: int) -> Iterator[torch.Tensor]:
        for x, _ in train_batches(self.data, sampler=self.sampler, start=steps.start, stop=steps.stop,
                                  replica=replica, replicas=self.replicas, num_workers=int(self.cfg.train.num_workers)):
            yield x.to(self.ctx.device)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Full model on the whole validation set, sharded over ranks, summed over the world, under the
        one evaluation protocol of every strategy (:mod:`sdp.rank.evaluation`); where the strategy has
        workers' own subnetworks, with ``eval.subnetworks`` each of them on the whole set, calibrated and
        batched as the full model is, and with ``eval.ensemble`` their ensemble, in the same pass
        (:func:`sdp.rank.evaluation.own_totals`). Sums stay on the device until one read at the end."""
        ec, ctx, tc = self.cfg.eval, self.ctx, self.cfg.train
        bn = str(ec.bn)
        common = dict(bn=bn, ctx=ctx, data=self.data, batch_size=int(tc.eval_batch_size), num_workers=int(tc.num_workers))
        # evaluation forwards in the run's precision, as training's: one protocol for every strategy (FSDP2's
        # bf16 policy unshards bf16 parameters, which a float32 input outside autocast cannot meet)
        with self.strategy.eval_module() as full, self.strategy.autocast():
            mine = evaluation.totals(full, bn_batches=self.calibration(every_replica=False)[0], rank=ctx.rank,
                                     world_size=ctx.world_size, part_batches=int(evaluation.part_batches(self.cfg)), **common)
        with ctx.comm.phase_as("eval"):  # the sums' gathers are evaluation traffic, not the step's
            figures = {"full": evaluation.world_sum(mine, ctx=ctx)}
        workers, ensemble = bool(ec.subnetworks), bool(evaluation.ensemble(self.cfg))
        if workers or ensemble:
            with self.strategy.subnetwork_module() as own:
                if own is not None:  # the same answer on every rank: the strategy decides
                    with self.strategy.autocast():
                        t, ens = evaluation.own_totals(own, calibration=self.calibration(every_replica=True),
                                                       world_size=ctx.world_size, ensemble=ensemble, **common)
                    if workers:
                        with ctx.comm.phase_as("eval"):
                            figures["workers"] = evaluation.world_sum(torch.stack([t[0] / t[2], t[1] / t[2]]),
                                                                      ctx=ctx) / ctx.world_size
                    if ens is not None:  # the same totals on every rank
                        figures["ensemble"] = torch.stack([ens[0] / ens[2], ens[1] / ens[2]])
        flat = iter(torch.cat(list(figures.values())).tolist())  # the one read of the evaluation
        values = {name: [next(flat) for _ in range(len(t))] for name, t in figures.items()}
        classify = self.data.task == "classification"
        loss, correct, count = values["full"]
        row: dict[str, Any] = {"step": self.state.step, "eval_loss": loss / count,
                               "eval_accuracy": correct / count if classify else None}
        if "workers" in values:
            row["eval_loss_workers"], acc = values["workers"]
            row["eval_accuracy_workers"] = acc if classify else None
            row["assembly_gap"] = row["eval_loss"] - row["eval_loss_workers"]
        if "ensemble" in values:
            row["eval_loss_ensemble"], acc = values["ensemble"]
            row["eval_accuracy_ensemble"] = acc if classify else None
        self.state.last_eval = row
        self.logger.log(row)
        return row
