"""``sdp-plan``'s meta stand-ins for SDP's gradient syncs in the peak rehearsal (:mod:`sdp.parallel.sdp_peaks`): the
overlapped owner-set buckets of :class:`sdp.subnet.sync.OwnerSetSync` and consolidation's world-averaged buckets of
:class:`sdp.subnet.world_sync.WorldSync` (``parallelism.consolidate_average=world``), one :func:`sync_stand_in`.

Why world averaging releases: under it every parameter gets a gradient, and the peak depends on when a
non-holder's copy is released: once its bucket is reduced, with one bucket in flight. Rehearsing the gradients without
that release would predict the full model's gradients (DDP's) where the ranks hold about two blocks' worth; the
release rule here is the runtime's (:meth:`WorldSync._launch_ready`, :meth:`WorldSync._finish`), on meta tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import torch



def sync_stand_in(sync: Any, *, overlap: bool, release: bool = False) -> Callable[[], None]:
    """Meta stand-in for ``sync``'s gradient buckets. ``overlap`` (OwnerSetSync's ``parallelism.overlap``): a gradient
    hook on every synced tensor counts its buckets down, and each ready prefix of the launch order allocates its
    flat buffers; without ``release`` they stay live until the sync finishes after backward (the returned callable:
    it allocates the buckets not launched yet, then frees them all), as OwnerSetSync's do. ``release``
    (:class:`~sdp.subnet.world_sync.WorldSync`, whose tensors are every parameter, all requiring gradients): every launched bucket but the
    last is finished at once, its flat dropped and its non-held gradients set to None; without ``overlap`` the
    callable runs every bucket in turn, one flat live at a time."""
    need: list[int] = []
    tensors: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for b, (_, items) in enumerate(sync.grad_buckets):
        mine = {id(t): t for t in (sync._tensor(p) for p in items)}
        need.append(len(mine))
        for key, t in mine.items():
            tensors.setdefault(key, (t, []))[1].append(b)
    order = sync.launch_order if overlap else list(range(len(sync.grad_buckets)))  # the runtime's (overlap: _arm's)
    left, launched = list(need), 0
    live: list[tuple[int, torch.Tensor]] = []

    def finish_one() -> None:
        b, _flat = live.pop(0)
        for p in sync.grad_buckets[b][1] if release else ():
            if sync.rank not in p.holders:
                sync._tensor(p).grad = None

    def launch(*, every: bool) -> None:
        nonlocal launched
        while launched < len(order):
            b = order[launched]
            if left[b] and not every:
                return
            live.append((b, torch.empty(sum(p.nbytes for p in sync.grad_buckets[b][1]), dtype=torch.uint8, device="meta")))
            launched += 1
            while release and len(live) > (1 if overlap else 0):
                finish_one()

    def hook_for(bs: list[int]) -> Callable[[torch.Tensor], None]:
        def hook(_t: torch.Tensor) -> None:
            for b in bs:
                left[b] -= 1
            launch(every=False)
        return hook

    for t, bs in tensors.values() if overlap else ():
        if t.requires_grad:  # a tensor without gradients never fires: finish() launches its bucket
            t.register_post_accumulate_grad_hook(hook_for(bs))

    def finish() -> None:
        nonlocal left, launched
        launch(every=True)
        while live:
            finish_one()
        left, launched = list(need), 0

    return finish
