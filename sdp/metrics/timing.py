"""Step-time split into phases (data, forward, backward, comm, optimizer).

On CPU ``perf_counter`` is exact once work is synchronous. On CUDA a phase is timed by a pair of
CUDA events recorded on the current stream (``Event(enable_timing=True)``), with no synchronisation
at phase boundaries: timing must not slow the run it measures (a sync per phase would stall the
host's queueing of the next kernels and serialise the copies/collectives it overlaps). The events are
resolved once per step, in :meth:`PhaseTimer.end_step`, which waits for the step's last event only;
the step's wall time is host time from ``start_step`` to that point. A phase's time is then the
stream's time between its two events, which includes waits on other streams (NCCL's) that the
phase enqueued (e.g. SDP's ``comm`` phase: the exposed part of the overlapped all-reduces).
``enabled=False`` times with ``perf_counter`` only, with no events and no synchronisation.
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
        self.events = enabled and device.type == "cuda"
        self._current: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.steps: list[dict[str, float]] = []
        self._t0: float | None = None

    def _event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start_step(self) -> None:
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.events:
            start = self._event()
            try:
                yield
            finally:
                self._pending.append((name, start, self._event()))
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self._current[name] += time.perf_counter() - t

    def end_step(self) -> float:
        """Close the step; returns its wall time in seconds (CUDA: after the step's last event)."""
        assert self._t0 is not None, "end_step() called before start_step()"
        if self.events:
            self._event().synchronize()  # the one wait per step; every earlier event is then complete
            for name, start, end in self._pending:
                self._current[name] += start.elapsed_time(end) / 1000.0
            self._pending = []
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
            # the mean and the totals keep what a median drops: a phase that runs every R steps (a plan
            # re-draw) costs its total / measured steps per step
            "step_s_mean": statistics.fmean(totals),
            "measured_steps": len(steps),
            "phases_s_median": {p: statistics.median(s.get(p, 0.0) for s in steps) for p in phases},
            "phases_s_total": {p: sum(s.get(p, 0.0) for s in steps) for p in phases},
        }
