"""The done-when runs at toy size: sdp-train on llm.c shards and on CIFAR pickles the test writes (DDP, 2 gloo ranks)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from sdp.data import cifar
from sdp.data.fineweb import write_shard
from tests.helpers import run_train


def train(run_dir: Path, *overrides: str) -> dict:
    """A 4-step DDP job on 2 ranks through ``python -m sdp.driver.train``; its summary.json."""
    return run_train(run_dir, "cluster.world_size=2", "train.steps=4", "train.batch_size=4", "train.warmup_steps=1",
                     *overrides).summary


@pytest.mark.dist
@pytest.mark.slow  # slow tier (CI time)
@pytest.mark.timeout(300)
def test_llama_tiny_trains_on_shards_with_ddp(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = tmp_path / "shards"
    data.mkdir()
    for name, n in (("fineweb_val_000000.bin", 2000), ("fineweb_train_000001.bin", 3000), ("fineweb_train_000002.bin", 3000)):
        write_shard(data / name, rng.integers(0, 256, n))
    s = train(tmp_path / "run", "model=llama_tiny", "dataset=fineweb", f"dataset.root={data}", "dataset.vocab_size=256",
              "dataset.seq_len=32", "dataset.val_tokens=512", "optim=adamw")
    assert s["world_size"] == 2 and s["steps"] == 4 and math.isfinite(s["final"]["eval_loss"])
    assert s["final"]["eval_accuracy"] is None
    assert s["data"]["val_samples"] == 16 and s["data"]["val_tokens"] == 512  # 512 // 32 of the 60 windows held


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resnet18_cifar_trains_on_unverified_pickles_and_reports_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 60)
    cifar.write_batches(root=tmp_path / "c10", num_classes=10, train=(x[:40], y[:40]), test=(x[40:], y[40:]),
                        label_names=[str(i) for i in range(10)])
    s = train(tmp_path / "run", "model=resnet18_cifar", "model.width=4", "dataset=cifar10",
              f"dataset.root={tmp_path / 'c10'}", "dataset.verify=false")
    assert math.isfinite(s["final"]["train_loss"]) and 0.0 <= s["final"]["eval_accuracy"] <= 1.0
    assert any("dataset.verify=false" in n for n in s["dataset_notes"])
