"""The FLOP fraction counted on built subnetworks, to check the budget's plan-based count against."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from sdp.models.base import count_forward_flops
from sdp.parallel.sdp_plan import plan_for
from sdp.registry import build
from sdp.subnet import masking as M


def direct_forward_fraction(cfg: DictConfig) -> float:
    """The mean over ranks of each rank's forward-masked subnetwork's forward FLOPs (counted by
    ``torch.utils.flop_counter`` on the masked model itself: dropped blocks skipped, neuron-level layers
    narrowed) over the full model's, for the SDP config ``cfg`` (the driver's plan, draw 0)."""
    world = int(cfg.cluster.world_size)
    with torch.device("meta"):
        model = build(cfg.model)
    plan = plan_for(model=model, cfg=cfg.parallelism, world_size=world)
    x = model.example_input(1)
    full = count_forward_flops(model, x)
    per_rank = [count_forward_flops(mine, x)
                for _, mine, _, _ in M.rank_subnetworks(model, plan, mode="forward", all_pieces=M.pieces(model, plan))]
    assert len(per_rank) == world, f"{len(per_rank)} subnetworks for {world} ranks"
    return sum(per_rank) / len(per_rank) / full
