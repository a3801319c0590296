"""What a rank knows about the job (:class:`DistContext`) and the averages every strategy and the
evaluation share. A leaf module: it imports nothing of ``sdp`` but the comm counter, so evaluation,
assembly and the planner's rehearsals can use it without importing the strategies (``sdp.parallel``
imports every strategy module, and strategies import the planner's rehearsals)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdp.metrics.comm import CommCounter


@dataclass
class DistContext:
    """What a rank knows about the job: its place, its device and the shared comm counter."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    comm: CommCounter = field(default_factory=CommCounter)



def average_buffers(model: nn.Module, *, ctx: DistContext, group: Any = None) -> None:
    """Average floating-point buffers (BatchNorm running stats) over ``group`` (world default);
    integer buffers (num_batches_tracked) are left as they are (equal on every rank that ran the layer)."""
    average_tensors([b for b in model.buffers() if b.is_floating_point()], ctx=ctx, group=group)


def average_tensors(tensors: list[torch.Tensor], *, ctx: DistContext, group: Any = None) -> None:
    """Replace each tensor by its mean over ``group`` (world default), in place: one flat all-reduce."""
    if ctx.world_size == 1 or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    size = dist.get_world_size(group)
    ctx.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=size)
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
