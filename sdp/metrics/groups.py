"""Process groups and device memory outside the allocator: what a rank's communicators cost.

Why count groups: with NCCL every communicator holds device memory that PyTorch's caching allocator
does not see (``cuda_max_allocated`` misses it), and SDP creates one group per distinct holder set
(plus each one's refresh set, except under global refresh). summary.json therefore records, per rank, the groups
this rank is a member of (the default group included) and their sizes (key ``process_groups``), and
on CUDA the device memory in use from the driver (``torch.cuda.mem_get_info``) beside the allocator's
figures.

How groups share resources on NCCL (torch 2.14, ``torch/distributed/distributed_c10d.py``): when the
default group is bound to a device (``init_process_group(device_id=...)``, which the worker passes for
NCCL), its communicator is created eagerly and every later ``new_group`` is made by
``ncclCommSplit`` of it (``_get_split_source``; non-members issue a no-colour split). A split alone
shares nothing: NCCL gives the child its parent's buffers, channels and proxy only when the *parent*
was created with ``config.splitShare = 1`` (NCCL ``src/init.cc``), which torch leaves unset; so the
worker creates the default group with :func:`sdp.core.distctx.comm_options` (``split_share = 1``), and
``process_groups()["split_share"]`` says whether it was. The split needs every rank of the world to
call ``new_group`` for every set, in the same order, which :class:`sdp.subnet.holder_groups.GroupSet` does (so
``use_local_synchronization=True`` is *not* used: members-only creation cannot split).
``dist.split_group`` only makes disjoint groups in one call, and holder sets overlap. What sharing
saves is measured, not assumed: summary.json's ``cuda_device_used_bytes`` beside the group count,
against ``sdp-plan``'s ``communicator_bytes`` (``cluster.comm_bytes_per_group`` per group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def process_groups() -> dict[str, Any]:
    """The groups this rank belongs to: count, sorted sizes, whether NCCL splits them from the default
    group and whether the splits share its resources."""
    if not dist.is_initialized():
        return {"count": 0, "sizes": [], "split_from_default": False, "split_share": False}
    from torch.distributed.distributed_c10d import GroupMember, _get_default_group, _world

    me = dist.get_rank()
    # torch also files the groups a rank is not in, under the one NON_GROUP_MEMBER key: skip it.
    sizes = sorted((len(ranks) for pg, ranks in _world.pg_group_ranks.items()
                    if pg is not GroupMember.NON_GROUP_MEMBER and me in ranks), reverse=True)
    default = _get_default_group()
    nccl = dist.get_backend(default) == "nccl"
    split = nccl and getattr(default, "bound_device_id", None) is not None
    try:  # a reporting flag must not cost the run its summary
        share = nccl and default._get_backend(torch.device("cuda")).options.config.split_share == 1
    except (AttributeError, RuntimeError):
        share = None  # torch did not say
    return {"count": len(sizes), "sizes": sizes, "split_from_default": bool(split),
            "split_share": share if share is None else bool(share)}


def mesh_process_groups(*, world_size: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """What summary.json's ``process_groups`` will say for a strategy on a DeviceMesh of ``shape`` (FSDP,
    HSDP, pipeline), in :func:`sdp.subnet.holder_groups.predicted_process_groups`' form: the default group plus,
    per dimension smaller than the world, the one group of that dimension this rank is in (a
    dimension spanning the world reuses the default group: ``init_device_mesh``)."""
    sizes = sorted([world_size] + [s for s in shape if s < world_size], reverse=True)
    per_rank = [{"rank": r, "count": len(sizes), "sizes": list(sizes)} for r in range(world_size)]
    return {"per_rank": per_rank, "distinct_groups": sum(world_size // s for s in shape if s < world_size)}


def device_memory(device: torch.device) -> dict[str, int]:
    """Device memory in use as the driver sees it (all processes on the device: communicators, CUDA
    context, other ranks sharing the GPU), and the device total; empty off CUDA."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"cuda_device_used_bytes": int(total - free), "cuda_device_total_bytes": int(total)}
