"""A rank saves and restores the RNG state of its own CUDA device only, so a resume does not depend on
how many GPUs are visible (issue 29, item 5).

Before, ``sdp.rank.rng.capture`` saved ``torch.cuda.get_rng_state_all()`` (every visible device) and
``restore`` asserted at least as many visible devices: a job checkpointed with 8 GPUs visible per task
could not resume under a launcher that binds each task to its one GPU. No GPU is needed here: the
CUDA RNG functions are stubbed where :mod:`sdp.rank.rng` calls them (``torch.cuda``), each device holding a
distinct state, so the test sees exactly which device's state went where.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from sdp.rank import rng

CPU = torch.device("cpu")


class FakeCuda:
    """``torch.cuda``'s RNG functions over ``count`` devices; device i's state is a tensor of i's."""

    def __init__(self, count: int, current: int = 0) -> None:
        self.count, self.current = count, current
        self.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(count)}
        self.set_calls: list[tuple[int, list[int]]] = []

    def index(self, device: Any) -> int:
        device = torch.device(device) if device is not None else torch.device("cuda", self.current)
        return self.current if device.index is None else int(device.index)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def everything(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("every visible device's RNG state was touched: only the rank's own may be")

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self.index(device)].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda state, device="cuda": self.set_calls.append((self.index(device), state.tolist())))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", everything)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", everything)


def through_disk(state: dict[str, Any]) -> dict[str, Any]:
    """As a checkpoint carries it: ``torch.save`` and ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_saved_with_eight_visible_restored_with_one(monkeypatch: pytest.MonkeyPatch) -> None:
    saving = FakeCuda(count=8, current=2)
    saving.install(monkeypatch)
    state = through_disk(rng.capture(device=torch.device("cuda", 2)))
    assert torch.equal(state["torch_cuda"], saving.states[2]), "the rank's own device (cuda:2) is what is saved"

    resuming = FakeCuda(count=1, current=0)  # the same rank, its GPU now the only one it sees
    resuming.install(monkeypatch)
    rng.restore(state, device=torch.device("cuda", 0))
    assert resuming.set_calls == [(0, [2] * 8)], "cuda:2's saved state goes to the rank's device, cuda:0"


def test_cpu_rank_saves_no_cuda_state(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(count=4).install(monkeypatch)  # GPUs visible, but this rank runs on the CPU
    assert "torch_cuda" not in rng.capture(device=CPU)


def test_checkpoint_of_every_device_restores_the_rank_s_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint written before this change holds a list, one state per visible device then."""
    fake = FakeCuda(count=4, current=3)
    fake.install(monkeypatch)
    state = rng.capture(device=CPU)
    state["torch_cuda"] = [fake.states[i] for i in range(4)]
    rng.restore(through_disk(state), device=torch.device("cuda", 3))
    assert fake.set_calls == [(3, [3] * 8)]
    with pytest.raises(AssertionError, match=r"CUDA RNG states of 4 devices, none for this rank's cuda:5"):
        rng.restore(state, device=torch.device("cuda", 5))
    rng.restore(state, device=CPU)  # saved whenever CUDA was initialised: a CPU rank never drew from it
    assert fake.set_calls == [(3, [3] * 8)]


def test_cuda_state_on_a_cpu_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(count=2, current=1)
    fake.install(monkeypatch)
    state = rng.capture(device=torch.device("cuda", 1))
    with pytest.raises(AssertionError, match=r"holds a CUDA RNG state, but this rank runs on cpu"):
        rng.restore(state, device=CPU)
