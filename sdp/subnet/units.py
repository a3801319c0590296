"""The SDP units a model declares and what each costs (pure functions of the model, no process group).

Apart from :mod:`sdp.subnet.plan` (which assigns the units to workers) because both masking and the
planner need the declarations, and the costs are a property of the model alone (not of n, C, the
assignment or the draw), measured once on the meta device: :func:`measure_block_costs` says how.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from sdp.metrics.activations import forward_saved_bytes
from sdp.models.base import LEVELS, ResidualBlock, SDPModel
from sdp.subnet.assign import PlanError

__all__ = ["cross_sliced", "declare_units", "measure_block_costs", "sliced_names"]

def declare_units(model: SDPModel, *, level: str, groups: int, drop_downsample: bool) -> list[tuple[int, int | None]]:
    """(block index, group) of every unit, from the model's declarations."""
    if level not in LEVELS:
        raise PlanError(f"parallelism.level={level!r} is invalid: allowed: {', '.join(LEVELS)}")
    if level == "neuron" and not any(block.hidden_dims() for _, block in model.sdp_units()):
        raise PlanError(
            f"parallelism.level='neuron' is invalid for model {type(model).__name__}: none of its blocks "
            f"declares hidden dims (ResidualBlock.hidden_dims), so there are no neurons to split; allowed: block"
        )
    out: list[tuple[int, int | None]] = []
    for b, block in model.sdp_units():
        if block.shared_submodules() and not drop_downsample:
            continue  # ResIST: a downsampling block stays whole and shared
        dims = block.hidden_dims() if level == "neuron" else ()
        if dims and (cross := cross_sliced(block)):
            tensor, by = next(iter(cross.items()))
            raise PlanError(
                f"parallelism.level='neuron' is not supported for model {type(model).__name__}: blocks.{b} "
                f"({type(block).__name__}) has {tensor} sliced by two hidden dims, {' and '.join(by)}; a piece of "
                f"it would be held by the workers that hold both groups, which neuron-level masking, sync and "
                f"assembly do not implement; allowed: parallelism.level=block"
            )
        for d in dims:
            if groups < 1 or d.size % groups:
                raise PlanError(
                    f"parallelism.groups={groups} does not split hidden dim {d.name!r} of blocks.{b} "
                    f"(size {d.size}) into equal groups; use a divisor of {d.size}"
                )
        out.extend((b, g) for g in range(groups)) if dims else out.append((b, None))
    if not out:
        raise PlanError(f"model {type(model).__name__} declares no SDP units (drop_downsample={drop_downsample})")
    return out


def cross_sliced(block: ResidualBlock) -> dict[str, list[str]]:
    """Tensor name -> the hidden dims slicing it ("name (dim d)"), for every tensor of ``block`` that
    more than one slice indexes (a Bottleneck's 3x3 conv: its inputs are one hidden width, its outputs
    another). Why refused at neuron level: a piece of such a tensor belongs to a pair of groups."""
    by: dict[str, list[str]] = {}
    for d in block.hidden_dims():
        for s in d.slices:
            by.setdefault(s.tensor, []).append(f"{d.name} (dim {s.dim})")
    return {t: ds for t, ds in by.items() if len(ds) > 1}


def sliced_names(block: ResidualBlock) -> dict[str, tuple[int, int]]:
    """Relative tensor name -> (dim, elements per hidden unit) for every HiddenSlice of ``block``."""
    out: dict[str, tuple[int, int]] = {}
    for d in block.hidden_dims():
        for s in d.slices:
            assert s.tensor not in out, f"{s.tensor} is sliced by two hidden dims of {type(block).__name__}"
            out[s.tensor] = (s.dim, d.unit_width)
    return out


def measure_block_costs(model: SDPModel) -> dict[int, tuple[float, float]]:
    """Per block (FLOPs of forward+backward of the residual branch, bytes holding the block adds to
    what the model keeps for backward) per sample, measured by running on the meta device (no memory,
    no compute).

    The bytes are what the measurement counts (:mod:`sdp.metrics.activations`), taken in context:
    the whole model's saved bytes minus those of the model with this one block skipped. A block
    measured alone would count its input, which in a ResNet the previous ReLU keeps anyway (25 % too
    much for a CIFAR ResNet-18 stage-1 block), and would miss that a dropped downsampling block still
    keeps its projection shortcut's tensors; in context both come out right, so the plan balances the
    memory it is judged on."""
    meta = model if next(model.parameters()).is_meta else None
    if meta is None:
        import copy

        meta = copy.deepcopy(model).to("meta")
    out: dict[int, tuple[float, float]] = {}
    inputs = meta.example_input(2).to("meta")  # 2 samples: BatchNorm refuses one value per channel
    with torch.enable_grad():
        kept_all = forward_saved_bytes(meta, inputs)
        x = meta.stem(inputs)
        for b, block in enumerate(meta.blocks):
            if isinstance(block, ResidualBlock):
                with FlopCounterMode(display=False) as full:
                    y = block.forward_full(x)
                with FlopCounterMode(display=False) as skip:
                    block.forward_skip(x)
                block.active = False
                try:
                    kept_without = forward_saved_bytes(meta, inputs)
                finally:
                    block.active = True
                out[b] = (1.5 * (full.get_total_flops() - skip.get_total_flops()), (kept_all - kept_without) / 2.0)
                x = y
            else:
                x = block(x)
    return out
