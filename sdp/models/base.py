"""The one interface every model implements: stem -> blocks -> head, with declared SDP units.

Why one template for every architecture: SDP, the pipeline baseline, stochastic depth and the
measurement code all need the same facts about a model (which residual blocks exist, which hidden
widths may be split, what is shared, where the model may be cut into stages, how many FLOPs a sample
costs). A model that is ``head(blocks(stem(x)))`` with typed declarations answers all of them, so no
strategy ever inspects a concrete architecture.

- ``stem`` and ``head`` are always *shared* by all SDP workers.
- ``blocks`` is an ``nn.ModuleList``; each entry is a :class:`ResidualBlock` (an SDP unit at block
  level) or any other module (shared, e.g. a patch-merging layer).
- A :class:`ResidualBlock` declares the hidden widths neuron-level SDP may split
  (:class:`HiddenDim`) and the sub-modules that stay shared when the block is dropped (a projection
  shortcut). Its forward honours ``active`` (False = identity on the residual path, the branch is
  never executed), ``branch_scale`` (stochastic-depth style rescaling of the whole branch) and, at
  neuron level, a scale on the output of each split sub-branch only (``HiddenDim.branch``).
- Pipeline split points are the block boundaries: stage boundaries are indices into ``blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

LEVELS = ("block", "neuron")  # what SDP splits a model by: its residual blocks, or their hidden dims (HiddenDim)


@dataclass(frozen=True)
class HiddenSlice:
    """One tensor (parameter or buffer) of a block that is indexed by a hidden dimension.

    ``tensor`` is the dotted name relative to the block (``"conv1.weight"``), ``dim`` the axis that
    the hidden units run along.
    """

    tensor: str
    dim: int


@dataclass(frozen=True)
class HiddenDim:
    """A hidden width inside a block that neuron-level SDP may split into groups.

    ``size`` hidden units, each ``unit_width`` elements wide along every slice's ``dim`` (1 for
    channels or MLP units, ``head_dim`` for attention heads). The residual stream is never a
    HiddenDim.

    ``branch`` names the sub-module of the block (relative name) that runs this dim's units and whose
    output is their sum (``"feed_forward"``, ``"attention"``), or ``""`` when that is the whole
    residual branch (ResNet, the residual MLP). Why one name: it is the single declaration of what a
    worker holding some of the units narrows and what it leaves whole. Neuron-level SDP counts that
    sub-module's FLOPs as narrowed (:func:`sdp.metrics.flops.masked_fraction`) and rescales only what
    its split units produce (:meth:`ResidualBlock.set_scale`, read in ``forward_full`` through
    :meth:`ResidualBlock.scale_of`); everything else in the block (attention that no dim splits, an
    output bias) every holder computes in full, so it is neither counted as narrowed nor rescaled.
    """

    name: str
    size: int
    slices: tuple[HiddenSlice, ...]
    branch: str
    unit_width: int = 1


class ResidualBlock(nn.Module):
    """Base of every SDP block unit: a residual computation that can be skipped or rescaled.

    Subclasses implement ``forward_full(x)`` (the real block, multiplying every residual branch by
    ``self.branch_scale`` and what the split units of each declared sub-branch produce by
    ``self.scale_of(branch)``, e.g. through :func:`split_output`) and may override ``forward_skip(x)``
    (what the block computes when its residual branch is dropped: identity by default, the projection
    shortcut for a downsampling block). ``hidden_dims()`` and ``shared_submodules()`` declare the
    block to SDP.
    """

    # True when the residual branch ends in a normalisation layer (ResNet's last BatchNorm), so the
    # branch's output magnitude does not grow with the number of hidden units summed into it once the
    # norm's statistics describe the evaluated model; SDP's ``rescale=auto`` reads it (neuron level).
    normalised_branch: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.active: bool = True
        self.branch_scale: float = 1.0  # the whole residual branch (block level, stochastic depth)
        self.hidden_scales: dict[str, float] = {}  # HiddenDim.branch -> scale of its split units' output
        # SDP's assembly calibration: (gate vector, branch -> index) while gates are fitted (:mod:`sdp.models.gates`)
        self.gates: tuple[torch.Tensor, dict[str, int]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.forward_full(x) if self.active else self.forward_skip(x)

    def gain(self, branch: str) -> float | torch.Tensor:
        """The factor on residual branch ``branch``'s output (a key of :meth:`gated_branches`): its scalar gate
        while assembly calibration fits one (the gate replaces ``branch_scale``, initialised at its value), else
        ``branch_scale``. Why one method: calibration generalises the fixed k/n factor to one fitted scalar per
        branch, so every forward reads the factor here and nothing else changes."""
        if self.gates is None:
            return self.branch_scale
        vector, index = self.gates
        return vector[index[branch]]

    def gated_branches(self) -> dict[str, tuple[str, ...]]:
        """Residual branch name -> the tensors (names relative to the block) its output is linear in at its end:
        the last linear layer's weight and bias, or the closing norm's scale and shift. A scalar gate on the
        branch folds into the block exactly by multiplying them (:func:`sdp.models.gates.fold`), so a calibrated
        model is a plain model. Empty (default): the block declares none and assembly calibration refuses it."""
        return {}

    def scale_of(self, branch: str) -> float:
        """The factor ``forward_full`` puts on what the split units of sub-branch ``branch``
        (``HiddenDim.branch``) produce, on top of ``branch_scale``; 1 for what no hidden dim splits."""
        return self.hidden_scales.get(branch, 1.0)

    def set_scale(self, scale: float, *, split: bool) -> None:
        """Scale this unit for workers that each compute only part of it. ``split=False`` (the unit is the
        whole block: block level, or a block without hidden dims): the whole residual branch, since a
        dropped block contributes nothing. ``split=True`` (neuron level): only the output of the split
        units of every declared sub-branch; what every holder computes in full keeps scale 1."""
        self.branch_scale = 1.0 if split else scale
        self.hidden_scales = {d.branch: scale for d in self.hidden_dims()} if split else {}

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_skip(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        """Hidden widths neuron-level SDP may split; empty when the block declares none."""
        return ()

    def shared_submodules(self) -> tuple[str, ...]:
        """Sub-module names (relative) that belong to every worker even when the block is dropped."""
        return ()

    def branch_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) pairs of the residual branch: everything not in a shared sub-module."""
        shared = self.shared_submodules()
        for name, p in self.named_parameters():
            if not any(name == s or name.startswith(s + ".") for s in shared):
                yield name, p


class SDPModel(nn.Module):
    """``head(blocks(stem(x)))`` with the declarations strategies need.

    Subclasses build ``self.stem``, ``self.blocks`` (``nn.ModuleList``) and ``self.head`` and set
    ``self.task`` (``"classification"`` or ``"lm"``). ``flops_per_sample`` is the forward+backward
    FLOP count of one sample (one sequence for LMs), used for FLOP-matched budgets and MFU.
    """

    stem: nn.Module
    blocks: nn.ModuleList
    head: nn.Module
    task: str = "classification"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    # ---- declarations -------------------------------------------------------------------------
    def sdp_units(self) -> list[tuple[int, ResidualBlock]]:
        """(index in ``blocks``, block) for every block that is an SDP unit."""
        return [(i, b) for i, b in enumerate(self.blocks) if isinstance(b, ResidualBlock)]

    def shared_modules(self) -> list[str]:
        """Module names (relative to the model) that every worker holds in full."""
        names = ["stem", "head"]
        for i, block in enumerate(self.blocks):
            if not isinstance(block, ResidualBlock):
                names.append(f"blocks.{i}")
            else:
                names.extend(f"blocks.{i}.{s}" for s in block.shared_submodules())
        return names

    def pipeline_split_points(self) -> list[int]:
        """Indices ``i`` such that a stage may start at ``blocks[i]`` (every block boundary)."""
        return list(range(1, len(self.blocks)))

    def flops_per_sample(self) -> int:
        """Training FLOPs (forward + backward, counted as 3x forward) of one sample.

        Default: the forward FLOPs torch's ``FlopCounterMode`` counts (matmuls, convolutions,
        attention) on ``example_input(1)``, measured once on the meta device (see
        :func:`count_forward_flops`); one sample of an LM is one ``max_seq_len`` sequence.
        """
        cached = getattr(self, "_flops_per_sample", None)
        if cached is None:
            cached = 3 * count_forward_flops(self, self.example_input(1))
            self._flops_per_sample = cached
        return cached

    def init_module(self, module: nn.Module) -> bool:
        """The model's own initialisation of one module, run after the module's ``reset_parameters``
        when it is materialised from the meta device (:mod:`sdp.models.init`, seeded per module).
        Returns True when it initialised every tensor the module owns directly (needed for modules
        without ``reset_parameters``); the default does nothing and returns False."""
        return False

    def example_input(self, batch_size: int) -> torch.Tensor:
        """A correctly shaped dummy input (used by planners, tracers and shape tests)."""
        raise NotImplementedError(f"{type(self).__name__} does not declare example_input")


def split_output(layer: nn.Module, x: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``layer(x)`` for a layer whose inputs are split hidden units (a sub-branch's output projection),
    with what those units produce multiplied by ``scale`` and the layer's bias not: ``scale * W x + b``.
    Why the bias stays: it is added once whatever the number of units summed, so a holder of some units
    trained it at full size. Runs ``layer``'s own forward (backward masking wraps it), so the bias is
    taken back out of the scaled output rather than the weight applied by hand."""
    y = layer(x)
    if scale == 1.0:
        return y
    bias = getattr(layer, "bias", None)
    if bias is None:
        return y * scale
    assert bias.dim() == 1 and y.shape[-1] == bias.shape[0], \
        f"{type(layer).__name__}: bias {tuple(bias.shape)} does not run along the output's last dim {tuple(y.shape)}"
    return torch.add(y * scale, bias.to(y.dtype), alpha=1.0 - scale)


def count_forward_flops(module: nn.Module, inputs: torch.Tensor) -> int:
    """Forward FLOPs of ``module(inputs)`` (see :func:`forward_flop_counts`)."""
    return _flop_counts(module, inputs)["Global"]


def forward_flop_counts(model: SDPModel) -> dict[str, int]:
    """Forward FLOPs of one sample per module, keyed like FlopCounterMode (``"Global"`` = total,
    ``"<Class>.blocks.3"`` = one block)."""
    return _flop_counts(model, model.example_input(1))


def _flop_counts(module: nn.Module, inputs: torch.Tensor) -> dict[str, int]:
    """Per-module forward FLOPs as ``torch.utils.flop_counter`` counts them, run on the meta device
    (:func:`meta_forward`: on meta, attention decomposes into two counted matmuls over the full T x T scores,
    causal or not; on CPU, SDPA's fused kernel is invisible to the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    meta_forward(module, inputs, under=counter)
    return {name: int(sum(ops.values())) for name, ops in counter.get_flop_counts().items()}


def meta_forward(module: nn.Module, inputs: torch.Tensor, *, under: Any) -> None:
    """Run ``module``'s evaluation forward on ``inputs`` on the meta device under ``under`` (a mode that observes the
    ops: the FLOP counter, :func:`sdp.parallel.ac_op.recomputed_flops`'s matmul count).

    Why meta: nothing is computed (a 1B-parameter LM costs milliseconds), no weights are copied
    (``functional_call`` swaps in meta stand-ins) and BatchNorm statistics stay untouched."""
    from torch.func import functional_call

    stand_ins = {n: torch.empty_like(t, device="meta") for n, t in module.named_parameters(remove_duplicate=False)}
    stand_ins |= {n: torch.empty_like(t, device="meta") for n, t in module.named_buffers(remove_duplicate=False)}
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), under:
            functional_call(module, stand_ins, (inputs.to("meta"),), tie_weights=False)
    finally:
        module.train(was_training)


def count_params(module: nn.Module) -> int:
    """Number of parameter elements (local shards for DTensors)."""
    total = 0
    for p in module.parameters():
        total += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return total


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """BatchNorm layers with running statistics (a forward-masked worker's dropped blocks keep their
    modules with the tensors deleted: they never run and have nothing to re-estimate)."""
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]
