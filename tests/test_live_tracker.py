"""The CPU live-tensor tracker (sdp.metrics.live) and the per-phase PeakTracker: counted once per
storage, forgotten when freed, labelled by category, a budget that raises like an OOM."""

from __future__ import annotations

import pytest
import torch

from sdp.metrics.live import LiveTensorTracker, MemoryBudgetExceeded
from sdp.metrics.memory import PeakTracker


def test_views_count_once_and_freed_storages_leave() -> None:
    with LiveTensorTracker() as tr:
        a = torch.empty(1000)
        views = [a[10:20], a.view(10, 100), a.unsqueeze(0)]
        a.add_(1)
        assert tr.total == 4000, tr.total
        b = a * 2
        assert tr.total == tr.peak == 8000
        del b
        assert tr.total == 4000 and tr.peak == 8000
        del a
        assert tr.total == 4000  # the views keep the storage alive
        del views
        assert tr.total == 0 and tr.storages == 0


def test_backward_and_labels_split_the_categories() -> None:
    with LiveTensorTracker() as tr:
        m = torch.nn.Linear(64, 32)
        x = torch.randn(16, 64)
        m(x).relu().sum().backward()
        tr.label(m.parameters(), "parameters")
        tr.label((p.grad for p in m.parameters()), "gradients")
        param_bytes = sum(p.numel() * 4 for p in m.parameters())
        assert tr.by_cat["parameters"] == tr.by_cat["gradients"] == param_bytes, tr.by_cat
        assert tr.by_cat["activations"] >= x.numel() * 4 and tr.total == sum(tr.by_cat.values())


def test_budget_raises_an_out_of_memory_error_naming_the_key() -> None:
    with LiveTensorTracker(budget_bytes=10_000) as tr:
        torch.empty(1000)
        with pytest.raises(torch.OutOfMemoryError, match="memory.budget_mb"):
            keep = torch.empty(5000)  # noqa: F841
        assert isinstance(MemoryBudgetExceeded("x"), torch.OutOfMemoryError)
        assert tr.peak > 10_000


def test_phases_hold_their_own_peaks() -> None:
    peak = PeakTracker(device=torch.device("cpu"))
    peak.start()
    try:
        model = torch.nn.Linear(100, 100)
        peak.watch(lambda: (model, None))
        peak.set_phase("train")
        tmp = torch.empty(50_000)
        del tmp
        with peak.phase("eval"):
            tmp = torch.empty(100_000)
            del tmp
        out = peak.summary()
    finally:
        peak.stop()
    state = sum(p.numel() * 4 for p in model.parameters())
    assert out["setup_peak_bytes"] == state, out
    assert out["train_peak_bytes"] == state + 200_000 and out["eval_peak_bytes"] == state + 400_000, out
    assert out["peak_categories"]["train"]["parameters"] == state and out["peak_source"] == "live_tensors"


def test_memory_keys_are_validated() -> None:
    from sdp.driver.config import validate
    from sdp.errors import ConfigError
    from tests.helpers import compose

    base = ["model=mlp", "dataset=digits", "parallelism=ddp", "cluster.world_size=1"]
    with pytest.raises(ConfigError, match="memory.budget_mb"):
        validate(compose([*base, "memory.budget_mb=-1"]))
    with pytest.raises(ConfigError, match="memory.tracker=true"):
        validate(compose([*base, "memory.budget_mb=10", "memory.tracker=false"]))
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="memory.tracker=maybe"):  # typed: refused by Hydra
        validate(compose([*base, "memory.tracker=maybe"]))
