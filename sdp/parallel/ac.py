"""Activation checkpointing (``train.ac``), one mechanism for every strategy: each chosen block runs under
non-reentrant ``torch.utils.checkpoint``, so only its input is kept and its activations are recomputed in
backward (torchtitan's ``activation_checkpoint``, mode ``full``; every k-th block: its ``selective_ac_option=k``);
``train.ac=op`` keeps the block's matmul and attention outputs as well (torchtitan's ``selective_ac_option="op"``,
:mod:`sdp.parallel.ac_op`).

Why a training option and not a strategy: what a block keeps for backward is independent of how gradients
are synchronised, so DDP, SDP (either masking), FSDP2 and the drop baselines take the same blocks; the rank
(:meth:`sdp.parallel.base.Strategy.checkpoint_blocks`) applies it to the model before ``setup`` wraps, masks or
shards it (torchtitan applies AC before ``fully_shard`` too), and ``sdp-plan`` applies it to its meta model, so
the prediction rehearses the same blocks.

Why swap the block's class instead of wrapping it in a module: parameter and buffer names stay those of the
plain model (checkpoints and the gradient tests compare by name), and a deep copy (SDP's skeleton, the
planner's rehearsals) stays checkpointed, which an instance-attribute ``forward`` closing over the original
block would not. Why restore buffers after the recomputation: recomputing a BatchNorm forward in training mode
would update its running statistics a second time, so AC would evaluate differently from no AC; the
recomputation must repeat the forward's values and leave no other trace. Checkpointed inputs are reported to
the activation meter with :func:`sdp.metrics.activations.note_retained`. Why a checkpointed block runs with
autocast's weight-cast cache off (:func:`sdp.core.precision.weight_cache_off`): under bf16 the cache would keep the
bf16 cast of every checkpointed block's weights alive until the forward ends, a copy of the model's weights that the
checkpoints do not need; without it each cast is freed with the block's other activations, and recomputed with them.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from sdp.core.precision import weight_cache_off
from sdp.metrics.activations import note_retained
from sdp.models.base import forward_flop_counts
from sdp.parallel.ac_op import op_contexts, recomputed_flops


@contextmanager
def restored_buffers(module: nn.Module, *, outside_modes: bool = False) -> Iterator[None]:
    """Run the block, then put every buffer back as it was (no double BatchNorm statistics update).
    ``outside_modes``: copy with the dispatch modes set aside (a selective checkpoint's recomputation must replay the
    forward's ops exactly: its cache refuses any other op)."""
    aside = _disable_current_modes if outside_modes else nullcontext
    with aside():
        saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad(), aside():
            for b, v in saved:
                b.copy_(v)


class Checkpointed(nn.Module):
    """Mixin of a checkpointed block's class: its ``forward`` is the original one under the checkpoint; the
    recomputation in backward runs with the block's buffers restored afterwards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        inner = super().forward
        calls = 0

        def run(inp: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            with weight_cache_off():  # no cast of its weights outlives the block
                if calls == 1:
                    return inner(inp)
                with restored_buffers(self, outside_modes=self._selective):  # the recomputation in backward
                    return inner(inp)

        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return inner(x)
        note_retained(x)  # the checkpoint keeps its input alive for the recomputation
        return checkpoint(run, x, use_reentrant=False, context_fn=self._ac_contexts)

    _selective = False

    @staticmethod
    def _ac_contexts() -> tuple[Any, Any]:
        return _forward_modes_again()


class SelectiveCheckpointed(Checkpointed):
    """Mixin of a block under selective op checkpointing (``train.ac=op``): the same, with torchtitan's op policy
    (:func:`sdp.parallel.ac_op.op_contexts`) keeping the matmul and attention outputs."""

    _selective = True

    @staticmethod
    def _ac_contexts() -> tuple[Any, Any]:
        return op_contexts(_forward_modes_again()[1])


def checkpoint_call(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` under non-reentrant ``checkpoint`` with the forward's torch-function modes around the recomputation
    (:func:`_forward_modes_again`), as a checkpointed block runs: for a caller that checkpoints blocks itself (SDP's
    assembly calibration, :mod:`sdp.parallel.sdp_calibrate`, and its rehearsal on the meta device)."""
    def run(inp: torch.Tensor) -> torch.Tensor:
        with weight_cache_off():
            return fn(inp)

    return checkpoint(run, x, use_reentrant=False, context_fn=_forward_modes_again)


def _forward_modes_again() -> tuple[Any, Any]:
    """``checkpoint``'s contexts: none around the forward; around the recomputation, the torch-function modes
    that were active in the forward and are not any more. Why: torch's checkpoint restores autocast for the
    recomputation, but not a mode, and ``sdp-plan`` emulates autocast on the meta device with one
    (:class:`sdp.parallel.device_forward.Autocast`): without it the recomputation would save other tensors than
    the forward (non-reentrant checkpoint refuses that). A rank's training forward runs under no such mode."""
    from torch.overrides import _get_current_function_mode_stack

    forward = list(_get_current_function_mode_stack())

    @contextmanager
    def again() -> Iterator[None]:
        active = {id(m) for m in _get_current_function_mode_stack()}
        with ExitStack() as stack:
            for mode in forward:
                if id(mode) not in active:
                    stack.enter_context(mode)
            yield

    return nullcontext(), again()


_CLASSES: dict[tuple[type, str], type] = {}
MIXINS = {"full": Checkpointed, "op": SelectiveCheckpointed}  # train.ac's modes that checkpoint


def checkpointed_class(cls: type, mode: str = "full") -> type:
    """The subclass of ``cls`` checkpointed as ``mode`` (:data:`MIXINS`), one per class and mode (so copies and
    isinstance checks agree)."""
    if issubclass(cls, Checkpointed):
        return cls
    if (cls, mode) not in _CLASSES:
        mixin = MIXINS[mode]
        _CLASSES[cls, mode] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    return _CLASSES[cls, mode]


def chosen_blocks(*, n_blocks: int, every: int) -> list[int]:
    """Blocks 0, every, 2*every, ... of ``n_blocks`` (``every`` = 0: none, train.ac=none)."""
    assert every >= 0, f"ac_every={every}: must be >= 0 (0: no checkpointing)"
    return list(range(0, n_blocks, every)) if every > 0 else []


def apply_checkpointing(model: nn.Module, *, every: int, mode: str = "full") -> list[int]:
    """Checkpoint ``model.blocks`` 0, every, 2*every, ... in place as ``mode`` (``full``: only each block's input is
    kept; ``op``: its matmul and attention outputs too; ``every`` = 0: none); returns their indices. Applying it
    twice changes nothing."""
    chosen = chosen_blocks(n_blocks=len(model.blocks), every=every)
    for i in chosen:
        block = model.blocks[i]
        block.__class__ = checkpointed_class(type(block), mode)
    return chosen


def recompute_share(*, model: Any, every: int, mode: str = "full") -> float:
    """Share of ``model``'s forward FLOPs that activation checkpointing recomputes in backward: the blocks
    ``train.ac`` checkpoints (:func:`sdp.parallel.ac.chosen_blocks`; ``every`` = 0: none), each run once more
    (``full``), or only the matmuls the op policy does not keep (``op``, :func:`sdp.parallel.ac_op.recomputed_flops`)."""
    chosen = chosen_blocks(n_blocks=len(model.blocks), every=every)
    if not chosen:
        return 0.0
    counts = forward_flop_counts(model)
    prefix, total = type(model).__name__, counts["Global"]
    again = (recomputed_flops(model=model, blocks=chosen) if mode == "op"
             else sum(counts.get(f"{prefix}.blocks.{i}", 0) for i in chosen))
    share = again / total if total else 0.0
    assert 0 <= share <= 1, f"checkpointed blocks {chosen}: {share} of the forward FLOPs"
    return share
