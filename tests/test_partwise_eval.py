"""Part-by-part evaluation (sdp.rank.evaluation.partwise_totals, sdp.subnet.assemble.PartwiseAssembly)
gives the numbers of the whole assembled model, on spawned gloo ranks, after real training steps:
BatchNorm re-estimated or averaged, block and neuron level, forward and backward masking, several
batches per pass, and ranks whose validation shards differ in length. And it never builds the whole
model: the largest part it builds is smaller than the model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import batch, config_dict, core_cases, make_strategy, spawn
from sdp.rank import evaluation
from sdp.rank.evaluation import Partwise
from sdp.subnet.assemble import set_branch_scales, tensor_map
from sdp.core.loss import loss_fn

RESNET = ["model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=8", "dataset.num_val=49",
          "train.batch_size=4", "train.eval_batch_size=4", "optim=sgd"]
LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "optim=adamw", "train.batch_size=2",
         "train.eval_batch_size=3", "model.n_kv_heads=null"]


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _both(rank: int, world: int, config: dict[str, Any], part_batches: list[int]) -> dict[str, Any]:
    strategy, data, cfg = make_strategy(config, rank, world)
    for step in range(3):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
    bn = str(cfg.eval.bn)
    recent = lambda: [batch(data, cfg, step=s, rank=rank, world_size=world)[0] for s in (1, 2)]  # noqa: E731
    common = dict(bn=bn, bn_batches=recent, ctx=strategy.ctx, data=data, rank=rank, world_size=world,
                  batch_size=int(cfg.train.eval_batch_size), num_workers=0)
    out: dict[str, Any] = {}
    for n in part_batches:
        with strategy.eval_module() as parts:
            assert isinstance(parts, Partwise), type(parts)
            out[n] = evaluation.totals(parts, part_batches=n, **common)
            out["part_bytes"] = parts.part_bytes
    full = strategy._assemble()  # the whole assembled model, as evaluation built it before
    set_branch_scales(full, strategy.plan, scale=strategy.plan.k / strategy.plan.world_size if strategy.rescale == "eval" else 1.0)
    out["full"] = evaluation.totals(full.eval(), **common)
    out["full_bytes"] = sum(t.numel() * t.element_size() for t in tensor_map(full).values())
    return out


CASES = {
    "block_fwd_reestimate": RESNET + ["parallelism=sdp", "parallelism.coverage=0.5"],
    "block_fwd_average": RESNET + ["parallelism=sdp", "parallelism.coverage=0.5", "eval.bn=average"],
    "neuron_fwd": RESNET + ["parallelism=sdp_neuron_fwd", "parallelism.coverage=0.5"],
    "block_bwd": RESNET + ["parallelism=sdp_block_bwd", "parallelism.coverage=0.5"],
    "llama_block_fwd": LLAMA + ["parallelism=sdp", "parallelism.coverage=0.5"],
}


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", core_cases(list(CASES), ids=list(CASES), core=set()))  # slow tier (CI time)
def test_partwise_evaluation_equals_the_whole_assembled_model(name: str) -> None:
    world = 4 if name != "llama_block_fwd" else 2
    got = spawn(_both, world=world, args=(config_dict(CASES[name] + [f"cluster.world_size={world}"]), [1, 3]))
    counts = sorted({int(r["full"][2]) for r in got})
    if name.startswith("block_fwd"):
        assert len(counts) > 1, f"the val shards should differ in length to test empty passes: {counts}"
    for r, res in enumerate(got):
        full = res["full"]
        assert full[2] > 0, f"rank {r}: no validation sample"
        for n in (1, 3):
            part = res[n]
            assert part[2] == full[2] and part[1] == full[1], f"{name} rank {r} part_batches={n}: {part} vs whole {full}"
            assert torch.allclose(part[0], full[0], rtol=1e-6, atol=1e-9), f"{name} rank {r} part_batches={n}: {part} vs whole {full}"
        assert 0 < res["part_bytes"] < res["full_bytes"], (res["part_bytes"], res["full_bytes"])
