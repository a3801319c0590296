"""SDP's evaluation peak is at most DDP's at a default-like evaluation batch (one larger than a rank's
validation shard), measured as the worker measures it: the CPU live-tensor tracker's ``eval`` phase
(sdp.metrics.memory.PeakTracker) on spawned gloo ranks, after real training steps. Both of SDP's
evaluations count: the assembled model (part by part) and each worker's own subnetwork, which must
run one rank's shard per forward, as DDP does, not the whole validation set at once."""

from __future__ import annotations

from typing import Any

import pytest

# 128 validation images over 2 ranks: a shard of 64, below train.eval_batch_size (the default 256), as the
# benchmark's synthetic sets are; width 8 keeps the model state small next to the activations
COMMON = ["model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=32", "dataset.num_val=128",
          "train.batch_size=8", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0", "optim=sgd",
          "cluster.world_size=2"]


def _eval_peaks(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, int]:
    from sdp.results.loggers import NullLogger
    from sdp.metrics.memory import PeakTracker
    from sdp.metrics.timing import PhaseTimer
    from sdp.rank.trainer import Trainer
    from sdp.rank.worker import dataset_tensors
    from tests.helpers import make_strategy
    import torch

    from sdp.subnet.assemble import PartwiseAssembly

    builds, build = [], PartwiseAssembly.part
    PartwiseAssembly.part = lambda self, i: (builds.append(i), build(self, i))[1]  # type: ignore[method-assign]
    out = {}
    for name, config in configs.items():
        peak = PeakTracker(device=torch.device("cpu"))
        peak.start()
        try:
            strategy, data, cfg = make_strategy(config, rank, world)
            peak.ignore(dataset_tensors(data))  # the in-memory dataset is not the strategy's memory (as the worker)
            trainer = Trainer(cfg=cfg, strategy=strategy, data=data, logger=NullLogger(),
                              timer=PhaseTimer(device=strategy.ctx.device), peak=peak)
            trainer.fit()
            summary = peak.summary()
        finally:
            peak.stop()
        out[name] = int(summary["eval_peak_bytes"])
    out["builds"] = len(builds)
    return out


@pytest.mark.slow  # slow tier (CI time)
@pytest.mark.dist
@pytest.mark.core
@pytest.mark.timeout(240)
def test_sdp_evaluation_peak_is_at_most_ddps_at_the_default_eval_batch() -> None:
    from tests.helpers import config_dict, spawn

    configs = {"ddp": config_dict([*COMMON, "parallelism=ddp"]),
               "sdp": config_dict([*COMMON, "parallelism=sdp", "parallelism.coverage=0.5"])}
    assert configs["ddp"]["train"]["eval_batch_size"] == 256, "the default evaluation batch"
    got = spawn(_eval_peaks, world=2, args=(configs,))
    ddp, sdp = max(r["ddp"] for r in got), max(r["sdp"] for r in got)
    assert sdp <= ddp, f"eval peak (fullest rank): SDP {sdp / 2**20:.2f} MiB > DDP {ddp / 2**20:.2f} MiB ({got})"
    # one evaluation builds each of ResNet-18's 10 parts (stem, 8 blocks, head) twice: one pass for the 4
    # calibration batches (4 x 8 samples, within the 64-sample validation batch), one for the validation shard
    # (64 samples <= 256: one batch), not once per batch
    assert [r["builds"] for r in got] == [2 * 10] * 2, got
