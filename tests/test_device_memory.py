"""Device-memory figures that mean what they say, checked without a GPU: the ``torch.cuda`` memory
functions the code calls are replaced at the module boundary by a fake allocator whose current and
peak figures the test sets, so the numbers in summary.json's memory entry come from known values.

- ``cuda_max_reserved_bytes`` is the maximum over the whole run (the reserved peak is reset with the
  allocated one at every phase switch, so reading it at the end gave the last phase's);
- ``cuda_device_used_bytes`` keeps the largest use seen, not the end snapshot;
- bf16 activation bytes count autocast's weight copies the way FSDP's bf16 parameters are counted
  (not at all), so DDP/SDP and FSDP report activations by one rule, the copies of frozen weights
  (SDP's backward masking) included;
- ``sdp-bench capacity`` (:mod:`sdp.bench.capacity`) makes each rank's GPU current (a multi-GPU host put every rank on cuda:0).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from sdp.metrics.activations import measure_saved_tensors
from sdp.metrics.memory import PeakTracker

GB = 2**30
CUDA0 = torch.device("cuda", 0)


class FakeAllocator:
    """The caching allocator's figures as ``torch.cuda`` reports them, set by the test."""

    def __init__(self, *, total: int, devices: int = 1) -> None:
        self.total, self.devices = total, devices
        self.allocated = self.reserved = self.used = 0
        self.peak_allocated = self.peak_reserved = 0
        self.current: list[torch.device] = []
        self.fraction: list[tuple[float, torch.device]] = []

    def run(self, *, allocated: int, reserved: int, used: int) -> None:
        """The program now holds these (peaks rise with them)."""
        self.allocated, self.reserved, self.used = allocated, reserved, used
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.total - self.used, self.total))
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "device_count", lambda: self.devices)
        monkeypatch.setattr(cuda, "set_device", self.current.append)
        monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=self.total))
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction", lambda f, device=None: self.fraction.append((f, device)))

    def _reset(self, device: Any = None) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    alloc = FakeAllocator(total=140 * GB)
    alloc.install(monkeypatch)
    return alloc


def test_max_reserved_is_the_maximum_over_the_run(fake: FakeAllocator) -> None:
    """Set-up reserves 10 GB (a full-model transient) and releases most of it before the first step;
    the measured steps then reserve 3 GB."""
    tracker = PeakTracker(device=CUDA0)
    fake.run(allocated=8 * GB, reserved=10 * GB, used=12 * GB)
    fake.run(allocated=1 * GB, reserved=3 * GB, used=5 * GB)  # empty_cache: current figures drop, peaks stay
    tracker.set_phase("train")
    fake.run(allocated=2 * GB, reserved=3 * GB, used=5 * GB)
    s = tracker.summary()
    assert s["setup_peak_bytes"] == 8 * GB and s["train_peak_bytes"] == 2 * GB, s
    assert s["cuda_max_reserved_bytes"] == 10 * GB, \
        f"max reserved {s['cuda_max_reserved_bytes'] / GB:.1f} GB: the last phase's, not the run's 10 GB"


def test_summary_keeps_the_largest_device_use_not_the_end_snapshot(fake: FakeAllocator) -> None:
    from sdp.rank.worker import memory_record

    tracker = PeakTracker(device=CUDA0)
    fake.run(allocated=8 * GB, reserved=10 * GB, used=12 * GB)
    tracker.set_phase("train")  # the device is 12 GB in use when set-up ends
    fake.run(allocated=2 * GB, reserved=3 * GB, used=5 * GB)  # then empty_cache: 5 GB to the end
    strategy = SimpleNamespace(state_bytes=lambda: {"param_bytes": 1, "grad_bytes": 2, "optim_bytes": 3},
                               unwrapped=lambda: nn.Linear(2, 2))
    mem = memory_record(rank=0, strategy=strategy, activation_bytes=7, peak=tracker, device=CUDA0, eval_assembled_bytes=None)
    assert mem["cuda_device_used_bytes"] == 12 * GB, \
        f"device used {mem['cuda_device_used_bytes'] / GB:.1f} GB: the end snapshot replaced the run's 12 GB"
    assert mem["cuda_device_total_bytes"] == 140 * GB and mem["setup_peak_bytes"] == 8 * GB, mem


def test_capacity_makes_each_ranks_gpu_current(fake: FakeAllocator) -> None:
    fake.devices = 2
    from sdp.bench import capacity

    dev = capacity.rank_device(local_rank=3, device="cuda", budget_mb=1024)
    assert dev == torch.device("cuda", 1) and fake.current == [dev], (dev, fake.current)
    assert fake.fraction == [(1024 * 2**20 / fake.total, dev)], fake.fraction
    assert capacity.rank_device(local_rank=3, device="cpu", budget_mb=1024) == torch.device("cpu")


class _Net(nn.Module):
    """A conv and two linear layers: each saves its weight for the input gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    with torch.autocast("cpu", dtype=torch.bfloat16), measure_saved_tensors(exclude=list(model.parameters())) as meter:
        model(x).float().pow(2).mean().backward()
    return meter.bytes


def test_bf16_activations_exclude_weight_copies_under_every_strategy() -> None:
    """DDP and SDP run fp32 parameters under autocast (the layers save autocast's bf16 weight casts);
    FSDP2 runs bf16 parameters (the layers save those). One rule: neither is an activation."""
    torch.manual_seed(0)
    fp32_params = _Net()  # DDP / SDP
    bf16_params = copy.deepcopy(fp32_params).to(torch.bfloat16)  # FSDP2's unsharded parameters (param_dtype=bf16)
    x = torch.randn(4, 3, 6, 6)
    ddp, fsdp = _saved_bytes(fp32_params, x), _saved_bytes(bf16_params, x)
    weights_bf16 = sum(p.numel() * 2 for n, p in fp32_params.named_parameters() if n.endswith("weight"))
    assert ddp == fsdp > 0, (f"activation bytes: fp32 parameters under autocast {ddp} B, bf16 parameters {fsdp} B "
                             f"(bf16 weight copies: {weights_bf16} B)")
    # a cast of a tensor that is not a parameter is an activation and still counts
    x2, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), measure_saved_tensors() as plain:
        x2 @ w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), measure_saved_tensors() as param:
        x2 @ nn.Parameter(w.clone())
    assert plain.bytes - param.bytes == 8 * 8 * 2, (plain.bytes, param.bytes)


def test_bf16_casts_of_frozen_weights_are_not_activations() -> None:
    """Backward masking freezes the weights a worker does not hold (``requires_grad=False``); a frozen Linear
    between trainable ones still saves its weight for the input gradient, under autocast the weight's bf16
    cast, which has no ``grad_fn`` pointing back at the parameter. It is model state like a trainable
    weight's cast: the fp32 model under autocast saves what the same model with bf16 parameters saves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256, bias=False), nn.ReLU(), nn.Linear(256, 4))
    model[2].weight.requires_grad_(False)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the frozen weight is then a parameter the layer saves as it is
    x = torch.randn(2, 8)

    def saved(m: nn.Module) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16), measure_saved_tensors(exclude=list(m.parameters())) as meter:
            m(x).float().sum().backward()
        return meter.bytes

    cast, params = saved(model), saved(bf16)
    assert cast == params > 0, (f"activation bytes: fp32 parameters under autocast {cast} B, bf16 parameters {params} B; "
                                f"the frozen 256x256 weight's bf16 cast is {256 * 256 * 2} B")
