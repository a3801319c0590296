"""The training loop, identical for every strategy.

The trainer owns what all strategies share: data order (step-indexed global batches), the LR
schedule, logging, evaluation of the full model on the sharded validation set, and measurement
(phase timer, comm counter windows, memory). Everything strategy-specific happens behind
:class:`sdp.parallel.base.Strategy`; no strategy is ever named here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.nn import functional as F

from sdp.data.base import DataBundle, GlobalBatchSampler, train_batches, val_batches
from sdp.loggers import Logger, ProgressBar
from sdp.metrics.timing import PhaseTimer
from sdp.parallel.base import Strategy


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; LM logits (B, T, V) and targets (B, T) are flattened."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


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


@dataclass
class TrainState:
    """What the loop produced; the worker turns it into summary.json."""

    step: int = 0
    last_loss: float | None = None
    last_eval: dict[str, Any] = field(default_factory=dict)
    samples_seen: int = 0


class Trainer:
    """Runs ``train.steps`` steps of ``strategy`` on ``data``; logs rank 0 only."""

    def __init__(
        self, *, cfg: DictConfig, strategy: Strategy, data: DataBundle, logger: Logger, timer: PhaseTimer,
        checkpointer: Any = None,
    ) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.data = data
        self.logger = logger
        self.timer = timer
        self.checkpointer = checkpointer  # sdp.resume.Checkpointer: step_end(trainer) after every step
        self.ctx = strategy.ctx
        tc = cfg.train
        self.replica, self.replicas = strategy.data_parallel()
        self.global_batch = int(tc.batch_size) * self.ctx.world_size
        self.sampler = GlobalBatchSampler(num_samples=len(data.train), global_batch=self.global_batch, seed=int(cfg.seed))
        assert strategy.optimizer is not None, f"strategy {strategy.name!r} built no optimizer"
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

    # ---- loop -----------------------------------------------------------------------------------
    def fit(self) -> TrainState:
        tc = self.cfg.train
        steps, warmup = int(tc.steps), int(tc.warmup_steps)
        eval_every, log_every = int(tc.eval_every), int(tc.log_every)
        bar = ProgressBar(total=steps, enabled=self.ctx.rank == 0 and bool(self.cfg.logger.progress))
        batches = train_batches(
            self.data, sampler=self.sampler, start=self.state.step, stop=steps,
            replica=self.replica, replicas=self.replicas, num_workers=int(tc.num_workers),
        )
        comm = self.ctx.comm
        try:
            for step in range(self.state.step, steps):
                comm.measuring = step >= warmup
                self.timer.start_step()
                with self.timer.phase("data"):
                    inputs, targets = next(batches)
                    inputs = inputs.to(self.ctx.device, non_blocking=True)
                    targets = targets.to(self.ctx.device, non_blocking=True)
                result = self.strategy.train_step(
                    inputs=inputs, targets=targets, loss_fn=loss_fn, timer=self.timer, step=step
                )
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                step_s = self.timer.end_step()
                comm.end_step()
                self.state.step = step + 1
                self.state.samples_seen += self.global_batch
                if self.state.step % log_every == 0 or self.state.step == steps:
                    loss = self._global_mean(result.loss_sum, result.count)
                    self.state.last_loss = loss
                    self.logger.log(
                        {"step": self.state.step, "loss": loss, "lr": lr,
                         "samples_per_s": self.global_batch / step_s, "step_s": step_s}
                    )
                    bar.update(self.state.step, loss=loss, samples_per_s=self.global_batch / step_s)
                if (eval_every > 0 and self.state.step % eval_every == 0) or self.state.step == steps:
                    self.evaluate()
                if self.checkpointer is not None:
                    self.checkpointer.step_end(self)
        finally:
            bar.close()
        return self.state

    def _global_mean(self, loss_sum: torch.Tensor, count: int) -> float:
        """Mean loss over the global batch (measurement traffic, not counted as strategy comm)."""
        buf = torch.tensor([float(loss_sum), float(count)], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(buf)
        return float(buf[0] / buf[1]) if buf[1] > 0 else float("nan")

    # ---- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Full model on the whole validation set, sharded over ranks, summed over the world."""
        tc = self.cfg.train
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # loss sum, correct, count
        classify = self.data.task == "classification"
        with self.strategy.eval_module() as model:
            for x, y in val_batches(
                self.data, rank=self.ctx.rank, world_size=self.ctx.world_size,
                batch_size=int(tc.eval_batch_size), num_workers=int(tc.num_workers),
            ):
                x, y = x.to(self.ctx.device), y.to(self.ctx.device)
                out = model(x)
                n = y.numel()
                totals[0] += float(loss_fn(out, y)) * n
                if classify:
                    totals[1] += float((out.argmax(-1) == y).sum())
                totals[2] += n
        if self.ctx.world_size > 1:
            dist.all_reduce(totals)
        row = {
            "step": self.state.step,
            "eval_loss": float(totals[0] / totals[2]),
            "eval_accuracy": float(totals[1] / totals[2]) if classify else None,
        }
        self.state.last_eval = row
        self.logger.log(row)
        return row
