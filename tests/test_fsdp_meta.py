"""FSDP2 built on the meta device: ``fully_shard`` first, then each rank materialises only its shards
(sdp.models.init.materialise_sharded). Every parameter and buffer equals the single-process full build
bit for bit (so FSDP still trains the model DDP trains), and the set-up never holds the full model: the
live tensor bytes a rank allocates during build + setup stay below the full model's, near its shards
plus the largest single module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import CORE, config_dict, spawn

WORLD = 2
CASES = {  # name -> overrides; resnet has BatchNorm buffers (and in bf16 its own fully_shard), llama ties
    "llama_tied": ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "model.tie_embeddings=true"],
    "resnet_bf16": ["model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=8",
                    "train.precision=bf16"],
}


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _case(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    from sdp.metrics.live import LiveTensorTracker
    from sdp.parallel import STRATEGIES, DistContext, JobFacts
    from sdp.registry import build
    from sdp.rank.worker import build_model

    cfg = OmegaConf.create(config)
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    strategy = STRATEGIES.get("fsdp").runtime(cfg=cfg.parallelism, job=JobFacts.of(cfg), ctx=ctx)
    with LiveTensorTracker() as tracker:  # what the worker's set-up phase runs: build, then setup
        model = build_model(cfg, None, meta=strategy.materialises_held)
        strategy.setup(model=model, optimizer_factory=lambda params: build(cfg.optim.optimizer)(params))
    ref = build_model(cfg, None)  # the full build every other strategy starts from
    full_bytes = _nbytes(list(ref.parameters()) + list(ref.buffers()))
    largest = max(_nbytes(list(m._parameters.values()) + list(m._buffers.values())) for m in ref.modules())
    got = dict(strategy.module.named_parameters())
    differ = [n for n, p in ref.named_parameters() if not torch.equal(got[n].full_tensor(), p)]
    bufs = dict(strategy.module.named_buffers())
    differ += [n for n, b in ref.named_buffers() if not torch.equal(bufs[n], b)]
    return {"differ": differ, "peak": tracker.peak, "full_bytes": full_bytes, "largest": largest,
            "held": strategy.state_bytes()["param_bytes"] + _nbytes(strategy.module.buffers()),
            "meta_left": [n for n, t in list(strategy.module.named_parameters()) + list(strategy.module.named_buffers())
                          if t.is_meta]}


def _worker(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: _case(rank, world, config) for name, config in configs.items()}


@pytest.mark.dist
@CORE
@pytest.mark.timeout(300)
def test_fsdp_materialises_only_its_shards_with_the_full_builds_values() -> None:
    configs = {name: config_dict(["parallelism=fsdp", f"cluster.world_size={WORLD}", *o]) for name, o in CASES.items()}
    per_rank = spawn(_worker, world=WORLD, args=(configs,), timeout_s=240)
    for rank, cases in enumerate(per_rank):
        for name, r in cases.items():
            assert not r["meta_left"], f"rank {rank} {name}: still on meta after setup: {r['meta_left']}"
            assert not r["differ"], f"rank {rank} {name}: differ from the full build: {r['differ']}"
            # the full model never existed on this rank: its shards, one module in flight, FSDP's padding
            bound = r["held"] + r["largest"] + 4096
            assert r["peak"] <= bound < r["full_bytes"], (
                f"rank {rank} {name}: set-up peak {r['peak']} B, bound (held {r['held']} + largest module "
                f"{r['largest']} + 4096) {bound} B, full model {r['full_bytes']} B")
