"""Per-rank memory: bytes counted from the tensors a rank really holds, and peak RSS.

Tensor counts are exact and comparable across strategies (local shards for FSDP DTensors). Peak RSS
on CPU is reported as a delta over the rank's RSS right after imports, because the CUDA build of
torch alone maps about 0.5 GB of library pages per process; the peak is reset through
``/proc/self/clear_refs`` where the kernel allows it.
"""

from __future__ import annotations

import os
import resource

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


class PeakTracker:
    """Baseline after imports; peak delta at the end (CUDA peaks too when on a GPU).

    The trainer calls :meth:`start_measuring` at the first measured (post-warm-up) step: CUDA peaks
    then cover the measured steps only. The RSS peak is not reset there (the kernel's reset drops it
    to the current RSS, which would hide the model and optimizer state built before); it stays the
    peak since the post-import baseline."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device
        reset_peak_rss()
        self.baseline_rss = current_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def start_measuring(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def summary(self) -> dict:
        out = {
            "baseline_rss_bytes": self.baseline_rss,
            "peak_rss_delta_bytes": max(peak_rss() - self.baseline_rss, 0),
        }
        if self.device.type == "cuda":
            out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            out["cuda_max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(self.device))
        return out
