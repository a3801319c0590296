"""train.ac and the budget (sdp/driver/budget.py): recomputation is not charged (budgets count model FLOPs), but
recorded at its source (``recompute_flops_per_step``) for the step time (sdp.bench.frontier, sdp-plan)."""

from __future__ import annotations

import pytest

from sdp.driver.budget import resolve_steps
from sdp.models.base import forward_flop_counts
from sdp.registry import build
from tests.hydra_cfg import compose_config as compose_with


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_keeps_the_steps_and_records_its_recomputation(every: int):
    """train.ac is not charged (budgets count model FLOPs: DDP+AC runs DDP's steps, and trains what DDP trains), but
    its recomputation, one more forward of the checkpointed blocks (a third of their training FLOPs), is recorded
    for the step time; without train.ac it is 0."""
    base = ("model=llama_tiny", "dataset=synthetic_text", "parallelism=ddp", "train.steps=40", "train.budget=flops")
    steps, plain = resolve_steps(compose_with(*base))
    steps_ac, ac = resolve_steps(compose_with(*base, "train.ac=full", f"train.ac_every={every}"))
    assert steps_ac == steps == 40 and ac["flops_per_step"] == plain["flops_per_step"], (ac, plain)
    assert plain["recompute_flops_per_step"] == 0.0, plain
    counts = forward_flop_counts(build(compose_with(*base).model))
    chosen = range(0, 4, every)  # llama_tiny: 4 blocks
    share = sum(counts[f"LLaMA.blocks.{i}"] for i in chosen) / counts["Global"]
    assert ac["recompute_flops_per_step"] == pytest.approx(ac["flops_per_step"] * share / 3), (ac, share)
