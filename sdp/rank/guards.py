"""Guards around each training step: non-finite numerics, and errors that name their step and rank.

Why a per-step check: a NaN loss silently turns the rest of a run (and its summary) into noise. The
guard folds the check into the one all-reduce the trainer needs anyway for the logged loss: per step
it reduces ``[loss_sum, count, loss_bad[0..W), grad_bad[0..W)]`` (2 + 2W numbers), so every rank
takes the same decision and the message names the ranks where the problem appeared.

``train.nan_policy``: ``stop`` (default) logs the bad step and raises :class:`NonFiniteError`;
``skip`` also drops the optimizer update of a step whose gradients are not finite on some rank (one
more tiny all-reduce inside ``optimizer.step``, so all ranks skip together). A skip does not undo
what the forward pass itself changed (BatchNorm running statistics).
"""

from __future__ import annotations

import types
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from sdp.parallel.base import StepResult
from sdp.core.distctx import WHERE, DistContext

POLICIES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A NaN or inf loss or gradient norm under ``train.nan_policy=stop``."""


class StepFailure(RuntimeError):
    """Any error inside a training step, re-raised with the step and the rank that saw it."""


def _ranks(flags: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(flags > 0).flatten()]


def grads_nonfinite(optimizer: torch.optim.Optimizer) -> torch.Tensor | float:
    """1 when the norm of the gradients this rank's optimizer holds is not finite, else 0 (DTensor
    grads are checked on their local shard; the guard's all-reduce combines the ranks). A device
    tensor, so the check adds no host sync to the step."""
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                g = p.grad
                grads.append(g.to_local() if hasattr(g, "to_local") else g)
    if not grads:
        return 0.0
    return (~torch.isfinite(torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False))).double()


class NumericsGuard:
    """Wraps ``optimizer.step`` (gradient check) and checks the loss after every step."""

    def __init__(self, *, policy: str, ctx: DistContext, optimizer: torch.optim.Optimizer) -> None:
        assert policy in POLICIES, f"train.nan_policy={policy!r} not in {POLICIES}"
        self.policy, self.ctx, self.optimizer = policy, ctx, optimizer
        self.grad_bad: torch.Tensor | float = 0.0  # this rank's gradients were not finite in this step
        self.skipped_steps = 0
        self._skipped_now = False
        original, guard = optimizer.step, self

        def guarded_step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return guard._guarded_step(original, *args, **kwargs)

        # A bound method of the optimizer (an instance attribute shadowing the class's), because
        # LR schedulers re-bind ``optimizer.step.__func__`` to the optimizer when they wrap it.
        optimizer.step = types.MethodType(guarded_step, optimizer)  # type: ignore[method-assign]

    def _guarded_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.grad_bad = grads_nonfinite(self.optimizer)
        if self.policy == "skip":
            flags = torch.zeros(self.ctx.world_size, dtype=torch.float64, device=self.ctx.device)
            flags[self.ctx.rank] = self.grad_bad
            if self.ctx.world_size > 1:
                dist.all_reduce(flags)
            if bool(flags.any()):
                self._skipped_now = True
                return None  # every rank skips this update together
        return original(*args, **kwargs)

    def check(self, *, step: int, result: StepResult) -> tuple[float, str | None]:
        """Global mean loss of the step and, if anything was not finite, a message naming the step
        and the ranks (None otherwise). One all-reduce of 2 + 2W float64 numbers."""
        w, r = self.ctx.world_size, self.ctx.rank
        buf = torch.zeros(2 + 2 * w, dtype=torch.float64, device=self.ctx.device)
        loss_sum = float(result.loss_sum)
        buf[0], buf[1] = loss_sum, float(result.count)
        buf[2 + r] = float(result.count > 0 and not torch.isfinite(torch.tensor(loss_sum)))
        buf[2 + w + r] = self.grad_bad
        if w > 1:
            dist.all_reduce(buf)
        self.grad_bad = 0.0
        skipped, self._skipped_now = self._skipped_now, False
        loss = float(buf[0] / buf[1]) if buf[1] > 0 else float("nan")
        bad_loss, bad_grad = _ranks(buf[2 : 2 + w]), _ranks(buf[2 + w :])
        if not bad_loss and not bad_grad:
            return loss, None
        parts = [f"non-finite loss on rank(s) {bad_loss}"] if bad_loss else []
        parts += [f"non-finite gradient norm on rank(s) {bad_grad}"] if bad_grad else []
        action = "the run stops (train.nan_policy=stop)"
        if self.policy == "skip":
            self.skipped_steps += int(skipped)
            action = "update skipped (train.nan_policy=skip)" if skipped else "loss only, update kept (train.nan_policy=skip)"
        return loss, f"step {step}: {' and '.join(parts)}; {action}"

    def stop_if(self, *, problem: str | None) -> None:
        """Under ``stop``, end the run at a step :meth:`check` flagged; called after that step's metrics row
        is written, so the run's last row shows the problem. Every rank raises alike (the check is global)."""
        if problem and self.policy == "stop":
            raise NonFiniteError(f"{problem} (rank {self.ctx.rank} reporting)")


PEER_LOST = "a peer rank went away mid-collective"  # marks a failure that is a consequence, not the cause
PEER_LOST_GRACE_S = 3.0  # how long such a rank waits before failing, so the cause is reported first


def _hint(exc: BaseException, *, timeout_s: float) -> str:
    text = f"{type(exc).__name__} {exc}".lower()
    if "timed out" in text or "timeout" in text:
        return (f" (a collective did not complete within cluster.timeout_s={timeout_s:g}: another rank is hung, "
                "dead or slower than the timeout)")
    if "closed by peer" in text or "connection reset" in text or "broken pipe" in text:
        return f" ({PEER_LOST}: see that rank's failure)"
    return ""


@contextmanager
def naming_step(*, step: int, rank: int, timeout_s: float) -> Iterator[None]:
    """Re-raise any error of a step as :class:`StepFailure` naming the step and rank (a process-group
    timeout or a dead peer is said so) and the groups the step's collectives went to (SDP's holder sets:
    :data:`sdp.core.distctx.WHERE`), so the launcher's report says where the job died. The step's start is
    noted in ``WHERE`` too, which keeps it in the rank's failure file for a process that is aborted
    without a Python error (NCCL's watchdog)."""
    WHERE.begin_step(step)
    try:
        yield
    except (NonFiniteError, StepFailure, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        hint = _hint(exc, timeout_s=timeout_s)
        if PEER_LOST in hint:
            # A consequence, not the cause: give the failing peer time to exit first, so the launcher
            # (which reports the first rank it sees die) names the root cause, not this rank.
            time.sleep(PEER_LOST_GRACE_S)
        where = f"; {WHERE.describe()}" if WHERE.groups else ""
        raise StepFailure(f"step {step} failed on rank {rank}{hint}{where}: {type(exc).__name__}: {exc}") from exc
