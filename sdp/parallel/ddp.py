"""DDP baseline: torch ``DistributedDataParallel`` with a comm hook that counts every bucket it
all-reduces, so DDP's communication is measured exactly like SDP's."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from sdp.metrics.comm import CommCounter
from sdp.models.base import SDPModel
from sdp.parallel.base import OptimizerFactory, Strategy, register


class _CountingState:
    """State of the counting hook: where to record, and the group DDP reduces over."""

    def __init__(self, *, comm: CommCounter, process_group: Any = None) -> None:
        self.comm = comm
        self.process_group = process_group
        self.group_size = dist.get_world_size(process_group)


def counting_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default all-reduce (sum then divide by world size), recorded bucket by bucket.

    Unannotated on purpose: DDP compares the hook's annotations with ``dist.GradBucket`` and
    ``torch.futures.Future`` objects, which postponed (string) annotations would fail.
    """
    buf = bucket.buffer()
    state.comm.record(kind="all_reduce", payload=buf.numel() * buf.element_size(), group_size=state.group_size)
    return default_hooks.allreduce_hook(state.process_group, bucket)


def wrap_ddp(model: torch.nn.Module, *, cfg: Any, comm: CommCounter, device: torch.device, process_group: Any = None) -> DistributedDataParallel:
    """The DDP wrapper every DDP-family strategy shares (plain, AC, stochastic depth, LayerDrop)."""
    with warnings.catch_warnings():
        # torch 2.14 deprecates broadcast_buffers in favour of forward_sync_buffers, whose False still
        # syncs at init; rank-local BatchNorm buffers (what we want) need broadcast_buffers=False.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        ddp = _ddp(model, cfg=cfg, device=device, process_group=process_group)
    ddp.register_comm_hook(_CountingState(comm=comm, process_group=process_group), counting_allreduce_hook)
    return ddp


def _ddp(model: torch.nn.Module, *, cfg: Any, device: torch.device, process_group: Any) -> DistributedDataParallel:
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
        broadcast_buffers=bool(cfg.get("broadcast_buffers", False)),
        bucket_cap_mb=float(cfg.get("bucket_cap_mb", 25)),
        gradient_as_bucket_view=True,
        find_unused_parameters=bool(cfg.get("find_unused_parameters", False)),
    )


def prime_buckets(ddp: DistributedDataParallel, *, example: torch.Tensor, comm: CommCounter) -> None:
    """One forward/backward of zeros so DDP records its gradient-ready order, as the first step of a
    fresh run does; the next forward then rebuilds buckets exactly as the uninterrupted run did at
    its step 2. Without it a resumed run trains its first step with the initial bucket layout, and on
    more than 2 ranks gloo's ring sums elements in an order that depends on their bucket offset, so the
    curve drifts in the last bits. Call before the checkpoint is loaded (the forward touches BatchNorm
    statistics and RNG streams, which the load then overwrites); its all-reduce is counted as
    ``checkpoint`` traffic, not training."""
    with comm.phase_as("checkpoint"):
        out = ddp(example)
        (out.float().sum() * 0).backward()
        ddp.zero_grad(set_to_none=False)


@register("ddp")
class DDPStrategy(Strategy):
    """Every rank holds the full model; gradients are averaged over the world each step."""

    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        model.to(self.ctx.device)
        self.module = wrap_ddp(model, cfg=self.cfg, comm=self.ctx.comm, device=self.ctx.device)
        self.optimizer = optimizer_factory(self.module.parameters())

    # train_step: the base template; DDP's all-reduce overlaps with the backward phase (no sync_grads).

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        assert isinstance(self.module, DistributedDataParallel)
        model = self.unwrapped()
        prime_buckets(self.module, example=model.example_input(2).to(self.ctx.device), comm=self.ctx.comm)
        super().load_checkpoint_state(state)
