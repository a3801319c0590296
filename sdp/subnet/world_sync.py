"""Consolidation's world-averaged gradients (``parallelism.consolidate_average=world``): every block's gradient
averaged over all ranks, kept (with its optimizer state) on the block's holders only.

Why: under backward masking a block's gradient is the mean over its k holders, so at C = 0.5 each block learns from
half the global batch. The LM study's control (consolidation at C = 1, REPORT.md's depth table) put the rest of
consolidation's gap to DDP on that average. Here every rank computes every block's weight gradient (the non-held
parameters require gradients during consolidation, but are not in the optimizer), the world sums each block's
gradient in one all-reduce and divides by n, and only the holders keep the result: a non-holder frees its copy as
soon as the bucket is reduced. So the gradient each held block steps with is DDP's, while the optimizer state stays
the holders' (1/k of DDP's replicas: ZeRO-1's sharding at replication k) and the non-held weights are refreshed from
their lowest holder after each update, as backward masking refreshes them (:meth:`OwnerSetSync.refresh`).

Memory: a non-held gradient lives from its accumulation until its bucket is reduced. Buckets are the blocks (each
block's pieces, split by ``bucket_cap_mb``; the pieces outside the blocks form their own), reduced in the backward
order, and at most one bucket is in flight: when the next is launched the previous is waited for, copied back and its
non-held gradients freed. So a rank's transient gradient is about two blocks' worth beyond its held ones, not the
model's (``sdp-plan`` rehearses the same release: :func:`sdp.parallel.sdp_peaks.consolidate_peaks`). Traffic: one
all-reduce of every parameter over the world per step (DDP's bytes) plus backward masking's refresh broadcasts.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

import torch

from sdp.metrics.comm import CommCounter
from sdp.subnet.holder_groups import GroupSet
from sdp.subnet.masking import Local, Piece
from sdp.subnet.sync import OwnerSetSync, buckets, region

AVERAGES = ("holders", "world")  # parallelism.consolidate_average: over a block's holders (backward masking's) | all ranks


def average_of(cfg: Any) -> str:
    """``consolidate_average`` of the ``parallelism`` node ``cfg``, the one reader of the key (the strategy, its
    budget phase, ``sdp-plan``'s traffic and peaks, validation); a config recorded before the key existed: holders."""
    return str(cfg.get("consolidate_average", AVERAGES[0]))


def region_buckets(items: list[Piece], *, cap_bytes: int) -> list[list[Piece]]:
    """``items`` (the model's order) cut at every :func:`~sdp.subnet.sync.region` boundary, each region split by
    ``cap_bytes``: a bucket is ready when backward has passed its block, and a non-holder's
    copy of it can be freed then (module docstring)."""
    return [b for _, run in groupby(items, key=region) for b in buckets(list(run), cap_bytes=cap_bytes)]


class WorldSync(OwnerSetSync):
    """:class:`OwnerSetSync` under backward masking whose gradient buckets hold every parameter piece, reduced over
    the world and divided by n; non-held pieces' gradients are freed once their bucket is reduced (module
    docstring). The refresh buckets and the launch order are the base class's."""

    def __init__(self, *, rank: int, pieces: list[Piece], layout: dict[str, Local], groups: GroupSet,
                 comm: CommCounter, bucket_cap_mb: float, overlap: bool = False) -> None:
        super().__init__(rank=rank, pieces=pieces, layout=layout, groups=groups, comm=comm, mode="backward",
                         bucket_cap_mb=bucket_cap_mb, overlap=False)
        assert all(p.dim is None for p in self.params), \
            f"world-averaged consolidation is built for block level (whole tensors): {[p.name for p in self.params if p.dim is not None][:3]}"
        world = tuple(range(groups.n))
        self.grad_buckets = [(world, b) for b in region_buckets(self.params, cap_bytes=int(bucket_cap_mb * 2**20))]
        self._items: dict[int, list[Piece]] = {}  # id(flat) -> the bucket's pieces, until it is finished
        self.overlap = overlap
        if overlap:
            self._arm()

    def _start(self, h: tuple[int, ...], items: list[Piece], *, async_op: bool) -> tuple[Any, torch.Tensor, list[torch.Tensor], tuple[int, ...]]:
        started = super()._start(h, items, async_op=async_op)
        self._items[id(started[1])] = items
        return started

    def _finish(self, work: Any, flat: torch.Tensor, views: list[torch.Tensor], h: tuple[int, ...]) -> None:
        """The base class's (wait, divide by n, copy back), then every non-held piece's gradient freed."""
        super()._finish(work, flat, views, h)
        for p in self._items.pop(id(flat)):
            if self.rank not in p.holders:
                self._tensor(p).grad = None

    @torch.no_grad()
    def _launch_ready(self, *, all_: bool = False) -> None:
        """The base class's launches, then every bucket but the last launched finished: one in flight at a time."""
        super()._launch_ready(all_=all_)
        while len(self._inflight) > 1:
            self._finish(*self._inflight.pop(0))
