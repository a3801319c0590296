"""train.ac: activation checkpointing as a training option of every strategy (sdp/parallel/ac.py).

The numbers do not change (losses equal to no AC, bit for bit, on DDP, SDP with either masking and FSDP2),
the bytes kept for backward drop, measured by the trainer and predicted by sdp-plan alike, the ddp_ac preset
is DDP with train.ac=full, and bad values are refused naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from sdp.errors import ConfigError
from sdp.parallel import STRATEGIES, JobFacts
from tests.helpers import CORE, compose, run_job, train_losses

SMALL = ["model=resnet18_cifar", "model.width=4", "dataset=synthetic", "dataset.image_size=8", "train.batch_size=8",
         "train.steps=4", "train.warmup_steps=1", "train.eval_every=0", "cluster.world_size=2"]


def test_a_copy_of_a_checkpointed_model_stays_checkpointed() -> None:
    """SDP's skeleton and the planner's rehearsals deep-copy the model: the copy's blocks checkpoint themselves,
    not the original's (the old per-instance forward closed over the original block)."""
    from sdp.metrics.activations import measure_saved_tensors
    from sdp.models.resnet import ResNetCIFAR
    from sdp.parallel.ac import apply_checkpointing

    torch.manual_seed(0)
    model = ResNetCIFAR(num_classes=10, width=8, image_size=16)
    assert apply_checkpointing(model, every=2) == [0, 2, 4, 6], [type(b).__name__ for b in model.blocks]
    twin = copy.deepcopy(model)
    x = torch.randn(4, 3, 16, 16)
    with measure_saved_tensors(exclude=list(twin.parameters())) as meter:
        twin(x).sum().backward()
    assert all(p.grad is not None for p in twin.parameters()), "the copy's backward reached the copy's parameters"
    assert all(p.grad is None for p in model.parameters()), "the copy recomputed through the original's blocks"
    assert apply_checkpointing(model, every=2) == [0, 2, 4, 6]  # twice: the same classes, no nesting
    assert type(model.blocks[0]) is type(twin.blocks[0]), (type(model.blocks[0]), type(twin.blocks[0]))
    assert meter.bytes > 0


@pytest.mark.parametrize("overrides, message", [
    (["train.ac=full", "train.ac_every=0"], "train.ac_every=0 is invalid: must be an integer >= 1"),
    (["parallelism=ddp_ac", "train.ac=full", "train.ac_every=2"], "train.ac_every=2 disagrees with parallelism.ac_every=1"),
], ids=["every-zero", "preset-disagrees"])
def test_bad_values_are_refused_naming_the_key(overrides: list[str], message: str) -> None:
    cfg = compose([*SMALL, *overrides])
    with pytest.raises(ConfigError, match=message):
        JobFacts.of(cfg)


def test_pipeline_refuses_train_ac_by_name() -> None:
    cfg = compose([*SMALL, "parallelism=pipeline", "train.ac=full"])
    with pytest.raises(ConfigError, match="train.ac=full is not supported with parallelism.name='pipeline'"):
        STRATEGIES.get("pipeline").validate(cfg=cfg.parallelism, job=JobFacts.of(cfg))


def test_job_reads_train_ac_and_the_ddp_ac_preset_alike() -> None:
    assert JobFacts.of(compose(SMALL)).ac_every == 0
    assert JobFacts.of(compose([*SMALL, "train.ac=full", "train.ac_every=3"])).ac_every == 3
    assert JobFacts.of(compose([*SMALL, "parallelism=ddp_ac", "parallelism.ac_every=2"])).ac_every == 2
    recorded = OmegaConf.to_container(compose([*SMALL, "parallelism=ddp_ac"]))  # a run recorded before train.ac existed
    del recorded["train"]["ac"], recorded["train"]["ac_every"]
    recorded = OmegaConf.create(recorded)
    assert JobFacts.of(recorded).ac_every == 1
    # (no committed run is of that form any more: the last, cpu-4ranks/resnet18's ddp_ac, was measured again)
    assert int(recorded.parallelism.ac_every) == 1, recorded.parallelism
    assert STRATEGIES.get(str(recorded.parallelism.name)).method_label(cfg=recorded.parallelism) == "DDP+AC"


@pytest.mark.slow  # three strategies planned twice on the meta device
def test_plan_predicts_fewer_activation_bytes_with_ac_for_every_strategy() -> None:
    from sdp.planning.planner import predict

    for par in ("parallelism=ddp", "parallelism=sdp", "parallelism=fsdp", "parallelism=ddp_stochastic_depth", "parallelism=local_sgd"):
        plain, ac = (predict(compose([*SMALL, par, *extra]))["memory"]["per_rank"] for extra in ([], ["train.ac=full"]))
        for r, (a, b) in enumerate(zip(plain, ac)):
            assert 0 < b["activation_bytes"] < 0.6 * a["activation_bytes"], (par, r, a["activation_bytes"], b["activation_bytes"])
            assert b["train_peak_bytes"] < a["train_peak_bytes"], (par, r, a["train_peak_bytes"], b["train_peak_bytes"])
    preset, option = (predict(compose([*SMALL, *o]))["memory"]["per_rank"]
                      for o in (["parallelism=ddp_ac"], ["parallelism=ddp", "train.ac=full"]))
    assert preset == option, (preset, option)


def test_the_ac_variants_are_their_strategy_with_train_ac_full() -> None:
    """conf/variant/ddp_ac.yaml and fsdp_ac.yaml, the LM study's AC rows: the strategy with every block checkpointed."""
    for variant, name in (("ddp_ac", "ddp_ac"), ("fsdp_ac", "fsdp")):
        cfg = compose([*SMALL, f"variant={variant}"])
        assert (str(cfg.parallelism.name), JobFacts.of(cfg).ac_every) == (name, 1), (variant, cfg.parallelism, cfg.train.ac)
    assert compose([*SMALL, "variant=fsdp_ac"]).parallelism == compose([*SMALL, "variant=fsdp"]).parallelism


def test_a_checkpointed_run_is_labelled_plus_ac_whatever_its_strategy() -> None:
    """train.ac is a training option, so the label summary.json records (report_facts) carries it: FSDP with
    train.ac=full is FSDP+AC in every report, the ddp_ac preset stays DDP+AC (no doubled suffix)."""
    for variant, label in (("fsdp_ac", "FSDP+AC"), ("fsdp", "FSDP"), ("ddp_ac", "DDP+AC"), ("ddp", "DDP")):
        cfg = compose([*SMALL, f"variant={variant}"])
        facts = STRATEGIES.get(str(cfg.parallelism.name)).report_facts(
            cfg=cfg.parallelism, world_size=int(cfg.cluster.world_size), ac=str(cfg.train.ac))
        assert facts["label"] == label, (variant, facts, cfg.train.ac)


def test_plan_step_time_adds_the_recomputed_forward() -> None:
    """FLOPs per sample stay the useful ones; compute time grows by one forward of the checkpointed blocks."""
    from sdp.models.base import forward_flop_counts
    from sdp.planning.planner import predict
    from sdp.registry import build

    hw = ["cluster.gpu=h100_80gb", "cluster.link=nvlink", "parallelism=ddp"]
    plain, ac = (predict(compose([*SMALL, *hw, *extra]))["throughput"] for extra in ([], ["train.ac=full", "train.ac_every=2"]))
    assert plain["flops_per_sample"] == ac["flops_per_sample"], (plain["flops_per_sample"], ac["flops_per_sample"])
    with torch.device("meta"):
        model = build(compose(SMALL).model)
    counts = forward_flop_counts(model)
    blocks = sum(counts[f"{type(model).__name__}.blocks.{i}"] for i in range(0, len(model.blocks), 2)) / counts["Global"]
    assert 0 < blocks < 1, blocks
    ratio = ac["compute_s"] / plain["compute_s"]
    assert abs(ratio - (1 + blocks / 3)) < 1e-9, f"compute with AC / without: {ratio}, one more forward of blocks 0, 2, ...: {1 + blocks / 3}"


def _pair(tmp_path: Path, name: str, overrides: list[str]) -> tuple[dict, dict, list[float], list[float]]:
    plain, plain_rows = run_job([*SMALL, *overrides], world=2, run_dir=tmp_path / f"{name}-plain")
    ac, ac_rows = run_job([*SMALL, *overrides, "train.ac=full"], world=2, run_dir=tmp_path / f"{name}-ac")
    return plain, ac, train_losses(plain_rows), train_losses(ac_rows)


def _check_equal(name: str, plain: dict, ac: dict, a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == 4, (name, a, b)
    assert a == b, f"{name}: losses without AC {a} vs with train.ac=full {b}"
    assert plain["final"]["eval_loss"] == ac["final"]["eval_loss"], (name, plain["final"], ac["final"])
    assert ac["strategy_info"]["checkpointed_blocks"] == list(range(8)), (name, ac["strategy_info"])
    kept = [[m["activation_bytes"] for m in s["memory"]["per_rank"]] for s in (plain, ac)]
    assert all(0 < y < x for x, y in zip(*kept)), f"{name}: saved-for-backward bytes per rank: no AC {kept[0]}, AC {kept[1]}"


@pytest.mark.dist
@CORE
@pytest.mark.timeout(300)
def test_ac_equals_no_ac_on_ddp_and_the_preset_equals_the_option(tmp_path: Path) -> None:
    plain, ac, a, b = _pair(tmp_path, "ddp", ["parallelism=ddp"])
    _check_equal("ddp", plain, ac, a, b)
    preset, preset_rows = run_job([*SMALL, "parallelism=ddp_ac"], world=2, run_dir=tmp_path / "ddp_ac")
    assert train_losses(preset_rows) == b, (train_losses(preset_rows), b)
    assert [m["activation_bytes"] for m in preset["memory"]["per_rank"]] == [m["activation_bytes"] for m in ac["memory"]["per_rank"]]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, overrides", [
    ("sdp_forward", ["parallelism=sdp"]),
    ("sdp_backward", ["parallelism=sdp_block_bwd"]),
    ("fsdp", ["parallelism=fsdp"]),
    ("stochastic_depth", ["parallelism=ddp_stochastic_depth"]),
    ("local_sgd", ["parallelism=diloco", "parallelism.inner_steps=3"]),  # a sync after step 3, the last (4) too
], ids=["sdp-forward", "sdp-backward", "fsdp", "stochastic-depth", "local-sgd"])
def test_ac_equals_no_ac_on_every_strategy(tmp_path: Path, name: str, overrides: list[str]) -> None:
    _check_equal(name, *_pair(tmp_path, name, overrides))
