"""Backward masking at neuron level: a partly held tensor re-joined from its parts for each call of its layer.

Under backward masking a tensor a rank holds only some hidden groups of is split by
:func:`sdp.subnet.masking.apply` into a held Parameter (trained) and a frozen rest, so autograd computes
no weight gradient for the rest; the layer still needs the full tensor, in global order, in every forward.
:func:`_split_forward` wraps the layer's forward to join it for the call only, and keeps autograd from
holding the joined copy until backward (a :class:`_Rejoin` recipe is saved instead).

Why a module of its own: this is the one place where masking reaches into autograd (saved-tensor hooks,
autocast dtypes, storage identity) and into the activation meters; what is held where (pieces, layouts,
forward masking) lives in :mod:`sdp.subnet.masking` and needs none of it.
"""

from __future__ import annotations

import torch
from torch import nn

from sdp.core.precision import lowered_dtype


class _DeviceIndex:
    """An index tensor that lives where it is used: created once at masking time (on the CPU, where
    the model is pruned), moved to the compute device at the first forward, then reused every step
    (no host-to-device copy per forward)."""

    def __init__(self, index: torch.Tensor) -> None:
        self.index = index

    def on(self, device: torch.device) -> torch.Tensor:
        if self.index.device != device:
            self.index = self.index.to(device)
        return self.index


_LOWERED = (nn.Linear, nn.modules.conv._ConvNd)  # autocast runs these in its lower-precision dtype


def _join(module: nn.Module, leaf: str, dim: int, index: _DeviceIndex, *, dtype: torch.dtype | None) -> torch.Tensor:
    """The full tensor ``leaf`` in global order, from its held and rest parts (cast to ``dtype`` first)."""
    held, rest = getattr(module, leaf + "_held"), getattr(module, leaf + "_rest")
    if dtype is not None:
        held, rest = held.to(dtype), rest.to(dtype)
    joined = torch.cat([held, rest], dim)
    return joined.index_select(dim, index.on(joined.device))


class _Rejoin:
    """What autograd keeps instead of a re-joined full tensor (or a view of it, e.g. a linear layer's
    transposed weight): how to rebuild it in backward."""

    def __init__(self, leaf: str, dim: int, index: _DeviceIndex, dtype: torch.dtype, t: torch.Tensor) -> None:
        self.leaf, self.dim, self.index, self.dtype = leaf, dim, index, dtype
        self.view = (tuple(t.shape), t.stride(), t.storage_offset())

    def rebuild(self, module: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return _join(module, self.leaf, self.dim, self.index, dtype=self.dtype).as_strided(*self.view)


def _views(t: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``t`` is ``w`` or a view of it (same storage; on meta, where storages have no
    address, by object identity)."""
    if t is w or t._base is w:
        return True
    return (t.device == w.device and t.device.type != "meta" and t.dtype == w.dtype
            and t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr())


def _split_forward(module: nn.Module, specs: list[tuple[str, int, _DeviceIndex]]):  # type: ignore[no-untyped-def]
    """``module``'s forward with its split parameters re-joined for the call only.

    Why a forward wrapper with saved-tensor hooks: a conv or linear layer saves its weight for the
    input gradient, so a re-joined full-size weight would stay alive until backward, counted as
    activation memory although the held and rest parts (parameters, alive anyway) hold the same
    values. Inside the call, a saved tensor that *is* a re-joined weight is replaced by a
    :class:`_Rejoin` recipe and rebuilt from the parts when backward unpacks it (transient, one layer
    at a time; the parts do not change between forward and backward). Every other saved tensor is
    kept as is and reported to the activation meters (:func:`sdp.metrics.activations.note_retained`),
    whose own pack hook this innermost one shadows. Under autocast the weight of a conv/linear is
    joined directly in the autocast dtype, so that the tensor the layer saves is the joined one.
    """
    from sdp.metrics.activations import note_retained

    inner = module.forward

    def unpack(saved: object) -> torch.Tensor:
        return saved.rebuild(module) if isinstance(saved, _Rejoin) else saved  # type: ignore[return-value]

    def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        joined: list[tuple[torch.Tensor, str, int, _DeviceIndex]] = []
        for leaf, dim, index in specs:
            held = getattr(module, leaf + "_held")
            dev = held.device.type
            lowered = leaf == "weight" and isinstance(module, _LOWERED)
            w = _join(module, leaf, dim, index, dtype=lowered_dtype(device_type=dev) if lowered else None)
            object.__setattr__(module, leaf, w)
            joined.append((w, leaf, dim, index))

        def pack(t: torch.Tensor) -> object:
            for w, leaf, dim, index in joined:
                if _views(t, w):
                    return _Rejoin(leaf, dim, index, w.dtype, t)
            note_retained(t)
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return inner(*args, **kwargs)
        finally:
            for leaf, _, _ in specs:
                object.__delattr__(module, leaf)  # no full-size copy outlives the call

    return forward
