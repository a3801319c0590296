"""Backward masking at neuron level keeps no re-joined full-size weight for backward, and its index
tensors are created once: the masked model saves what the unmasked model saves (plus its tiny index
tensors), computes the same loss, and its held gradients equal the unmasked model's, in fp32 and
under bf16 autocast. Single process, no ranks: the masking of rank 0 of a 2-worker plan."""

from __future__ import annotations

import copy

import pytest
import torch

from sdp.metrics.activations import measure_saved_tensors
from sdp.parallel.sdp_plan import plan_for
from sdp.subnet import masking as M
from sdp.core.loss import loss_fn
from sdp.registry import build
from tests.hydra_cfg import compose_config

MODELS = {"mlp": ["model=mlp", "model.hidden=64"], "resnet": ["model=resnet18_cifar", "model.width=8"]}


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str) -> tuple[float, int]:
    with measure_saved_tensors(exclude=list(model.parameters())) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), meter.bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_split_layers_save_no_full_weight_and_keep_gradients(model_name: str, precision: str) -> None:
    cfg = compose_config(*MODELS[model_name], "dataset=digits", "parallelism=sdp_neuron_bwd", "parallelism.groups=4",
                         "parallelism.assignment=cyclic", "cluster.world_size=2", "logger.wandb.mode=disabled")
    torch.manual_seed(0)
    full = build(cfg.model)
    masked = copy.deepcopy(full)
    plan = plan_for(model=masked, cfg=cfg.parallelism, world_size=2)
    pieces = M.pieces(masked, plan)
    layout = M.apply(masked, plan, rank=0, masking="backward", all_pieces=pieces)
    split = {n: loc for n, loc in layout.items() if loc.rest is not None and loc.held is not None}
    assert split, "the plan splits no tensor: the test would check nothing"
    x = torch.randn(8, *full.example_input(1).shape[1:])
    y = torch.randint(0, int(cfg.dataset.num_classes), (8,))
    ref_loss, ref_bytes = _step(full, x, y, precision)
    for _ in range(2):  # the second pass reuses the index tensors moved at the first
        masked.zero_grad(set_to_none=True)
        loss, saved = _step(masked, x, y, precision)
    assert loss == ref_loss, f"masked loss {loss} != unmasked {ref_loss}"
    index_bytes = sum(loc.width * len(loc.held_groups + loc.rest_groups) * 8 for loc in split.values())
    weight_bytes = sum((loc.held.numel() + loc.rest.numel()) * (2 if precision == "bf16" else 4) for loc in split.values())
    # fp32: exactly the unmasked activations (+ indices). bf16: fewer, since the unmasked model keeps
    # autocast's bf16 copy of every weight for backward while split layers keep a recipe instead.
    assert (ref_bytes if precision == "fp32" else 0) <= saved <= ref_bytes + index_bytes, (
        f"{model_name}/{precision}: masked forward saves {saved} B, unmasked {ref_bytes} B (+{index_bytes} B of "
        f"indices allowed); a kept re-joined weight would add up to {weight_bytes} B")
    grads = dict(full.named_parameters())
    for name, loc in split.items():
        want = grads[name].grad.index_select(loc.dim, M._group_index(loc.held_groups, loc.width, torch.device("cpu")))
        assert torch.equal(loc.held.grad, want), f"{name}: held gradient differs from the unmasked model's"
        assert not hasattr(masked.get_submodule(name.rpartition('.')[0]), name.rpartition('.')[2]), (
            f"{name}: the re-joined tensor outlived the forward")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_block_backward_masking_saves_no_more_than_the_full_model(model_name: str, precision: str) -> None:
    """Block-level backward masking freezes the blocks a worker does not hold: a frozen layer keeps its weight
    (for the input gradient) but not its input (no weight gradient), a subset of what the trainable layer keeps,
    and a weight, or autocast's bf16 cast of a frozen one, is model state, not an activation. So the masked
    forward saves at most what the full model saves; counting the frozen weights' casts made it save more."""
    cfg = compose_config(*MODELS[model_name], "dataset=digits", "parallelism=sdp_block_bwd",
                         "parallelism.assignment=cyclic", "cluster.world_size=2", "logger.wandb.mode=disabled")
    torch.manual_seed(0)
    full = build(cfg.model)
    masked = copy.deepcopy(full)
    plan = plan_for(model=masked, cfg=cfg.parallelism, world_size=2)
    M.apply(masked, plan, rank=0, masking="backward", all_pieces=M.pieces(masked, plan))
    frozen = [n for n, p in masked.named_parameters() if not p.requires_grad]
    assert frozen, "rank 0 holds every block: the test would check nothing"
    x = torch.randn(8, *full.example_input(1).shape[1:])
    y = torch.randint(0, int(cfg.dataset.num_classes), (8,))
    _, ref_bytes = _step(full, x, y, precision)
    _, saved = _step(masked, x, y, precision)
    frozen_bytes = sum(p.numel() * 2 for p in masked.parameters() if not p.requires_grad)
    assert saved <= ref_bytes, (f"{model_name}/{precision}: the backward-masked forward saves {saved} B, the full model "
                                f"{ref_bytes} B ({len(frozen)} frozen tensors, {frozen_bytes} B as bf16)")
