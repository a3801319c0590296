"""Selective *op* activation checkpointing (``train.ac=op``): torchtitan's ``selective_ac_option="op"``.

A checkpointed block keeps the outputs of its matrix multiplications and of its attention kernel and recomputes
everything else (norms, activations, rotary embedding, casts) in backward; of the matmuls it keeps every other one
(the 1st, 3rd, ...), recomputing the 2nd, 4th, ..., as torchtitan's policy does "to balance memory and compute".
Why offer it: it is what torchtitan runs by default for its Llama-3 8B-70B jobs, so a published memory figure of
those jobs (``sdp-bench memory-anchor``) compares with ``sdp-plan`` only at this setting; ``full`` (the block's
input only) and ``none`` merely bracket it.

Mechanism: ``torch.utils.checkpoint``'s selective contexts (:func:`create_selective_checkpoint_contexts`) with
torchtitan's policy (:func:`policy`); the outputs it keeps live in the checkpoint's own cache, outside autograd's
saved tensors, so they are reported to the activation meter (:func:`sdp.metrics.activations.note_retained`) as
they are made (:class:`_NoteKept`), as a full checkpoint reports its input. The policy counts matmuls per block
call, separately in the forward and in the recomputation, so both keep the same ones (non-reentrant checkpoint
refuses a recomputation that differs).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import mm_flop

from sdp.metrics.activations import note_retained
from sdp.models.base import meta_forward

_MM = torch.ops.aten.mm.default
# the ops whose outputs are kept: torchtitan's list (matmul, the fused attention kernels, FSDP's reduce-scatter),
# with the attention kernels this torch has on CPU (flash for CPU, math) and CUDA (cuDNN)
_SAVE_NAMES = ("mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_attention_math")
SAVE = frozenset([getattr(torch.ops.aten, n).default for n in _SAVE_NAMES if hasattr(torch.ops.aten, n)]
                 + ([torch.ops._c10d_functional.reduce_scatter_tensor.default]
                    if hasattr(torch.ops, "_c10d_functional") and hasattr(torch.ops._c10d_functional, "reduce_scatter_tensor")
                    else []))


def keeps(func: Any, *, mm_index: int) -> bool:
    """Whether the policy keeps ``func``'s output; ``mm_index``: this call's 1-based count among the block's
    matmuls (only read for a matmul: the even ones are recomputed)."""
    return func in SAVE and not (func == _MM and mm_index % 2 == 0)


def policy(counts: dict[str, int], kept: list[bool]) -> Any:
    """torchtitan's op policy over one block call's ``counts`` (matmuls so far, per forward and recomputation);
    appends each forward decision to ``kept`` for :class:`_NoteKept`."""

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == _MM:
            counts[mode] += 1
        keep = keeps(func, mm_index=counts[mode])
        if not ctx.is_recompute:
            kept.append(keep)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


class _NoteKept(TorchDispatchMode):
    """Inside the checkpoint's caching mode: each op's output that the policy just decided to keep is reported to
    the activation meter (the policy runs in the caching mode, while this mode's call of ``func`` is under way)."""

    def __init__(self, kept: list[bool]) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = len(self.kept)
        out = func(*args, **(kwargs or {}))
        if len(self.kept) > before and self.kept[-1]:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    note_retained(t)
        return out


def op_contexts(again: Any) -> tuple[Any, Any]:
    """``checkpoint``'s ``context_fn`` result for one block call: the selective forward context (with the kept
    outputs reported) and the selective recomputation context entered with ``again`` (the forward's torch-function
    modes, :func:`sdp.parallel.ac._forward_modes_again`)."""
    counts: dict[str, int] = defaultdict(int)
    kept: list[bool] = []
    forward, recompute = create_selective_checkpoint_contexts(policy(counts, kept))
    # the kept outputs bypass saved-tensor hooks (torch's legacy behaviour, chosen explicitly: checkpoint reads this
    # off the caching mode, which the context below wraps); _NoteKept reports them to the activation meter instead
    forward.respect_saved_tensors_hooks = False

    @contextmanager
    def forward_noting() -> Iterator[None]:
        with forward, _NoteKept(kept):
            yield

    @contextmanager
    def recompute_again() -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(again)
            stack.enter_context(recompute)
            yield

    return forward_noting(), recompute_again()


class _EvenMatmuls(TorchDispatchMode):
    """Counts, per call of a watched block, the FLOPs of the matmuls the op policy recomputes (the 2nd, 4th, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.index, self.flops = False, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.inside and func == _MM:
            self.index += 1
            if not keeps(func, mm_index=self.index):
                self.flops += mm_flop(args[0].shape, args[1].shape)  # the FLOP counter's own formula
        return out


def recomputed_flops(*, model: Any, blocks: list[int]) -> int:
    """Forward FLOPs of one sample (``model.example_input(1)``, on the meta device) that ``train.ac=op`` recomputes
    in ``blocks``: the matmuls its policy does not keep. Attention is kept (the fused kernel's output; on the meta
    device attention decomposes into batched matmuls, which the policy's ``mm`` count does not include), and the
    other ops it recomputes (norms, activations) count no FLOPs, as in :func:`sdp.models.base.forward_flop_counts`."""
    counter = _EvenMatmuls()

    def enter(*_: Any) -> None:
        counter.inside, counter.index = True, 0

    def leave(*_: Any) -> None:
        counter.inside = False

    handles = [h for i in blocks for h in (model.blocks[i].register_forward_pre_hook(enter),
                                           model.blocks[i].register_forward_hook(leave))]
    try:
        meta_forward(model, model.example_input(1), under=counter)
    finally:
        for h in handles:
            h.remove()
    return counter.flops
