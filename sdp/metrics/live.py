"""Live tensor bytes on the CPU: the counterpart of ``torch.cuda.max_memory_allocated``.

Why not process RSS: RSS counts library pages, the dataset, the allocator's cached pages and pages
that were touched once, so it cannot say what a strategy needs. The CUDA allocator counts the bytes
of live tensor storages; this tracker counts the same thing on the CPU. It is a
``TorchDispatchMode`` that sees every ATen op's outputs (forward, backward on the calling thread,
optimizer, collectives' staging) and keys each output by its storage (the C++ ``StorageImpl``), so
views, in-place results and tensors sharing a storage count once. A weak reference on the storage
removes it when it dies (storages keep their Python object alive as long as the C++ storage lives). A storage
resized in place (``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2 frees and re-fills its gathered
parameters so) is followed through a hook on that method while a tracker is entered.
``device_type="meta"`` counts meta tensors the same way: ``sdp-plan`` rehearses steps on the meta
device with it (:mod:`sdp.parallel.plan_peaks`).

Why this and not ``torch.distributed._tools.mem_tracker.MemTracker``: that one hooks every module and
keeps per-module snapshots (useful for attribution, costly per step); here the work per op is one
dictionary look-up per output, and categories come from labels set at known points (parameters and
buffers, gradients, optimizer state; everything else is an activation or a temporary). Weight copies
made during a step (autocast's bf16 casts under DDP and SDP, FSDP2's unsharded bf16 parameters, SDP's
re-joined weights) are allocated after the labels and fall under ``activations`` for every strategy
alike; the saved-tensor figure ``activation_bytes`` excludes them for every strategy alike
(:mod:`sdp.metrics.activations`).

``budget_bytes`` turns the tracker into a per-rank memory limit: an op whose outputs take the live
total past it raises :class:`MemoryBudgetExceeded` (an ``OutOfMemoryError``), as the CUDA allocator
does under ``torch.cuda.set_per_process_memory_fraction``.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
_RESIZE = torch.UntypedStorage.resize_
_TRACKING: list["LiveTensorTracker"] = []  # the trackers entered now, told of every storage resize (_resize)


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` is a storage method, not an ATen op, so no dispatch mode sees it; FSDP2 frees a
    block's gathered parameters with ``resize_(0)`` and gathers into them again after ``resize_(size)``. Without this
    hook the tracker kept every block's gathered parameters live after their first gather."""
    out = _RESIZE(storage, size)
    for tracker in _TRACKING:
        tracker._resized(storage)
    return out


IGNORED = "ignored"  # storages that exist but are not counted (the in-memory dataset, the data pipeline's host work)


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """The live tensor bytes of this rank passed ``memory.budget_mb`` (CPU tracker)."""


class LiveTensorTracker(TorchDispatchMode):
    """Live bytes per category, the peak since the last :meth:`reset_peak`, and an optional budget."""

    def __init__(self, *, device_type: str = "cpu", budget_bytes: int | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.budget_bytes = budget_bytes
        self._live: dict[int, list[Any]] = {}  # storage -> [nbytes, category, weakref]
        self.by_cat = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_cat = dict(self.by_cat)
        self._made = "activations"  # the category of what ops make now (IGNORED inside :meth:`uncounted`)

    # ---- the mode -------------------------------------------------------------------------------
    def __enter__(self) -> "LiveTensorTracker":
        if not _TRACKING:
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]
        _TRACKING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _TRACKING.remove(self)
        if not _TRACKING:
            torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        made = self._made
        if isinstance(out, torch.Tensor):
            self._track(out, made)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._track(t, made)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._track(u, made)
        return out

    def _track(self, t: torch.Tensor, category: str = "activations") -> None:
        if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):  # DTensor: its local shard
            for attr in t.__tensor_flatten__()[0]:
                inner = getattr(t, attr)
                if isinstance(inner, torch.Tensor):
                    self._track(inner, category)
            return
        if t.device.type != self.device_type:
            return
        st = t.untyped_storage()
        nb = st.nbytes()
        if nb == 0:
            return
        key = st._cdata  # the C++ storage: one per live storage, shared by every view (meta tensors too)
        entry = self._live.get(key)
        if entry is not None:
            if nb > entry[0]:  # resize_ grew the storage in place
                self._add(entry[1], nb - entry[0])
                entry[0] = nb
            return
        ref = weakref.ref(st, lambda r, key=key: self._free(key, r))
        self._live[key] = [nb, category, ref]
        self._add(category, nb)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A tracked storage's new size, smaller or larger (:func:`_resize`)."""
        entry = self._live.get(storage._cdata)
        if entry is None:
            return
        old, entry[0] = entry[0], storage.nbytes()
        if entry[0] > old:
            self._add(entry[1], entry[0] - old)
        elif entry[0] < old:
            self._sub(entry[1], old - entry[0])

    def _add(self, category: str, nb: int) -> None:
        if category == IGNORED:
            return
        self.by_cat[category] += nb
        self.total += nb
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_cat = dict(self.by_cat)
            if self.budget_bytes is not None and self.total > self.budget_bytes:
                raise MemoryBudgetExceeded(
                    f"live tensor bytes {self.total / 2**20:.1f} MiB passed memory.budget_mb="
                    f"{self.budget_bytes / 2**20:.1f} MiB ({', '.join(f'{k} {v / 2**20:.1f}' for k, v in self.by_cat.items())} MiB)")

    def _sub(self, category: str, nb: int) -> None:
        """``nb`` bytes of ``category`` no longer live (freed, shrunk, or moved to another category)."""
        if category != IGNORED:
            self.by_cat[category] -= nb
            self.total -= nb

    def _free(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[2] is ref:
            del self._live[key]
            self._sub(entry[1], entry[0])

    # ---- labels and peaks -----------------------------------------------------------------------
    def label(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Count ``tensors``' storages under ``category`` (tracked now if they were not)."""
        assert category in CATEGORIES or category == IGNORED, f"category {category!r} not in {CATEGORIES + (IGNORED,)}"
        for t in tensors:
            if t is None:
                continue
            if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
                self.label((u for u in (getattr(t, a) for a in t.__tensor_flatten__()[0]) if isinstance(u, torch.Tensor)), category)
                continue
            if t.device.type != self.device_type or t.untyped_storage().nbytes() == 0:
                continue
            key = t.untyped_storage()._cdata
            if key not in self._live:
                self._track(t, category)
                continue
            entry = self._live[key]
            if entry[1] != category:
                self._sub(entry[1], entry[0])
                entry[1] = category
                self._add(category, entry[0])

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """What ops make inside exists but does not count (IGNORED) until :meth:`label` names a category for it:
        the work a GPU run does on the host, such as the data pipeline's epoch permutation and batch assembly."""
        prev, self._made = self._made, IGNORED
        try:
            yield
        finally:
            self._made = prev

    def reset_peak(self) -> None:
        self.peak = self.total
        self.peak_by_cat = dict(self.by_cat)

    @property
    def storages(self) -> int:
        return len(self._live)
