"""Process groups and device memory outside the allocator: what a rank's communicators cost.

Why count groups: with NCCL every communicator holds device memory that PyTorch's caching allocator
does not see (``cuda_max_allocated`` misses it), and SDP creates one group per distinct holder set
(plus refresh sets under backward masking). summary.json therefore records, per rank, the groups
this rank is a member of (the default group included) and their sizes (key ``process_groups``), and
on CUDA the device memory in use from the driver (``torch.cuda.mem_get_info``) beside the allocator's
figures.

How groups share resources on NCCL (torch 2.14, ``torch/distributed/distributed_c10d.py``): when the
default group is bound to a device (``init_process_group(device_id=...)``, which the worker passes for
NCCL), its communicator is created eagerly and every later ``new_group`` is made by
``ncclCommSplit`` of it (``_get_split_source``; non-members issue a no-colour split), so sub-groups
share the parent's resources instead of a fresh ``ncclCommInitRank`` each. That needs every rank of
the world to call ``new_group`` for every set, in the same order, which :class:`sdp.subnet.sync.GroupSet`
does (so ``use_local_synchronization=True`` is *not* used: members-only creation cannot split).
``dist.split_group`` only makes disjoint groups in one call, and holder sets overlap.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def process_groups() -> dict[str, Any]:
    """The groups this rank belongs to: count, sorted sizes, and whether NCCL splits them."""
    if not dist.is_initialized():
        return {"count": 0, "sizes": [], "split_from_default": False}
    from torch.distributed.distributed_c10d import GroupMember, _get_default_group, _world

    me = dist.get_rank()
    # torch also files the groups a rank is not in, under the one NON_GROUP_MEMBER key: skip it.
    sizes = sorted((len(ranks) for pg, ranks in _world.pg_group_ranks.items()
                    if pg is not GroupMember.NON_GROUP_MEMBER and me in ranks), reverse=True)
    default = _get_default_group()
    split = dist.get_backend(default) == "nccl" and getattr(default, "bound_device_id", None) is not None
    return {"count": len(sizes), "sizes": sizes, "split_from_default": bool(split)}


def device_memory(device: torch.device) -> dict[str, int]:
    """Device memory in use as the driver sees it (all processes on the device: communicators, CUDA
    context, other ranks sharing the GPU), and the device total; empty off CUDA."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"cuda_device_used_bytes": int(total - free), "cuda_device_total_bytes": int(total)}
