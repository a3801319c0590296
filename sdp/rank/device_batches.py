"""Training batches on a rank's device, assembled as a GPU run assembles them: on the host.

Why a module of its own: the live-tensor tracker stands in for ``torch.cuda.max_memory_allocated`` on a CPU run,
where host and device are the same memory. A GPU run draws the sampler's epoch permutation (8 bytes per training
sample, held for the epoch and drawn lazily inside the step that begins it) and indexes the in-memory dataset on
the host; only the batch it moves to the device counts against the device. Counting the host work on a CPU run
added the permutation to every method's peak alike (1.6 MB for the LM study's 200 000 sequences), so every ratio
over DDP's peak read high, and ``sdp-plan``'s rehearsal, which models the device, never sees it. So the batch is
made inside the tracker's host side (:meth:`sdp.metrics.memory.PeakTracker.host_side`) and counted once on the
device (:meth:`~sdp.metrics.memory.PeakTracker.on_device`); the in-memory dataset is ignored at set-up the same way.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterator

import torch

from sdp.metrics.memory import PeakTracker


def device_batches(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], *, device: torch.device,
                   peak: PeakTracker | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each (inputs, targets) of ``batches`` on ``device``; made on the host side of ``peak`` (None: no tracker)."""
    host = peak.host_side if peak is not None else nullcontext
    while True:
        with host():
            item = next(batches, None)
        if item is None:
            return
        inputs, targets = (t.to(device, non_blocking=True) for t in item)
        if peak is not None:
            peak.on_device((inputs, targets))
        yield inputs, targets
