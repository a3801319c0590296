"""Count the collectives a library issues on our behalf (FSDP2, pipelining) by intercepting the
``torch.distributed`` functions it calls, for the duration of a ``with`` block.

Why intercept rather than estimate: FSDP2 and ``torch.distributed.pipelining`` decide themselves
how many all-gathers, reduce-scatters and sends a step needs (per-block groups, prefetching,
microbatches), so the only honest count is the one taken where they hand tensors to
``torch.distributed``. Both libraries look the functions up on the module at call time
(``dist.all_gather_single(...)``), so replacing the module attributes for the block catches them.

Only the outermost intercepted call is recorded (``all_gather_into_tensor`` may call
``all_gather_single`` inside; ``batch_isend_irecv`` calls ``isend``/``irecv``), so nothing is counted
twice. The nesting depth is per thread: a DDP comm hook that calls ``dist.all_reduce`` (torch's
PowerSGD hook, :mod:`sdp.parallel.powersgd`) issues its later collectives from its futures' callbacks,
which may run on the backend's threads while the backward thread is inside another intercepted call; a
depth shared by all threads would drop those records. ``isend``/``irecv`` are replaced in
``distributed_c10d`` as well, because ``P2POp`` checks its ``op`` by identity against that module's
functions. Collectives issued in C++ (DDP's reducer without a Python hook) are not seen here; plain DDP
counts its buckets in its own hook.
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from sdp.metrics.comm import CommCounter

# function name -> (recorded kind, name of the argument whose bytes are the payload)
# all_gather / reduce_scatter payloads are the full (unsharded) tensor, as sdp.metrics.comm expects.
INTERCEPTED: dict[str, tuple[str, str]] = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "send": ("send", "tensor"),
    "isend": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "irecv": ("recv", "tensor"),
}
P2P = ("send", "isend", "recv", "irecv")

_local = threading.local()  # .depth > 0 while this thread is inside an intercepted call: nested calls are the same collective


def _payload_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _counting(name: str, fn: Callable[..., Any], comm: CommCounter) -> Callable[..., Any]:
    kind, tensor_arg = INTERCEPTED[name]
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_local, "depth", 0)
        if depth == 0:
            bound = sig.bind_partial(*args, **kwargs)
            group = bound.arguments.get("group")
            size = 2 if name in P2P else dist.get_world_size(group)
            comm.record(kind=kind, payload=_payload_bytes(bound.arguments[tensor_arg]), group_size=size)
        _local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = depth

    return wrapper


@contextmanager
def count_collectives(comm: CommCounter) -> Iterator[CommCounter]:
    """Record every collective and point-to-point call made inside the block into ``comm``.

    Records go to ``comm``'s current phase ("train" during a step, "eval" during evaluation). Not
    re-entrant: nesting two counting blocks would count every call twice, so it is refused.
    """
    modules = (dist, c10d)
    saved = [(m, n, getattr(m, n)) for m in modules for n in INTERCEPTED if hasattr(m, n)]
    assert not any(getattr(f, "_sdp_counting", False) for _, _, f in saved), "count_collectives is already active"
    wrappers: dict[str, Callable[..., Any]] = {}
    for _, n, f in saved:
        if n not in wrappers:
            wrappers[n] = _counting(n, getattr(c10d, n, f), comm)
            wrappers[n]._sdp_counting = True  # type: ignore[attr-defined]
    try:
        for m, n, _ in saved:
            setattr(m, n, wrappers[n])
        yield comm
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
