"""The plans the re-draw rule tests build (tests/test_redraw_modes.py: relabel and shuffle; tests/test_redraw_rolling.py:
rolling): two study-sized models on the meta device, their block costs measured once, so that both files draw the
same plans the same way (seed 3, 4 groups a block at neuron level)."""

from __future__ import annotations

import functools
import itertools

import torch

from sdp.models.llama import LLaMA
from sdp.models.resnet import ResNetCIFAR
from sdp.subnet.plan import Plan, build_plan, measure_block_costs


@functools.lru_cache(maxsize=None)
def model_costs(name: str) -> tuple[torch.nn.Module, dict[int, tuple[float, float]]]:
    """``resnet``: ResNet-18 (width 16); any other name: an 8-layer LLaMA. On meta, with its block costs."""
    with torch.device("meta"):
        model = (ResNetCIFAR(num_classes=10, width=16) if name == "resnet" else
                 LLaMA(vocab_size=256, max_seq_len=32, dim=64, n_layers=8, n_heads=4, n_kv_heads=2, hidden=176))
    return model, measure_block_costs(model)


def plan_of(name: str, **kw) -> Plan:  # noqa: ANN003
    """The plan of :func:`model_costs`'s ``name`` with ``kw`` (world_size, coverage, level, redraw, draw, ...)."""
    model, costs = model_costs(name)
    return build_plan(model=model, block_costs=costs, groups=4, seed=3, **kw)


def coheld(holders: tuple[tuple[int, ...], ...]) -> set[tuple[int, int]]:
    """The pairs of units some worker trains together."""
    return {(a, b) for a, b in itertools.combinations(range(len(holders)), 2) if set(holders[a]) & set(holders[b])}
