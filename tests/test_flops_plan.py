"""Issue 35, item 4: the FLOP fraction (``train.flops_ratio=measured``, ``flops_per_step``, ``total_flops``, MFU)
is what the plan's workers run, counted on the subnetworks themselves.

The budget used to scale every block by C; the plan decides which blocks are units (``drop_downsample=false``
keeps a downsampling block whole on every worker), how many workers run a neuron-level block's unsplit rest
(all of them only when every worker holds a group of it) and, for the drop baselines, each block's own
survival probability. Each case below counts the forward FLOPs of every rank's forward-masked subnetwork
(dropped blocks skipped, narrowed layers narrow) with ``torch.utils.flop_counter``, independently of the
shares under test (:func:`tests.helpers.flops.direct_forward_fraction`).
"""

from __future__ import annotations

import pytest
import torch

from sdp.metrics.flops import unit_shares
from sdp.models.base import count_forward_flops, forward_flop_counts
from sdp.parallel.ddp_drop import survival_probs
from sdp.parallel.sdp_plan import plan_for, plan_fraction
from sdp.driver.budget import resolve_steps
from sdp.registry import build
from tests.helpers.flops import direct_forward_fraction
from tests.hydra_cfg import compose_config

BUDGET = ("train.steps=100", "train.budget=flops", "train.flops_ratio=measured")
GQA = ("model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16")  # attention not split by groups
CASES = {
    # ResIST: the downsampling blocks (1, 3, 5 of 8 in ResNet-18) stay whole and shared
    "resist_block": ("model=resnet18_cifar", "parallelism=sdp", "parallelism.drop_downsample=false", "cluster.world_size=4"),
    "resist_neuron": ("model=resnet18_cifar", "parallelism=sdp_neuron_fwd", "parallelism.drop_downsample=false",
                      "cluster.world_size=4"),
    "block": ("model=resnet18_cifar", "parallelism=sdp", "cluster.world_size=4"),
    "block_k1": ("model=resnet18_cifar", "parallelism=sdp", "parallelism.coverage=0.3", "cluster.world_size=4"),
    # 2 groups x k = 2 holders on 8 workers: each block runs on at most 4 of them, its unsplit attention too
    "neuron_sparse": (*GQA, "parallelism=sdp_neuron_fwd", "parallelism.groups=2", "parallelism.coverage=0.25",
                      "cluster.world_size=8"),
    "neuron_capped": (*GQA, "parallelism=sdp_neuron_fwd", "parallelism.max_holder_sets=3", "cluster.world_size=4"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flop_fraction_is_the_plans_subnetworks_count(name: str) -> None:
    cfg = compose_config(*CASES[name], *BUDGET)
    steps, info = resolve_steps(cfg)
    direct = direct_forward_fraction(cfg)
    assert 0 < direct < 1, f"{name}: the subnetworks should compute part of the model: {direct}"
    assert info["fraction_computed"] == pytest.approx(direct, rel=1e-9), (name, info["fraction_computed"], direct)
    assert steps == round(100 / direct), (name, steps, direct)
    per_step = info["global_batch"] * info["flops_per_sample"] * direct
    assert info["flops_per_step"] == pytest.approx(per_step, rel=1e-9), (name, info["flops_per_step"], per_step)
    assert info["total_flops"] == pytest.approx(steps * per_step, rel=1e-9), (name, info["total_flops"])


def test_resist_runs_fewer_steps_than_dropping_the_downsampling_blocks() -> None:
    """A shared downsampling block computes more per step, so the FLOP-matched run is shorter."""
    kept, dropped = (resolve_steps(compose_config(*CASES["block"], *BUDGET, f"parallelism.drop_downsample={d}"))
                     for d in ("false", "true"))
    assert kept[1]["fraction_computed"] > dropped[1]["fraction_computed"] and kept[0] < dropped[0], (kept, dropped)


def test_backward_masking_masks_the_weight_gradient_of_the_plans_units() -> None:
    """Backward masking runs the forward and the input gradient in full, and the weight gradient of the
    units a worker holds: a third of the training FLOPs follows the forward-masked subnetworks' count."""
    cfg = compose_config("model=resnet18_cifar", "parallelism=sdp_block_bwd", "parallelism.drop_downsample=false",
                         "cluster.world_size=4", *BUDGET)
    _, info = resolve_steps(cfg)
    direct = direct_forward_fraction(cfg)
    assert info["fraction_computed"] == pytest.approx((2 + direct) / 3, rel=1e-9), (info["fraction_computed"], direct)


@pytest.mark.parametrize("redraw", ["relabel", "shuffle", "rolling"])
def test_every_draw_computes_the_first_draws_fraction(redraw: str) -> None:
    """The budget counts the driver's plan (draw 0); every re-draw rule keeps each unit's k holders and the
    workers running each block, so every draw of the run computes the same fraction."""
    cfg = compose_config("model=resnet18_cifar", "parallelism=sdp_neuron_fwd", "parallelism.groups=4",
                         f"parallelism.redraw={redraw}", "parallelism.resample_every=10", "cluster.world_size=4")
    with torch.device("meta"):
        model = build(cfg.model)
    shares = unit_shares(counts=forward_flop_counts(model), model=model)["neuron"]
    fractions = [plan_fraction(plan=plan_for(model=model, cfg=cfg.parallelism, world_size=4, draw=d), shares=shares,
                               masking="forward") for d in range(4)]
    assert fractions == pytest.approx([fractions[0]] * 4, rel=1e-12), fractions


def test_linear_decay_weighs_each_block_by_its_own_survival() -> None:
    """Stochastic depth's linear decay keeps early blocks more often: the expected FLOPs are each block's
    skipped FLOPs (counted by switching that block off in a built model) times its own drop probability,
    not the mean survival times all blocks' FLOPs."""
    cfg = compose_config("model=resnet18_cifar", "parallelism=ddp_stochastic_depth", "parallelism.survival_prob=0.5",
                         "parallelism.decay=linear", *BUDGET)
    _, info = resolve_steps(cfg)
    with torch.device("meta"):
        model = build(cfg.model)
    x = model.example_input(1)
    full = count_forward_flops(model, x)
    units = model.sdp_units()
    skipped = 0.0
    for (_, block), p in zip(units, survival_probs(n=len(units), p=0.5, decay="linear")):
        block.active = False
        skipped += (1 - p) * (full - count_forward_flops(model, x)) / full
        block.active = True
    assert info["fraction_computed"] == pytest.approx(1 - skipped, rel=1e-9), (info["fraction_computed"], 1 - skipped)
