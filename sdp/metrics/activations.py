"""Activation memory: the bytes a forward pass keeps alive for backward, measured, not estimated.

Why saved-tensor hooks: every tensor autograd saves for backward passes through the innermost
``torch.autograd.graph.saved_tensors_hooks`` pack hook, so registering one around a forward sees the
whole activation footprint. Bytes are counted per distinct storage (views and tensors saved by
several ops count once) and parameters are excluded (weights saved by linear/conv layers are model
state, counted elsewhere): the ``exclude`` tensors given up front, and any ``nn.Parameter`` (or view
of one) met during the pass, which covers parameters created inside the forward (FSDP2's unsharded
parameters, SDP's re-joined neuron groups). Non-reentrant activation checkpointing installs its own
hooks inside a checkpointed region (whose tensors are then *not* kept) and keeps the region's inputs
alive for the recomputation outside autograd's saved tensors; code that checkpoints reports those
inputs with :func:`note_retained`, so the measurement stays complete.

Copies of the weights are model state, not activations, under every strategy alike. In bf16 a
linear or conv layer under autocast saves autocast's bf16 cast of its fp32 weight (DDP, SDP's whole
units); FSDP2 computes with bf16 unsharded *parameters* instead, and SDP's re-joined split weights
are rebuilt in backward rather than saved. So a tensor that is a cast of a parameter (or a view of
one: its grad_fn is ``ToCopyBackward0`` straight from the parameter's ``AccumulateGrad``) is not
counted, like a parameter; otherwise the same forward would report the bf16 weights as activations
under DDP and SDP and not under FSDP. Those copies are live memory all the same: the per-phase
peaks (:mod:`sdp.metrics.memory`; on the CPU tracker under ``activations``, the step's transients)
include them for every strategy. What still differs in bf16 is real: FSDP2 runs the ops autocast
leaves alone (embedding, norms) on bf16 parameters, so their outputs are bf16, where DDP's are fp32
and cast again by each layer that reads them.

The same meter runs on the meta device (the planner's prediction and the SDP planner's unit costs):
meta tensors have no address, so a storage is identified by its base tensor object, kept referenced
for the duration of the pass so that its identity cannot be reused.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

_active: list["SavedTensorMeter"] = []


class SavedTensorMeter:
    """Distinct storages kept for backward, with their byte sizes."""

    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._keep: list[torch.Tensor] = []  # meta bases, so their ids stay unique
        self._exclude = {_key(t, self._keep) for t in exclude}
        self._seen: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or _is_param(t) or _is_param_cast(t):
            return
        key = _key(t, self._keep)
        if key and key not in self._exclude and key not in self._seen:
            self._seen[key] = t.untyped_storage().nbytes()

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def tensors(self) -> int:
        return len(self._seen)


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _is_param_cast(t: torch.Tensor) -> bool:
    """A dtype cast of a trainable parameter (autocast's bf16 weight copy), or a view of one."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    src = fn.next_functions[0][0] if fn.next_functions else None
    return isinstance(getattr(src, "variable", None), nn.Parameter)


def _key(t: torch.Tensor, keep: list[torch.Tensor]) -> int:
    if hasattr(t, "to_local"):  # a DTensor (FSDP2's sharded parameters): its local shard's storage
        t = t.to_local()
    if t.device.type == "meta":
        base = t._base if t._base is not None else t
        keep.append(base)
        return id(base)
    return t.untyped_storage().data_ptr()


@contextmanager
def measure_saved_tensors(*, exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedTensorMeter]:
    """Count what the forward inside the block saves for backward (``exclude``: e.g. parameters)."""
    meter = SavedTensorMeter(exclude=exclude)

    def pack(t: torch.Tensor) -> torch.Tensor:
        meter.add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _active.append(meter)
        try:
            yield meter
        finally:
            _active.remove(meter)


def forward_saved_bytes(module: nn.Module, inputs: torch.Tensor, *,
                        loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Bytes one forward of ``module`` (then ``loss`` of its output, when given) keeps for backward,
    parameters excluded: the figure the trainer measures, here also run on the meta device by the
    SDP planner's unit costs and by ``sdp-plan``."""
    with torch.enable_grad(), measure_saved_tensors(exclude=list(module.parameters())) as meter:
        out = module(inputs)
        if loss is not None:
            loss(out)
    return meter.bytes


def note_retained(t: torch.Tensor) -> None:
    """Report a tensor kept alive for backward outside autograd's saved tensors (a checkpoint input)."""
    for meter in _active:
        meter.add(t)
