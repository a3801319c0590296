"""``train.precision``: the one compute-precision key every strategy obeys.

Why one key and one context: a bf16 FSDP run against fp32 everything else is not a comparison. Every
strategy runs its forward (and the loss) inside :func:`autocast`, entered from a single place
(:meth:`sdp.parallel.base.Strategy._forward_loss`; the pipeline stages call the same context from
their ``forward``), so the same ops run in the same dtype whatever the parallelism.

- ``fp32``: no autocast; everything in float32.
- ``bf16``: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around the forward and the loss.
  Parameters (master weights), gradients, optimizer state and every gradient all-reduce stay float32:
  autograd accumulates a gradient in its parameter's dtype, so DDP's buckets and SDP's holder-set
  buckets are float32 without a cast. CPU autocast supports bf16 too (matmuls and convolutions in
  bf16), so CPU runs exercise the same path. FSDP2 takes its ``MixedPrecisionPolicy`` from here
  (:func:`fsdp_policies`): bf16 parameters in compute (all-gathers in bf16), float32 reduce-scatter.

The former ``parallelism.mixed_precision`` (FSDP only) is gone; ``sdp.driver.config.RENAMED`` turns a stale
override into an error that names the new key.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

import torch

from sdp.errors import one_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TENSOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a tensor stored or sent at
# one of these widths (final weights, a gradient reduced in a narrower dtype): one table for every key that names one
PRECISIONS = tuple(DTYPES)  # train.precision's values (its schema field names this tuple)


def check(precision: object) -> str:
    """``train.precision`` as a valid name (raises ConfigError naming key, value and choices)."""
    one_of("train.precision", precision, PRECISIONS)
    return str(precision)


def autocast(*, precision: str, device: torch.device) -> AbstractContextManager:
    """The forward's precision context: autocast to bf16 on ``device``'s type, or nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    assert precision in DTYPES, f"precision={precision!r} not in {PRECISIONS}"
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


_META: list[torch.dtype] = []  # the planner's emulated autocast regions on meta (sdp.parallel.device_forward)


def lowered_dtype(*, device_type: str) -> torch.dtype | None:
    """The dtype autocast now runs linear and conv layers in on ``device_type``, None outside autocast; on
    meta (which has no autocast) that of the planner's emulation, so code that casts ahead of autocast
    (SDP's re-joined weights, :mod:`sdp.subnet.rejoin`) does the same in the rehearsal as on the ranks."""
    if device_type == "meta":
        return _META[-1] if _META else None
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


@contextmanager
def weight_cache_off() -> Iterator[None]:
    """The code run here casts a weight afresh at each use instead of through autocast's weight-cast cache: torch's
    one switch of that cache (``torch.set_autocast_cache_enabled``, what ``torch.autocast(cache_enabled=False)``
    sets), turned off and restored after; outside an autocast region nothing is cast, so nothing changes.

    Why (:mod:`sdp.parallel.ac`, a checkpointed block's forward and its recomputation run inside it): autocast caches
    the bf16 cast of every float32 leaf that requires grad until the outermost region ends, so under activation
    checkpointing the casts of every checkpointed block's weights, which the checkpoint itself does not keep, stay
    alive until the forward ends: a bf16 copy of the model beside the activations checkpointing saves. The cache
    spares no cast there (each weight is cast once in the forward and again in the recomputation, whose region the
    cache does not outlive), and a cast is exact, so every value is unchanged. The planner's emulation on meta
    (:class:`sdp.parallel.device_forward.Autocast`) reads the same switch, as torch's autocast does."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


@contextmanager
def meta_region(*, dtype: torch.dtype) -> Iterator[None]:
    """An autocast region of the planner's meta emulation (:func:`sdp.parallel.device_forward.device_forward`),
    what :func:`lowered_dtype` reports on meta while it is entered."""
    _META.append(dtype)
    try:
        yield
    finally:
        _META.pop()


def fsdp_policies(*, precision: str):  # type: ignore[no-untyped-def]
    """(policy for blocks and root, policy for BatchNorm layers) of FSDP2 under ``precision``.

    bf16: parameters all-gathered and computed in bf16, gradients reduced in float32 (torchtitan's
    recipe). BatchNorm layers get their own ``fully_shard`` in float32: their running statistics are
    float32 buffers, which ``batch_norm`` refuses to mix with bf16 weights (CPU: "expected scalar type
    BFloat16 but found Float"); autocast then casts their float32 output back for the next conv.
    fp32: FSDP2's default policy for both (no nested BatchNorm sharding).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy(), None
    return (MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32),
            MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
