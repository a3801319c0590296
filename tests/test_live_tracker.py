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


def test_the_host_side_of_a_batch_does_not_count_and_its_device_copy_does() -> None:
    """A GPU run draws the sampler's epoch permutation and assembles a batch on the host; only the batch it moves
    to the device counts. On a CPU run the permutation (8 bytes per training sample, drawn inside the first step
    of an epoch) used to count as an activation: 1.6 MB on the LM study's task, in every method's peak."""
    from torch.utils.data import TensorDataset

    from sdp.data.base import DataBundle, GlobalBatchSampler, train_batches
    from sdp.rank.device_batches import device_batches

    samples, batch, seq = 100_000, 8, 16
    x_all = torch.zeros(samples, seq, dtype=torch.long)
    data = DataBundle(train=TensorDataset(x_all, x_all), val=TensorDataset(x_all[:8], x_all[:8]), task="lm",
                      num_classes=4, input_shape=(seq,))
    for tracked in (False, True):
        peak = PeakTracker(device=torch.device("cpu"))
        peak.start()
        try:
            peak.set_phase("train")
            sampler = GlobalBatchSampler(num_samples=samples, global_batch=batch, seed=0)
            raw = train_batches(data, sampler=sampler, start=0, stop=2, replica=0, replicas=1)
            kept = list(device_batches(raw, device=torch.device("cpu"), peak=peak if tracked else None))
            out = peak.summary()
        finally:
            peak.stop()
        pair = 2 * batch * seq * 8  # (inputs, targets) of one step, int64
        assert sampler._perm is not None and sampler._perm.numel() == samples and len(kept) == 2
        if tracked:  # the two steps' batches are live, the permutation (800 000 bytes) is not counted
            assert out["train_peak_bytes"] == 2 * pair, out
        else:  # without the host side the permutation is an activation of the step that drew it
            assert out["train_peak_bytes"] >= samples * 8, out


def test_a_storage_resized_in_place_counts_its_new_size() -> None:
    """FSDP2 frees a block's gathered parameters with ``untyped_storage().resize_(0)`` and gathers into them again
    after ``resize_(size)``; no dispatch mode sees either, so the tracker follows ``resize_`` itself (it kept every
    block's gathered parameters live after their first gather: FSDP's peaks read 1.6 MB high on the LM study)."""
    original = torch.UntypedStorage.resize_
    with LiveTensorTracker() as tr:
        a = torch.empty(1000)
        assert tr.total == 4000
        a.untyped_storage().resize_(0)
        assert tr.total == 0 and tr.peak == 4000, (tr.total, tr.peak)
        a.untyped_storage().resize_(8000)
        assert tr.total == 8000 and tr.peak == 8000, (tr.total, tr.peak)
        untracked = torch.UntypedStorage(100)
        untracked.resize_(0)  # not a tensor's output: nothing to follow
        assert tr.total == 8000 and tr.by_cat["activations"] == 8000
        del a
        assert tr.total == 0
    assert torch.UntypedStorage.resize_ is original  # the hook leaves with the last tracker


def test_a_batch_that_is_a_view_of_the_ignored_dataset_adds_nothing() -> None:
    """A slice of the in-memory dataset shares its storage: on the CPU it costs no bytes, and counting it would
    count the whole dataset."""
    peak = PeakTracker(device=torch.device("cpu"))
    peak.start()
    try:
        data = torch.zeros(10_000, 16)
        peak.ignore([data])
        with peak.host_side():
            copy = data[torch.arange(8)]  # advanced indexing: a new storage, the batch
        peak.on_device([data[:8], copy])
        assert peak.tracker is not None and peak.tracker.total == copy.numel() * 4, peak.tracker.by_cat
    finally:
        peak.stop()
