"""Activation checkpointing under bf16 autocast: a checkpointed block runs with autocast's weight-cast cache off
(sdp.core.precision.weight_cache_off, entered by sdp.parallel.ac), on the ranks and in sdp-plan's emulation alike.

Why it is tested: autocast caches the bf16 cast of every float32 weight that requires grad until the forward's region
ends, so with the cache on, a checkpointed model keeps a bf16 copy of every checkpointed block's weights through the
forward although the checkpoints need none of it (at Llama-3.1-8B, 8 GPUs, the plan put 6.5 GiB of it on world-
averaged consolidation alone). Each test compares the same model with the cache left on (the old behaviour,
restored by patching the context out) and fails if the two forwards peak alike; the values must not move."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

import sdp.parallel.ac as ac
from sdp.core.loss import loss_fn
from sdp.metrics.live import LiveTensorTracker
from sdp.models.llama import LLaMA
from sdp.parallel.device_forward import device_forward


def _model(*, checkpointed: bool) -> LLaMA:
    torch.manual_seed(0)
    model = LLaMA(vocab_size=64, max_seq_len=32, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden=352)
    if checkpointed:
        ac.apply_checkpointing(model, every=1)
    return model


def _block_cast_bytes(model: LLaMA) -> int:
    """The bf16 casts the cache would keep: every block's float32 weight that a linear layer casts (2-D ones)."""
    return sum(p.numel() * 2 for p in model.blocks.parameters() if p.dim() == 2)


def _step(model: LLaMA, *, device: str) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """(the forward's live-byte peak above its start, the loss, the gradients) of one bf16 step of ``model`` on
    ``device`` (``cpu``: real autocast; ``meta``: the planner's emulation of CPU autocast)."""
    if device == "meta":
        model = model.to("meta")
    x = model.example_input(4).to(device)
    region = device_forward(precision="bf16", device="cpu") if device == "meta" else torch.autocast("cpu", dtype=torch.bfloat16)
    with LiveTensorTracker(device_type=device) as tracker:
        start = tracker.total
        with region:
            out = model(x)
            loss = loss_fn(out, torch.zeros(out.shape[:-1], dtype=torch.long, device=device))
        forward = tracker.peak - start
        del out
        loss.backward()
    return forward, loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_checkpointed_forward_keeps_no_bf16_copy_of_the_block_weights(device: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward's peak with the cache off is below the peak with it on by at least 90 % of the blocks' bf16
    weight bytes (the casts the cache kept), measured by the live-tensor tracker on the CPU and rehearsed on meta."""
    model = _model(checkpointed=True)
    cached_model = copy.deepcopy(model)
    off, _, _ = _step(model, device=device)
    with monkeypatch.context() as patch:
        patch.setattr(ac, "weight_cache_off", lambda **_: nullcontext())
        on, _, _ = _step(cached_model, device=device)
    cast = _block_cast_bytes(model)
    assert on - off >= 0.9 * cast, \
        f"{device}: forward peak {off} B with the cache off, {on} B with it on: {on - off} B apart, the blocks' casts {cast} B"


def test_the_values_are_those_of_no_checkpointing_bit_for_bit() -> None:
    """A cast is exact whether cached or not: loss and every gradient of the checkpointed bf16 step equal the plain
    model's (and the cached checkpointed one's), bit for bit."""
    _, plain_loss, plain_grads = _step(_model(checkpointed=False), device="cpu")
    _, loss, grads = _step(_model(checkpointed=True), device="cpu")
    assert torch.equal(loss, plain_loss), (loss.item(), plain_loss.item())
    differ = [i for i, (g, h) in enumerate(zip(grads, plain_grads)) if not torch.equal(g, h)]
    assert not differ, f"gradients {differ} differ from the plain model's"
