"""Fault injection for the reliability tests: the ``train.debug`` node, read here and nowhere else.

Why real faults rather than mocks: the claims under test (a dead rank ends the job within a minute,
a hung collective hits the process-group timeout, a NaN stops the run naming step and rank, a killed
run resumes bit for bit) are about processes, signals and collectives, so the tests kill and stall
real ranks of a real job started by ``sdp.driver.train``.

``train.debug.fault`` (null = off) happens on rank ``fault_rank`` at step ``fault_step`` (1-based,
the ``step`` of that step's metrics row), before the step runs:

- ``kill``: the rank sends itself SIGKILL (no cleanup, no error file: a dead node or an OOM kill);
- ``hang``: the rank sleeps forever, so its peers wait in a collective until ``cluster.timeout_s``;
- ``nan_loss``: the rank's loss for that step is multiplied by NaN (so its gradients are NaN too).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Faults:
    """This rank's view of ``train.debug``: does anything happen at step ``n``?"""

    def __init__(self, *, debug: Any, rank: int) -> None:
        self.fault = None if debug is None else debug.get("fault")
        self.armed = self.fault is not None and int(debug.fault_rank) == rank
        self.at = int(debug.fault_step) if self.fault is not None else -1
        self.rank = rank

    def before_step(self, n: int) -> None:
        if not self.armed or n != self.at:
            return
        if self.fault == "kill":
            print(f"[train.debug] rank {self.rank}: SIGKILL at step {n} t={time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "hang":
            print(f"[train.debug] rank {self.rank}: hanging at step {n} t={time.time():.3f}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def loss_fn(self, fn: LossFn, n: int) -> LossFn:
        """``fn``, or ``fn`` times NaN at the ``nan_loss`` fault's step on its rank."""
        if not (self.armed and self.fault == "nan_loss" and n == self.at):
            return fn

        def poisoned(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return fn(output, target) * float("nan")

        return poisoned
