"""Step-time split into phases (data, forward, backward, comm, optimizer) with synchronisation.

On CPU ``perf_counter`` is exact enough once work is synchronous; on CUDA each phase boundary
synchronises the device so that a phase's time is its own (a measurement cost accepted for
benchmarks; ``enabled=False`` removes it).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


class PhaseTimer:
    """Accumulates seconds per phase for the current step; ``end_step`` stores and resets."""

    def __init__(self, *, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self._current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._t0: float | None = None

    def _sync(self) -> None:
        if self.enabled and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._current[name] += time.perf_counter() - t

    def end_step(self) -> float:
        """Close the step; returns its wall time in seconds."""
        self._sync()
        assert self._t0 is not None, "end_step() called before start_step()"
        total = time.perf_counter() - self._t0
        record = dict(self._current)
        record["step"] = total
        self.steps.append(record)
        self._current = defaultdict(float)
        self._t0 = None
        return total

    def summary(self, *, warmup: int) -> dict:
        """Median and spread of step time and of each phase, warm-up steps excluded."""
        steps = self.steps[warmup:] or self.steps
        if not steps:
            return {"step_s_median": None, "measured_steps": 0, "phases_s_median": {}}
        totals = [s["step"] for s in steps]
        phases = sorted({k for s in steps for k in s} - {"step"})
        return {
            "step_s_median": statistics.median(totals),
            "step_s_min": min(totals),
            "step_s_max": max(totals),
            "step_s_stdev": statistics.pstdev(totals),
            "measured_steps": len(steps),
            "phases_s_median": {p: statistics.median(s.get(p, 0.0) for s in steps) for p in phases},
        }
