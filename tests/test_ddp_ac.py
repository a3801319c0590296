"""DDP + activation checkpointing: the same numbers as DDP (losses, BatchNorm statistics, evaluation)
with fewer bytes kept for backward, measured with saved-tensor hooks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sdp.metrics.activations import measure_saved_tensors
from sdp.models.resnet import ResNetCIFAR
from sdp.parallel.ac import apply_checkpointing
from sdp.core.loss import loss_fn
from tests.helpers import run_job, train_losses


def tiny_resnet() -> ResNetCIFAR:
    torch.manual_seed(0)
    return ResNetCIFAR(num_classes=10, width=8, image_size=16)


def fwd_bwd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    params = list(model.parameters())
    with measure_saved_tensors(exclude=params) as meter:
        loss = loss_fn(model(x), y)
    loss.backward()
    return meter.bytes


@pytest.mark.parametrize("every", [1, 2])
def test_checkpointing_keeps_numbers_and_saves_activation_bytes(every: int) -> None:
    plain, ac = tiny_resnet(), tiny_resnet()
    apply_checkpointing(ac, every=every)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
    plain_bytes, ac_bytes = fwd_bwd(plain, x, y), fwd_bwd(ac, x, y)
    for (name, p), q in zip(plain.named_parameters(), ac.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    for (name, b), c in zip(plain.named_buffers(), ac.buffers()):  # BatchNorm updated once, not twice
        assert torch.equal(b, c), f"{name}: recomputation changed the buffer"
    assert ac_bytes < plain_bytes * (0.5 if every == 1 else 0.8), f"AC {ac_bytes} B vs plain {plain_bytes} B"


def test_meter_excludes_parameters_and_counts_storages_once() -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with measure_saved_tensors(exclude=list(lin.parameters())) as meter:
        h = lin(x)
        (h * h).sum()  # h saved twice by mul, counted once
    assert meter.bytes == x.numel() * 4 + h.numel() * 4, meter.bytes


@pytest.mark.dist
@pytest.mark.slow  # slow tier (CI time: ~20-35 s)
@pytest.mark.timeout(240)
def test_ddp_ac_losses_equal_ddp(tmp_path: Path) -> None:
    common = ["model=resnet18_cifar", "model.width=4", "dataset=synthetic", "dataset.image_size=8",
              "train.steps=5", "train.batch_size=8", "train.eval_every=0", "train.warmup_steps=1"]
    ddp, ddp_rows = run_job(["parallelism=ddp", *common], world=2, run_dir=tmp_path / "ddp")
    ac, ac_rows = run_job(["parallelism=ddp_ac", *common], world=2, run_dir=tmp_path / "ac")
    a, b = train_losses(ddp_rows), train_losses(ac_rows)
    assert len(a) == len(b) == 5
    for step, (la, lb) in enumerate(zip(a, b)):
        assert abs(la - lb) < 1e-6, f"step {step + 1}: ddp {la:.7f} vs ddp_ac {lb:.7f}"
    assert abs(ddp["final"]["eval_loss"] - ac["final"]["eval_loss"]) < 1e-6, (ddp["final"], ac["final"])
    info = ac["strategy_info"]
    assert info["checkpointed_blocks"] == list(range(8)), info
    kept = [[m["activation_bytes"] for m in s["memory"]["per_rank"]] for s in (ddp, ac)]
    assert all(0 < b < a for a, b in zip(*kept)), f"saved-for-backward bytes per rank: ddp {kept[0]}, ddp_ac {kept[1]}"
