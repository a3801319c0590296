"""train.ac=op: torchtitan's selective op activation checkpointing (sdp/parallel/ac_op.py).

Its mechanism: the losses and gradients equal no checkpointing bit for bit; a block keeps its matmul and attention
outputs but every second matmul's, so the bytes kept for backward lie between full checkpointing and none, and the
activation meter sees what the checkpoint's cache keeps; the recomputed FLOPs are the matmuls it does not keep,
counted from the matmuls' shapes; the option reads, labels and refuses as train.ac=full does. The planner's peak
against the tracker: tests/test_plan_peaks.py (case ddp_llama_ac_op)."""

from __future__ import annotations

import copy

import pytest
import torch

from sdp.errors import ConfigError
from sdp.metrics.activations import measure_saved_tensors
from sdp.models.llama import LLaMA
from sdp.parallel import STRATEGIES, JobFacts
from sdp.parallel.ac import apply_checkpointing, recompute_share
from sdp.parallel.ac_op import keeps
from tests.helpers import CORE, compose, run_job, train_losses

SHAPE = {"vocab_size": 64, "max_seq_len": 16, "dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "hidden": 88}
SMALL = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "train.batch_size=2", "cluster.world_size=2"]


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    with measure_saved_tensors(exclude=list(model.parameters())) as meter:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], meter.bytes


def test_op_equals_no_checkpointing_and_keeps_between_full_and_none() -> None:
    torch.manual_seed(0)
    base = LLaMA(**SHAPE)
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    got = {}
    for mode in ("none", "full", "op"):
        model = copy.deepcopy(base)
        if mode != "none":
            assert apply_checkpointing(model, every=1, mode=mode) == [0, 1, 2]
        got[mode] = _step(model, x, y)
    for mode in ("full", "op"):
        assert torch.equal(got[mode][0], got["none"][0]), (mode, got[mode][0], got["none"][0])
        assert all(torch.equal(a, b) for a, b in zip(got[mode][1], got["none"][1])), f"{mode}: gradients differ"
    kept = {mode: got[mode][2] for mode in got}
    assert kept["full"] < kept["op"] < kept["none"], kept
    assert type(copy.deepcopy(model).blocks[0]).__name__ == "SelectiveCheckpointedTransformerBlock"


def test_the_recomputed_flops_are_the_matmuls_not_kept() -> None:
    """Each block runs 7 matmuls (q, k, v, o, w1, w3, w2): the policy keeps the 1st, 3rd, 5th, 7th and recomputes
    k, o and w3, one sample of max_seq_len tokens; full checkpointing recomputes the whole block."""
    with torch.device("meta"):
        model = LLaMA(**SHAPE)
    from sdp.models.base import forward_flop_counts

    total = forward_flop_counts(model)["Global"]
    t, d, kv, h = SHAPE["max_seq_len"], SHAPE["dim"], SHAPE["dim"] // SHAPE["n_heads"] * SHAPE["n_kv_heads"], SHAPE["hidden"]
    recomputed = 2 * t * (d * kv + d * d + d * h) * SHAPE["n_layers"]  # k, o and w3 of every block
    assert recompute_share(model=model, every=1, mode="op") == pytest.approx(recomputed / total, rel=1e-12)
    assert recompute_share(model=model, every=2, mode="op") == pytest.approx(recomputed * 2 / 3 / total, rel=1e-12)
    assert 0 < recompute_share(model=model, every=1, mode="op") < recompute_share(model=model, every=1) <= 1
    mm = torch.ops.aten.mm.default
    assert [keeps(mm, mm_index=i) for i in range(1, 8)] == [True, False] * 3 + [True]
    assert not keeps(torch.ops.aten.silu.default, mm_index=1)


def test_train_ac_op_reads_labels_and_refuses_a_full_preset() -> None:
    job = JobFacts.of(compose([*SMALL, "train.ac=op", "train.ac_every=2"]))
    assert (job.ac_every, job.ac_mode) == (2, "op"), job
    assert JobFacts.of(compose([*SMALL, "train.ac=full"])).ac_mode == "full"
    cfg = compose([*SMALL, "variant=fsdp", "train.ac=op"])
    facts = STRATEGIES.get("fsdp").report_facts(cfg=cfg.parallelism, world_size=2, ac="op")
    assert facts["label"] == "FSDP+SAC", facts
    with pytest.raises(ConfigError, match="train.ac=op with parallelism.name='ddp_ac'"):
        JobFacts.of(compose([*SMALL, "parallelism=ddp_ac", "train.ac=op"]))


@pytest.mark.dist
@CORE
@pytest.mark.timeout(300)
def test_op_equals_no_ac_through_the_trainer(tmp_path) -> None:
    """The rank applies the job's mode (Strategy.checkpoint_blocks): DDP on 2 gloo ranks, 4 steps, the same losses
    and evaluation as without checkpointing, every block checkpointed, fewer bytes kept for backward."""
    run = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "optim=adamw", "train.batch_size=4",
           "train.steps=4", "train.warmup_steps=2", "train.eval_every=0", "parallelism=ddp"]
    plain, plain_rows = run_job(run, world=2, run_dir=tmp_path / "plain")
    op, op_rows = run_job([*run, "train.ac=op"], world=2, run_dir=tmp_path / "op")
    assert train_losses(op_rows) == train_losses(plain_rows) and len(train_losses(op_rows)) == 4, op_rows
    assert op["final"]["eval_loss"] == plain["final"]["eval_loss"], (op["final"], plain["final"])
    assert op["strategy_info"]["checkpointed_blocks"] == list(range(4)) and op["label"] == "DDP+SAC", op["strategy_info"]
    kept = [[m["activation_bytes"] for m in s["memory"]["per_rank"]] for s in (plain, op)]
    assert all(0 < b < a for a, b in zip(*kept)), kept


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("overrides", [["parallelism=sdp"], ["parallelism=sdp_block_bwd"],
                                       ["parallelism=sdp", "parallelism.level=neuron"], ["parallelism=fsdp"]],
                         ids=["sdp-forward", "sdp-backward", "sdp-neuron", "fsdp"])
def test_op_equals_no_ac_on_every_strategy(tmp_path, overrides: list[str]) -> None:
    """SDP with either masking and at neuron level (its split matmuls are counted per block call alike in the forward
    and the recomputation) and FSDP2: the same losses and evaluation, fewer bytes kept for backward."""
    run = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "optim=adamw", "train.batch_size=4",
           "train.steps=4", "train.warmup_steps=2", "train.eval_every=0", *overrides]
    plain, plain_rows = run_job(run, world=2, run_dir=tmp_path / "plain")
    op, op_rows = run_job([*run, "train.ac=op"], world=2, run_dir=tmp_path / "op")
    assert train_losses(op_rows) == train_losses(plain_rows), (overrides, train_losses(op_rows), train_losses(plain_rows))
    assert op["final"]["eval_loss"] == plain["final"]["eval_loss"] and op["label"].endswith("+SAC"), op["label"]
    kept = [[m["activation_bytes"] for m in s["memory"]["per_rank"]] for s in (plain, op)]
    assert all(0 < b < a for a, b in zip(*kept)), (overrides, kept)
