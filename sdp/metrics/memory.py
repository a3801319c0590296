"""Per-rank memory: bytes counted from the tensors a rank really holds, per-phase peaks, peak RSS.

Tensor counts are exact and comparable across strategies (local shards for FSDP DTensors). Peak RSS
on CPU is reported as a delta over the rank's RSS right after imports, because the CUDA build of
torch alone maps about 0.5 GB of library pages per process; the peak is reset through
``/proc/self/clear_refs`` where the kernel allows it.
"""

from __future__ import annotations

import os
import resource
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor's local data (a DTensor counts its local shard)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def param_bytes(module: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in module.parameters())


def grad_bytes(module: nn.Module) -> int:
    return sum(tensor_bytes(p.grad) for p in module.parameters() if p.grad is not None)


def optim_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += tensor_bytes(v)
    return total


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency; /proc fallback
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak RSS (VmHWM) in bytes since start or the last :func:`reset_peak_rss`."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mode_stack() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


PHASES = ("setup", "resume", "warmup", "train", "eval", "redraw", "calibrate", "consolidate")  # resume: loading a checkpoint, not reported
REPORTED = ("setup", "train", "eval")  # summary.json: <phase>_peak_bytes
MEASURED = ("redraw", "calibrate")  # phases a strategy opens itself (measured_phase): reported only where they ran
LATER = ("consolidate",)  # a strategy's later training phase (later_phase): its steps' peak, reported where it ran
_ACTIVE: list["PeakTracker"] = []  # the tracker this rank started (worker), for phases a strategy opens


class PeakTracker:
    """Per-phase peaks of live tensor bytes: ``setup`` (start to the first step: build, masking,
    optimizer), ``warmup`` (steps before the first measured one, not reported), ``train`` (the measured
    steps only) and ``eval`` (every evaluation). The trainer switches phases (:meth:`set_phase`,
    :meth:`phase`); a phase's peak is the largest live total while it ran, starting from what was
    live when it began (like ``torch.cuda.max_memory_allocated`` after a reset). A strategy measures a
    block inside a step as a phase of its own with :func:`measured_phase` (SDP's plan re-draws:
    ``redraw``), so the step's ``train`` peak excludes it and each block's peak is kept (``blocks``).

    Source: on CUDA the caching allocator (peak reset at each switch) plus the device-wide use from
    ``torch.cuda.mem_get_info`` (NCCL buffers, context: outside the allocator); on the CPU the
    :class:`~sdp.metrics.live.LiveTensorTracker` (``memory.tracker=false`` turns it off, leaving
    RSS only). The RSS peak delta over the post-import baseline is kept as the process-level figure.
    ``watch`` names the model and optimizer, so CPU peaks are split into parameters (and buffers),
    gradients, optimizer state and activations/temporaries (labels refreshed at each switch)."""

    def __init__(self, *, device: torch.device, live: bool = True, budget_bytes: int | None = None) -> None:
        from sdp.metrics.live import LiveTensorTracker

        self.device = device
        reset_peak_rss()
        self.baseline_rss = current_rss()
        self.tracker = LiveTensorTracker(budget_bytes=budget_bytes) if live and device.type == "cpu" else None
        self.current = "setup"
        self.training = "train"  # the phase measured steps run in (a strategy's later phase: later_phase)
        self.peaks: dict[str, int] = {}
        self.peak_categories: dict[str, dict[str, int]] = {}
        self.last: dict[str, int] = {}  # each phase's peak the last time it closed
        self.blocks: dict[str, list[int]] = {}  # measured_phase: the peak of every block, in order
        self.device_used = 0  # the largest mem_get_info use seen at a phase switch (not the end value)
        self.reserved = 0  # the largest allocator reservation of any phase (its peak is reset per phase)
        self._watched: Any = None
        if device.type == "cuda":
            if budget_bytes is not None:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(budget_bytes / total, 1.0), device)
            torch.cuda.reset_peak_memory_stats(device)

    # ---- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin counting (CPU: enter the dispatch mode); everything allocated from now on counts."""
        if self.tracker is not None:
            self.tracker.__enter__()
        _ACTIVE.append(self)

    def stop(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self.tracker is not None and self.tracker in _mode_stack():
            self.tracker.__exit__(None, None, None)

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors that exist but do not count (the in-memory dataset: on a GPU it stays on the host)."""
        if self.tracker is not None:
            self.tracker.label(tensors, "ignored")

    @contextmanager
    def host_side(self) -> Iterator[None]:
        """Work that a GPU run does on the host does not count on a CPU run either: the data pipeline's epoch
        permutation (8 bytes per training sample, drawn lazily inside a step) and its batch assembly. Only what
        reaches the device counts: :meth:`on_device` names it."""
        with self.tracker.uncounted() if self.tracker is not None else nullcontext():
            yield

    def on_device(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors now on the rank's device (a batch moved there; on the CPU the host's own tensors) count as activations;
        a view into a larger storage (a slice of the ignored dataset) adds no bytes on the CPU and is left as it is."""
        if self.tracker is not None:
            self.tracker.label((t for t in tensors if t.untyped_storage().nbytes() <= t.numel() * t.element_size()),
                               "activations")

    def watch(self, state: Callable[[], tuple[nn.Module | None, torch.optim.Optimizer | None]]) -> None:
        """``state()`` -> (model, optimizer) now (SDP's re-draws replace both)."""
        self._watched = state

    # ---- phases -------------------------------------------------------------------------------------
    def set_phase(self, name: str) -> None:
        assert name in PHASES, f"memory phase {name!r} not in {PHASES}"
        if name != self.current:
            self._close()
            self.current = name

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        prev = self.current
        self.set_phase(name)
        try:
            yield
        finally:
            self.set_phase(prev)

    def start_measuring(self) -> None:
        """The first measured step begins (kept for callers of the previous interface): the training phase, or
        the strategy's later phase once it began (:func:`later_phase`)."""
        self.set_phase(self.training)

    def _label(self) -> None:
        if self.tracker is None or self._watched is None:
            return
        model, optimizer = self._watched()
        if model is not None:
            self.tracker.label(model.parameters(), "parameters")
            self.tracker.label(model.buffers(), "parameters")
            self.tracker.label((p.grad for p in model.parameters()), "gradients")
        if optimizer is not None:
            self.tracker.label((v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)),
                               "optimizer")

    def _close(self) -> None:
        """Fold the running peak into the current phase's and reset it for the next phase."""
        name = self.current
        if self.tracker is not None:
            self._label()
            tr = self.tracker
            peak = tr.peak
            cats = tr.by_cat if peak == tr.total else tr.peak_by_cat  # a peak that is now: today's labels
            if peak >= self.peaks.get(name, -1):
                self.peaks[name], self.peak_categories[name] = peak, dict(cats)
            self.last[name] = peak
            tr.reset_peak()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.last[name] = int(torch.cuda.max_memory_allocated(self.device))
            self.peaks[name] = max(self.peaks.get(name, 0), self.last[name])
            # reset_peak_memory_stats resets the reserved peak too: fold it in first, or the run's
            # "max reserved" would be the last phase's
            self.reserved = max(self.reserved, int(torch.cuda.max_memory_reserved(self.device)))
            free, total = torch.cuda.mem_get_info(self.device)
            self.device_used = max(self.device_used, int(total - free))
            torch.cuda.reset_peak_memory_stats(self.device)

    # ---- across a resume ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's peaks so far (a checkpoint keeps them, so a resumed run reports the peaks of the whole run)."""
        self._close()
        return {"peaks": dict(self.peaks), "peak_categories": dict(self.peak_categories), "blocks": dict(self.blocks),
                "device_used": self.device_used, "reserved": self.reserved}

    def adopt(self, state: dict[str, Any]) -> None:
        """Continue the run a checkpoint's :meth:`state_dict` measured: each phase's peak is the larger of the two
        (with its categories), each measured block list the checkpoint's followed by this process's."""
        self._close()
        for name, peak in state["peaks"].items():
            if peak >= self.peaks.get(name, -1):
                self.peaks[name] = peak
                if name in state["peak_categories"]:
                    self.peak_categories[name] = state["peak_categories"][name]
        self.blocks = {k: [*state["blocks"].get(k, []), *self.blocks.get(k, [])] for k in {*state["blocks"], *self.blocks}}
        self.device_used, self.reserved = max(self.device_used, state["device_used"]), max(self.reserved, state["reserved"])

    # ---- report -------------------------------------------------------------------------------------
    def summary(self) -> dict:
        self._close()
        out: dict[str, Any] = {
            "baseline_rss_bytes": self.baseline_rss,
            "peak_rss_delta_bytes": max(peak_rss() - self.baseline_rss, 0),
            "peak_source": "live_tensors" if self.tracker is not None else
                           ("cuda_allocator" if self.device.type == "cuda" else None),
        }
        for name in REPORTED:
            out[f"{name}_peak_bytes"] = self.peaks.get(name)
        for name in LATER:  # e.g. consolidate_peak_bytes: only where the phase ran
            if name in self.peaks:
                out[f"{name}_peak_bytes"] = self.peaks[name]
        for name in MEASURED:  # e.g. redraw_peak_bytes (the largest) and redraw_peaks_bytes (each, in order)
            if self.blocks.get(name):
                out[f"{name}_peak_bytes"], out[f"{name}_peaks_bytes"] = self.peaks.get(name), list(self.blocks[name])
        if self.tracker is not None:
            out["peak_categories"] = {n: self.peak_categories[n] for n in REPORTED + MEASURED + LATER if n in self.peak_categories}
        if self.device.type == "cuda":
            out["cuda_max_allocated_bytes"] = self.peaks.get("train")  # measured steps (as before)
            out["cuda_max_reserved_bytes"] = self.reserved  # max over every phase of the run
            out["cuda_device_used_bytes"] = self.device_used  # mem_get_info, max over phase ends: all of the device (NCCL, context)
        return out


@contextmanager
def measured_phase(name: str) -> Iterator[dict[str, int | None]]:
    """Measure the block as phase ``name`` of the tracker this rank started (none started, e.g. in a
    unit test: nothing is measured), then return to the phase it interrupted. Yields a dict whose
    ``peak_bytes`` is the block's own peak once the block has run (None when nothing measures: the
    CPU without the live tracker); the tracker keeps it too (``blocks``, summary ``<name>_peaks_bytes``)."""
    out: dict[str, int | None] = {"peak_bytes": None}
    tracker = _ACTIVE[-1] if _ACTIVE else None
    if tracker is None:
        yield out
        return
    assert name in MEASURED, f"measured phase {name!r} not in {MEASURED}"
    tracker.last.pop(name, None)
    with tracker.phase(name):
        yield out
    out["peak_bytes"] = tracker.last.get(name)
    if out["peak_bytes"] is not None:
        tracker.blocks.setdefault(name, []).append(int(out["peak_bytes"]))


def later_phase(name: str) -> None:
    """From now on this rank's measured training steps are phase ``name`` of the tracker it started (none: nothing
    is measured), not ``train``: a strategy's second training phase (SDP's consolidation) gets its own peak,
    ``<name>_peak_bytes``. Called at the switch (the steps after it, warm-up steps still excepted) and by a run
    resumed after it (before its first measured step)."""
    assert name in LATER, f"later phase {name!r} not in {LATER}"
    tracker = _ACTIVE[-1] if _ACTIVE else None
    if tracker is None:
        return
    if tracker.current == tracker.training:
        tracker.set_phase(name)
    tracker.training = name
