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
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from sdp import checkpoint, evaluation, guards, hostmem
from sdp.data.base import DataBundle, GlobalBatchSampler, train_batches
from sdp.faults import Faults
from sdp.loggers import Logger, ProgressBar
from sdp.loss import loss_fn  # noqa: F401 (re-exported: sdp.trainer.loss_fn is used widely)
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


def eval_steps(*, steps: int, eval_every: int, eval_points: int | None) -> frozenset[int]:
    """The 1-based steps after which the model is evaluated (always including the last).

    ``eval_points`` (when set) places that many evaluations evenly over the run's *resolved* step count, so
    every method of a budget-matched sweep is evaluated at the same fractions of its budget (a FLOP-matched
    SDP run at C = 0.25 runs 4x DDP's steps; a fixed ``eval_every`` would evaluate it 4x as often and cost
    it 4x the evaluation time). Otherwise every ``eval_every`` steps (0: only at the end)."""
    if eval_points is not None:
        points = min(int(eval_points), steps)
        return frozenset(math.ceil(i * steps / points) for i in range(1, points + 1))
    every = frozenset(range(eval_every, steps + 1, eval_every)) if eval_every > 0 else frozenset()
    return every | {steps}


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
    (:mod:`sdp.checkpoint`), every step runs inside :func:`sdp.guards.naming_step` with the
    :class:`~sdp.guards.NumericsGuard` check, ``train.debug`` faults fire before a step
    (:mod:`sdp.faults`), and checkpoints are written after a step's logging and evaluation."""

    def __init__(
        self, *, cfg: DictConfig, strategy: Strategy, data: DataBundle, logger: Logger, timer: PhaseTimer,
        run_dir: Path | None = None, peak: PeakTracker | None = None,
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
        """What the data order depends on besides the step (see :mod:`sdp.checkpoint`)."""
        return {"seed": int(self.cfg.seed), "global_batch": self.global_batch, "num_samples": self.sampler.num_samples}

    # ---- loop -----------------------------------------------------------------------------------
    def fit(self) -> TrainState:
        tc = self.cfg.train
        steps, warmup = int(tc.steps), int(tc.warmup_steps)
        eval_every, log_every = int(tc.eval_every), int(tc.log_every)
        eval_at = eval_steps(steps=steps, eval_every=eval_every, eval_points=tc.get("eval_points"))
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
                                        keep=int(tc.checkpoint_keep), schedule=checkpoint.schedule_key(self.cfg))
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
    def recent_inputs(self, count: int) -> Iterator[torch.Tensor]:
        """This rank's inputs of the last ``count`` training steps (``eval.bn=reestimate``), regenerated
        from the step-indexed sampler: the same batches for every strategy, and nothing to checkpoint."""
        stop = self.state.step
        for x, _ in train_batches(self.data, sampler=self.sampler, start=max(0, stop - count), stop=stop,
                                  replica=self.replica, replicas=self.replicas, num_workers=int(self.cfg.train.num_workers)):
            yield x.to(self.ctx.device)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Full model on the whole validation set, sharded over ranks, summed over the world, under the
        one evaluation protocol of every strategy (:mod:`sdp.evaluation`); with ``eval.subnetworks``
        also every worker's own subnetwork, where the strategy has one, on the whole set."""
        ec, ctx = self.cfg.eval, self.ctx
        bn, n_bn = str(ec.bn), int(ec.bn_batches)
        with self.strategy.eval_module() as full:
            totals = self._val_totals(full, bn=bn, bn_batches=lambda: self.recent_inputs(n_bn),
                                      rank=ctx.rank, world_size=ctx.world_size)
        if ctx.world_size > 1:
            dist.all_reduce(totals)
        classify = self.data.task == "classification"
        row: dict[str, Any] = {"step": self.state.step, "eval_loss": float(totals[0] / totals[2]),
                               "eval_accuracy": float(totals[1] / totals[2]) if classify else None}
        if bool(ec.subnetworks):
            with self.strategy.subnetwork_module() as own:
                if own is not None:  # the same answer on every rank: the strategy decides
                    mine = self._val_totals(own, bn=bn, bn_batches=lambda: self.recent_inputs(n_bn), rank=0,
                                            world_size=1, average=False)
                    means = torch.stack([mine[0] / mine[2], mine[1] / mine[2]])
                    if ctx.world_size > 1:
                        dist.all_reduce(means)
                    means /= ctx.world_size
                    row["eval_loss_workers"] = float(means[0])
                    row["eval_accuracy_workers"] = float(means[1]) if classify else None
                    row["assembly_gap"] = row["eval_loss"] - row["eval_loss_workers"]
        self.state.last_eval = row
        self.logger.log(row)
        return row

    def _val_totals(self, model: Any, *, bn: str, bn_batches: Any, rank: int, world_size: int,
                    average: bool = True) -> torch.Tensor:
        # evaluation forwards in the run's precision, as training's: one protocol for every strategy (FSDP2's
        # bf16 policy unshards bf16 parameters, which a float32 input outside autocast cannot meet)
        with self.strategy.autocast():
            return evaluation.totals(model, bn=bn, bn_batches=bn_batches, ctx=self.ctx, data=self.data, rank=rank,
                                     world_size=world_size, batch_size=int(self.cfg.train.eval_batch_size),
                                     num_workers=int(self.cfg.train.num_workers), average=average,
                                     part_batches=int(evaluation.part_batches(self.cfg)))
