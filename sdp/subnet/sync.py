"""Owner-set gradient averaging, refresh broadcasts and the piece collectives SDP needs.

Why one process group per distinct holder set: the averaged gradient of a unit is the mean over
its holders only (paper 1.4), so the all-reduce must run on exactly those ranks; a world all-reduce
with zeros for non-holders would move n/k times the bytes. Groups are created once at start-up, by
every rank, in one global order (``Plan.holder_sets`` order), because ``new_group`` is collective
over the world (:mod:`sdp.subnet.holder_groups`). Collectives are also issued in that global order on every rank: each rank's sequence
is a subsequence of one total order, so overlapping groups cannot deadlock.

Overlap (``parallelism.overlap``, default on): a post-accumulate-grad hook on every local tensor of a
bucket counts the bucket down during backward; a ready bucket is flattened and its all-reduce
launched at once (``async_op=True``), and :meth:`OwnerSetSync.reduce_grads` only waits, divides and
copies back before the optimizer step, as DDP's reducer does. Launches follow one global order that
every rank derives from the same piece list (buckets whose earliest piece comes last in the forward
first: backward reaches them first), each rank launching its own buckets in that order as soon as the
prefix is ready; so each rank's sequence is still a subsequence of one total order. A bucket's
contents, its group and its arithmetic (sum, then divide by its holder count) are those of the
non-overlapped path, so gradients are bit-identical (``tests/test_sdp_overlap.py``); only the time of
the launch moves. ``overlap=false`` is the blocking path after backward. A bucket holds consecutive
pieces of one holder set only, from consecutive blocks that hold a piece of it (:func:`holder_runs`): a
bucket spanning a holder set's blocks from the last to the first would be ready only at the end of
backward (measured, benchmarks/overlap.py).

Every call into torch.distributed is recorded with ``comm.record``. For a broadcast the source
records the payload and the receivers record 0 bytes (nothing sent) for the same collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sdp.core.distctx import flatten, unflatten
from sdp.metrics.comm import CommCounter
from sdp.subnet.holder_groups import GroupSet
from sdp.subnet.masking import Local, Piece, locate, view


def buckets(items: list[Piece], *, cap_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces packed into buckets of at most ``cap_bytes`` (a larger piece is alone)."""
    out: list[list[Piece]] = []
    size = 0
    for p in items:
        if out and size + p.nbytes <= cap_bytes:
            out[-1].append(p)
            size += p.nbytes
        else:
            out.append([p])
            size = p.nbytes
    return out


def region(p: Piece) -> tuple[Any, ...]:
    """A piece's region: its block's, or the stretch of tensors outside the blocks (embedding, stem, shortcuts,
    head): backward passes a region's tensors together, so buckets end at region boundaries."""
    return ("shared",) if p.block is None else ("block", p.block)


def holder_runs(items: list[Piece], *, holders: tuple[int, ...]) -> list[list[Piece]]:
    """The pieces of ``holders`` in maximal runs over consecutive *regions* of ``items`` (the model's order)
    that each hold a piece of ``holders``; a region is one block's tensors, or a stretch of tensors outside
    the blocks (embedding, stem, shortcuts, head), and a region holding no piece of ``holders`` ends a run.
    The byte cap then splits a run into buckets, as DDP's buckets are runs of consecutive tensors split by
    its cap. Why regions: a bucket is ready only once backward has reached its earliest piece, so a bucket
    that joined a holder set's last block with its first, across blocks it does not hold, would wait for
    nearly the whole backward pass and leave its all-reduce nothing to overlap with; but pieces of other
    holder sets inside a block do not delay it. At neuron level every block interleaves the unit slices
    of every holder set: ending runs at each slice made one collective per slice (129 all-reduces a step
    instead of 3 for the CPU study's N-SDP, 2.4x its step time). The runs depend on the piece list only,
    so they are the same on every rank."""
    mine = {region(p) for p in items if p.holders == holders}
    out: list[list[Piece]] = []
    open_run, current = False, None
    for p in items:
        if region(p) != current:
            current = region(p)
            open_run = open_run and current in mine  # a region holding no piece of ``holders`` ends the run
        if p.holders != holders:
            continue
        if open_run:
            out[-1].append(p)
        else:
            out.append([p])
            open_run = True
    return out


class OwnerSetSync:
    """Averages held gradients over their holder sets (or, ``mode="global"``, over the world
    divided by holder counts) and refreshes non-held parameters from their lowest holder.

    ``overlap``: launch each bucket's all-reduce from backward as soon as its gradients are ready
    (see the module docstring); :meth:`reduce_grads` then waits. :meth:`close` removes the hooks."""

    def __init__(self, *, rank: int, pieces: list[Piece], layout: dict[str, Local], groups: GroupSet,
                 comm: CommCounter, mode: str, bucket_cap_mb: float, overlap: bool = False) -> None:
        self.rank, self.layout, self.groups, self.comm, self.mode = rank, layout, groups, comm, mode
        self.params = [p for p in pieces if p.is_param]
        cap = int(bucket_cap_mb * 2**20)
        order = sorted({p.holders for p in self.params}, key=lambda h: (len(h), h))
        self.grad_buckets: list[tuple[tuple[int, ...], list[Piece]]] = []
        self.refresh_buckets: list[tuple[tuple[int, ...], list[Piece]]] = []
        if mode == "global":
            world = tuple(range(groups.n))
            self.grad_buckets = [(world, b) for b in buckets(self.params, cap_bytes=cap)]
        else:
            for h in order:
                mine = [p for p in self.params if p.holders == h]
                if rank in h and len(h) > 1:
                    self.grad_buckets += [(h, b) for run in holder_runs(self.params, holders=h)
                                          for b in buckets(run, cap_bytes=cap)]
                if mode == "backward" and len(h) < groups.n and rank in groups.refresh_set(h):
                    self.refresh_buckets += [(h, b) for b in buckets(mine, cap_bytes=cap)]
        self.overlap = overlap
        self._hooks: list[Any] = []
        self._inflight: list[tuple[Any, torch.Tensor, list[torch.Tensor], tuple[int, ...]]] = []
        if overlap:
            self._arm()

    # ---- overlap: hooks count buckets down, ready prefixes of the launch order are launched -------
    def _arm(self) -> None:
        index = {id(p): i for i, p in enumerate(self.params)}
        first = [min(index[id(p)] for p in items) for _, items in self.grad_buckets]
        # One order for every rank: latest-in-forward first; ties by holder set (identical everywhere).
        self.launch_order = sorted(range(len(self.grad_buckets)),
                                   key=lambda b: (-first[b], len(self.grad_buckets[b][0]), self.grad_buckets[b][0]))
        tensors: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self._need: list[int] = []
        for b, (_, items) in enumerate(self.grad_buckets):
            mine = {id(t): t for t in (self._tensor(p) for p in items)}
            self._need.append(len(mine))
            for key, t in mine.items():
                tensors.setdefault(key, (t, []))[1].append(b)
        for t, bs in tensors.values():
            if t.requires_grad:  # a tensor without gradients never fires: finish() launches its bucket
                self._hooks.append(t.register_post_accumulate_grad_hook(self._ready_hook(bs)))
        self._reset()

    def _reset(self) -> None:
        self._left = list(self._need)
        self._next = 0
        self._inflight = []

    def _tensor(self, p: Piece) -> torch.Tensor:
        spec = locate(p, self.layout)
        assert spec is not None, f"rank {self.rank} syncs {p.name} but does not hold it"
        return spec[0]

    def _ready_hook(self, bs: list[int]):  # type: ignore[no-untyped-def]
        def hook(_t: torch.Tensor) -> None:
            for b in bs:
                assert self._left[b] > 0, (f"rank {self.rank}: bucket {b} got a gradient again before reduce_grads() "
                                           "(two backward passes per step are not supported with parallelism.overlap=true)")
                self._left[b] -= 1
            self._launch_ready()

        return hook

    @torch.no_grad()
    def _launch_ready(self, *, all_: bool = False) -> None:
        while self._next < len(self.launch_order):
            b = self.launch_order[self._next]
            if self._left[b] and not all_:
                return
            h, items = self.grad_buckets[b]
            self._inflight.append(self._start(h, items, async_op=True))
            self._next += 1

    def close(self) -> None:
        """Remove the gradient hooks (the plan was re-drawn: a new sync replaces this one)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ---- one bucket ------------------------------------------------------------------------------
    def _grad_views(self, items: list[Piece]) -> list[torch.Tensor]:
        out = []
        for p in items:
            spec = locate(p, self.layout)
            assert spec is not None, f"rank {self.rank} syncs {p.name} but does not hold it"
            t, dim, start, length = spec
            if t.grad is None:
                t.grad = torch.zeros_like(t)
            out.append(view(t.grad, dim, start, length))
        return out

    def _start(self, h: tuple[int, ...], items: list[Piece], *, async_op: bool) -> tuple[Any, torch.Tensor, list[torch.Tensor], tuple[int, ...]]:
        """Flatten a bucket (global mode: non-held pieces zeroed first) and start its all_reduce(SUM)."""
        if self.mode == "global":
            for p in items:
                if self.rank not in p.holders:
                    self._grad_views([p])[0].zero_()
        views = self._grad_views(items)
        flat = flatten(views)
        self.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=len(h))
        work = dist.all_reduce(flat, group=self.groups.get(h), async_op=async_op)
        return work, flat, views, h

    def _finish(self, work: Any, flat: torch.Tensor, views: list[torch.Tensor], h: tuple[int, ...]) -> None:
        if work is not None:
            work.wait()
        if self.mode != "global":
            flat /= len(h)
        unflatten(flat, views)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """all_reduce(SUM) each bucket on its holder set's group, then divide by |H| (global mode: by
        each piece's holder count). With overlap, the launches happened during backward: wait here."""
        if self.overlap:
            self._launch_ready(all_=True)  # buckets with a tensor that got no gradient this step
            for pending in self._inflight:
                self._finish(*pending)
            self._reset()
        else:
            for h, items in self.grad_buckets:
                self._finish(*self._start(h, items, async_op=False))
        if self.mode == "global":
            for p in self.params:
                self._grad_views([p])[0].div_(len(p.holders))

    @torch.no_grad()
    def refresh(self) -> None:
        """Broadcast each holder set's updated parameters from its lowest holder to non-holders, every
        bucket through one flat buffer of the largest bucket's size: a buffer per bucket would leave the
        previous one to the backend's worker thread to free, so two could be live at once, by timing."""
        mine = [(h, items) for h, items in self.refresh_buckets if self.rank in self.groups.refresh_set(h)]
        if not mine:
            return
        tensors = [self._tensor(p) for _, items in mine for p in items]
        first = tensors[0]
        buffer = None
        if all(t.dtype == first.dtype for t in tensors):
            largest = max(sum(p.nbytes for p in items) for _, items in mine)
            buffer = torch.empty(largest // first.element_size(), dtype=first.dtype, device=first.device)
        for h, items in mine:
            broadcast_pieces(items, layout=self.layout, src=min(h), ranks=self.groups.refresh_set(h),
                             group=self.groups.get(self.groups.refresh_set(h)), rank=self.rank, comm=self.comm,
                             buffer=buffer)


def by_dtype(dtypes: list[torch.dtype]) -> list[list[int]]:
    """The indices of ``dtypes`` grouped by dtype, in first-appearance order (the same on every rank, and in
    ``sdp-plan``'s prediction, :mod:`sdp.parallel.sdp_traffic`): the flat buffers :func:`broadcast_pieces` sends."""
    return [[i for i, d in enumerate(dtypes) if d == dtype] for dtype in dict.fromkeys(dtypes)]


def broadcast_pieces(items: list[Piece], *, layout: dict[str, Local], src: int, ranks: tuple[int, ...], group: Any,
                     rank: int, comm: CommCounter, targets: list[torch.Tensor] | None = None,
                     buffer: torch.Tensor | None = None) -> None:
    """One flat broadcast of ``items`` from ``src`` to ``ranks`` (one per dtype where they mix); receivers write into their local
    storage (or into ``targets``, views in the same order, e.g. an assembled full model). ``buffer``:
    a flat tensor at least as large to use instead of a new one."""
    if rank not in ranks:
        return
    if targets is None:
        specs = [locate(p, layout) for p in items]
        assert all(s is not None for s in specs), f"rank {rank} lacks storage for {[p.name for p in items]}"
        targets = [view(t, d, s, n) for t, d, s, n in specs]  # type: ignore[misc]
    flats = by_dtype([t.dtype for t in targets])
    if len(flats) > 1:  # one flat per dtype: a single cat would promote an int64 count (BatchNorm's) to float32
        for mine in flats:
            broadcast_pieces([items[i] for i in mine], layout=layout, src=src, ranks=ranks, group=group, rank=rank,
                             comm=comm, targets=[targets[i] for i in mine], buffer=buffer)
        return
    numel = sum(v.numel() for v in targets)
    if buffer is not None and buffer.numel() >= numel and buffer.dtype == targets[0].dtype:
        flat = buffer[:numel]
        if rank == src:
            torch.cat([v.reshape(-1) for v in targets], out=flat)
    else:
        flat = flatten(targets) if rank == src else torch.empty(numel, dtype=targets[0].dtype, device=targets[0].device)
    comm.record(kind="broadcast", payload=flat.numel() * flat.element_size() if rank == src else 0, group_size=len(ranks))
    dist.broadcast(flat, src=src, group=group)
    if rank != src:
        unflatten(flat, targets)
