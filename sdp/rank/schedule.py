"""The run's clock: the LR multiplier at each step, and which steps log, evaluate and checkpoint.

Pure functions of the resolved config (and the driver's budget), kept apart from the loop so that every
decision the trainer takes at step n ("log it?", "evaluate?", "checkpoint?") has one owner,
:class:`Cadence`, testable without a model, a process group or a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from omegaconf import DictConfig

SCHEDULES = ("constant", "cosine", "linear")  # optim.schedule's values (its schema field names this tuple)


def lr_lambda(*, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier on the base LR at each step: linear warm-up then constant, cosine or linear decay."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r} not in {SCHEDULES}")

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
    resolution (:mod:`sdp.driver.budget`)."""
    if budget is None or budget.get("budget") != "flops":
        return steps, None
    base = int(budget["base_steps"])
    every = ((budget.get("schedule") or {}).get("train.eval_every") or {}).get("base")
    return base, Fraction(int(every), base) if every else None


@dataclass(frozen=True)
class Cadence:
    """Which 1-based steps the trainer logs, evaluates and checkpoints after, decided once from the
    resolved config, so the loop only asks. ``eval_at``: :func:`eval_fractions` (step -> fraction of the
    budget); ``reference_steps``: :func:`budget_clock`'s, the steps a fraction is of when calibrating."""

    steps: int
    log_every: int
    checkpoint_every: int
    eval_at: dict[int, Fraction]
    reference_steps: int

    @classmethod
    def of(cls, *, train: DictConfig, budget: dict[str, Any] | None) -> Cadence:
        """From ``train.*`` (the resolved steps) and the driver's budget resolution (None: no budget)."""
        steps = int(train.steps)
        reference_steps, cadence = budget_clock(budget=budget, steps=steps)
        eval_at = eval_fractions(steps=steps, eval_every=int(train.eval_every), eval_points=train.get("eval_points"),
                                 cadence=cadence)
        return cls(steps=steps, log_every=int(train.log_every), checkpoint_every=int(train.checkpoint_every),
                   eval_at=eval_at, reference_steps=reference_steps)

    def logs(self, n: int, *, problem: str | None) -> bool:
        """A metrics row every ``log_every`` steps, at the last, and at any step the numerics guard flagged
        (so the row that shows the problem is written before a ``stop`` ends the run)."""
        return n % self.log_every == 0 or n == self.steps or bool(problem)

    def evaluates(self, n: int) -> bool:
        """An evaluation at every step of :func:`eval_fractions` (the last always)."""
        return n in self.eval_at

    def checkpoints(self, n: int) -> bool:
        """A checkpoint every ``checkpoint_every`` steps and at the last (0: never), so a finished run can
        always be continued from its end."""
        return self.checkpoint_every > 0 and (n % self.checkpoint_every == 0 or n == self.steps)

    def fraction(self, step: int) -> Fraction:
        """The fraction of the budget an evaluation after ``step`` stands for: its :func:`eval_fractions`
        entry, or ``step / steps`` off the schedule (an evaluation called outside the loop)."""
        return self.eval_at.get(step, Fraction(step, self.steps))
