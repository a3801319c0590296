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
units, and the frozen, non-held weights of SDP's backward masking, which a layer still saves for its
input gradient); FSDP2 computes with bf16 unsharded *parameters* instead, and SDP's re-joined split
weights are rebuilt in backward rather than saved. So a copy of a parameter (or of a view of one)
made during the pass is not counted, like a parameter; otherwise the same forward would report the
bf16 weights as activations under DDP and SDP and not under FSDP. Which tensors are such copies is
recorded where they are made (:class:`_WeightCopies`, a dispatch mode that sees ``aten._to_copy`` of a
parameter), not read off the saved tensor: a trainable weight's cast points back at its parameter
through ``ToCopyBackward0``, but a frozen weight's cast has no ``grad_fn`` and looks like any other
tensor. Those copies are live memory all the same: the per-phase
peaks (:mod:`sdp.metrics.memory`; on the CPU tracker under ``activations``, the step's transients)
include them for every strategy. What still differs in bf16 is real: FSDP2 runs the ops autocast
leaves alone (embedding, norms) on bf16 parameters, so their outputs are bf16, where DDP's are fp32
and cast again by each layer that reads them.

The same meter runs on the meta device (the planner's prediction and the SDP planner's unit costs):
meta tensors have no address, so a storage is identified by its base tensor object, kept referenced
for the duration of the pass so that its identity cannot be reused.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

_active: list["SavedTensorMeter"] = []


class SavedTensorMeter:
    """Distinct storages kept for backward, with their byte sizes."""

    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._keep: list[torch.Tensor] = []  # meta bases, so their ids stay unique
        self._exclude = {_key(t, self._keep) for t in exclude}
        self._seen: dict[int, int] = {}
        self.copies = _WeightCopies()  # entered around the pass by measure_saved_tensors

    def add(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or _is_param(t) or self.copies.made(t):
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


class _WeightCopies(TorchDispatchMode):
    """The storages of the copies of parameters made while it is entered (``aten._to_copy`` of a parameter
    or of a view of one: autocast's casts of trainable and frozen weights alike), each forgotten when its
    storage dies, so that a later tensor at the same address is not taken for one. Nothing is kept alive."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}  # the C++ storage -> a weak reference to its Python object

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and args and _is_param(args[0])
                and isinstance(out, torch.Tensor) and not is_traceable_wrapper_subclass(out)):
            st = out.untyped_storage()
            key = st._cdata
            self._storages[key] = weakref.ref(st, lambda ref, key=key: self._forget(key, ref))
        return out

    def _forget(self, key: int, ref: weakref.ref) -> None:
        if self._storages.get(key) is ref:
            del self._storages[key]

    def made(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the tensor it views) is one of the copies."""
        return bool(self._storages) and not is_traceable_wrapper_subclass(t) and t.untyped_storage()._cdata in self._storages


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

    with meter.copies, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
