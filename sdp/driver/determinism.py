"""Which operations of a model have no deterministic CUDA implementation, found before any rank starts.

Why: under ``train.deterministic=true`` PyTorch raises (``torch.use_deterministic_algorithms``) the first
time such an operation runs, i.e. inside every rank at the first step, after the allocation is paid for.
:func:`nondeterministic_cuda_ops` runs one training step of the model on the meta device (nothing is
computed) under a dispatch mode that records every ATen operation of the forward, the loss and the
backward, and names those PyTorch lists as raising on CUDA (:data:`RAISING_ON_CUDA`, from the docstring of
``torch.use_deterministic_algorithms``). The operations recorded are the ones CUDA runs wherever PyTorch
decomposes a module the same way on every device: ``AdaptiveAvgPool2d(1)`` becomes a mean over the spatial
dims (deterministic) and is not reported; ``AdaptiveAvgPool2d(2)`` runs ``_adaptive_avg_pool2d``, whose
CUDA backward has no deterministic kernel, and is. Kernels only CUDA has (fused attention) are not seen.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch.utils._python_dispatch import TorchDispatchMode

from sdp.core.loss import loss_fn
from sdp.registry import build


def _always(args: dict[str, Any]) -> bool:
    return True


# ATen operation (overload packet) -> (what PyTorch's list calls it, when it raises given the call's arguments by name).
RAISING_ON_CUDA: dict[str, tuple[str, Callable[[dict[str, Any]], bool]]] = {
    "aten.avg_pool3d_backward": ("AvgPool3d backward", _always),
    "aten._adaptive_avg_pool2d_backward": ("AdaptiveAvgPool2d backward (output size other than 1)", _always),
    "aten._adaptive_avg_pool3d_backward": ("AdaptiveAvgPool3d backward (output size other than 1)", _always),
    "aten.adaptive_max_pool2d_backward": ("AdaptiveMaxPool2d backward", _always),
    "aten.fractional_max_pool2d_backward": ("FractionalMaxPool2d backward", _always),
    "aten.fractional_max_pool3d_backward": ("FractionalMaxPool3d backward", _always),
    "aten.max_unpool2d": ("MaxUnpool1d/2d", _always),
    "aten.max_unpool3d": ("MaxUnpool3d", _always),
    "aten.upsample_linear1d_backward": ("interpolate(mode='linear') backward", _always),
    "aten.upsample_bilinear2d_backward": ("interpolate(mode='bilinear') backward", _always),
    "aten._upsample_bilinear2d_aa_backward": ("interpolate(mode='bilinear', antialias=True) backward", _always),
    "aten.upsample_bicubic2d_backward": ("interpolate(mode='bicubic') backward", _always),
    "aten._upsample_bicubic2d_aa_backward": ("interpolate(mode='bicubic', antialias=True) backward", _always),
    "aten.upsample_trilinear3d_backward": ("interpolate(mode='trilinear') backward", _always),
    "aten.reflection_pad1d_backward": ("ReflectionPad1d backward", _always),
    "aten.reflection_pad2d_backward": ("ReflectionPad2d backward", _always),
    "aten.reflection_pad3d_backward": ("ReflectionPad3d backward", _always),
    "aten.nll_loss2d_forward": ("NLLLoss over spatial targets, reduced", lambda a: a.get("reduction") != 0),
    "aten._ctc_loss_backward": ("CTCLoss backward", _always),
    "aten._embedding_bag_dense_backward": ("EmbeddingBag(mode='max') backward", lambda a: a.get("mode") == 2),
    "aten.put_": ("Tensor.put_", _always),
    "aten.put": ("Tensor.put", _always),
    "aten.histc": ("histc", _always),
    "aten.bincount": ("bincount with weights", lambda a: a.get("weights") is not None),
    "aten.median": ("median with indices", lambda a: "dim" in a),
    "aten.nanmedian": ("nanmedian with indices", lambda a: "dim" in a),
    "aten.grid_sampler_2d_backward": ("grid_sample backward", _always),
    "aten.grid_sampler_3d_backward": ("grid_sample backward", _always),
    "aten.scatter_reduce": ("scatter_reduce(reduce='prod')", lambda a: a.get("reduce") == "prod"),
    "aten.scatter_reduce_": ("scatter_reduce_(reduce='prod')", lambda a: a.get("reduce") == "prod"),
}


def _by_name(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by their names in the operation's schema (positional and keyword)."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


class _Recorder(TorchDispatchMode):
    """Names of the :data:`RAISING_ON_CUDA` operations dispatched while active, in first-seen order."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        entry = RAISING_ON_CUDA.get(str(func.overloadpacket))
        if entry is not None and entry[1](_by_name(func, args, kwargs)):
            self.found.setdefault(str(func.overloadpacket), entry[0])
        return func(*args, **kwargs)


def nondeterministic_cuda_ops(model_cfg: DictConfig) -> dict[str, str]:
    """``{aten op: what it is}`` for every operation of one training step of the model built from
    ``model_cfg`` (forward on ``example_input(2)``, the suite's loss, backward) that raises on CUDA under
    ``torch.use_deterministic_algorithms(True)``; empty when there is none."""
    with torch.device("meta"):
        model = build(model_cfg)
    model.train()
    inputs = model.example_input(2).to("meta")  # two samples: BatchNorm needs more than one value per channel
    with _Recorder() as recorder:
        out = model(inputs)
        targets = torch.zeros(out.shape[:-1], dtype=torch.long, device="meta")
        loss_fn(out, targets).backward()
    return recorder.found
