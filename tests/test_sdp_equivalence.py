"""Coverage 1: SDP (forward and backward masking, block and neuron level) reproduces DDP's loss at
every step and DDP's evaluation loss and accuracy under the default evaluation protocol, on a
BatchNorm ResNet, through the real launcher (sdp.driver.train's validate + elastic launch)."""

from __future__ import annotations

import pytest

from tests.helpers import CORE, run_job

COMMON = ["model=resnet18_cifar", "model.width=8", "dataset=digits", "cluster.world_size=2", "train.steps=5",
          "train.batch_size=16", "train.eval_every=0", "train.warmup_steps=1"]


@pytest.mark.dist
@CORE
@pytest.mark.timeout(600)
def test_coverage_one_matches_ddp_every_step(tmp_path) -> None:  # noqa: ANN001
    ddp_summary, ddp = run_job(COMMON + ["parallelism=ddp"], run_dir=tmp_path / "ddp")
    ref = [r["loss"] for r in ddp if "loss" in r]
    ref_eval = ddp_summary["final"]
    assert ddp_summary["eval_protocol"]["bn"] == "reestimate", ddp_summary["eval_protocol"]
    assert len(ref) == 5
    for preset in ("sdp", "sdp_block_bwd", "sdp_neuron_fwd", "sdp_neuron_bwd"):
        summary, rows = run_job(COMMON + [f"parallelism={preset}", "parallelism.coverage=1.0"], run_dir=tmp_path / preset)
        losses = [r["loss"] for r in rows if "loss" in r]
        assert len(losses) == 5, preset
        for step, (a, b) in enumerate(zip(losses, ref), start=1):
            assert abs(a - b) <= 1e-5, f"{preset} step {step}: loss {a} vs DDP {b}"
        assert summary["strategy_info"]["plan"]["k"] == 2
        assert summary["eval_protocol"] == ddp_summary["eval_protocol"], preset
        got = summary["final"]
        assert abs(got["eval_loss"] - ref_eval["eval_loss"]) <= 1e-5, f"{preset}: eval loss {got} vs DDP {ref_eval}"
        assert got["eval_accuracy"] == ref_eval["eval_accuracy"], f"{preset}: eval accuracy {got} vs DDP {ref_eval}"


@pytest.mark.dist
@CORE
@pytest.mark.timeout(300)
def test_assembly_gap_is_zero_when_every_worker_holds_the_whole_model(tmp_path) -> None:  # noqa: ANN001
    """eval.subnetworks, eval.ensemble: at C = 1 (no BatchNorm, so no statistics to differ) each worker's
    own subnetwork is the assembled model, so the gap is 0 and the ensemble is that model; backward masking
    trains the full model on every worker and reports no subnetwork or ensemble figures."""
    mlp = ["model=mlp", "dataset=digits", "cluster.world_size=2", "train.steps=3", "train.batch_size=8",
           "train.eval_every=0", "train.warmup_steps=1"]
    full, rows = run_job(mlp + ["parallelism=sdp", "parallelism.coverage=1.0"], run_dir=tmp_path / "c1")
    f = full["final"]
    assert f["eval_loss_workers"] == pytest.approx(f["eval_loss"], abs=1e-6) and abs(f["assembly_gap"]) <= 1e-6, f
    # eval.ensemble (default on): the workers' mean probability is the model's own at C = 1, in both files
    assert f["eval_loss_ensemble"] == pytest.approx(f["eval_loss"], rel=1e-6) and f["eval_accuracy_ensemble"] == f["eval_accuracy"], f
    assert [r["eval_loss_ensemble"] for r in rows if "eval_loss" in r] == [f["eval_loss_ensemble"]], rows
    half, _ = run_job(mlp + ["parallelism=sdp", "parallelism.coverage=0.5"], run_dir=tmp_path / "c05")
    assert half["final"]["assembly_gap"] is not None and half["eval_protocol"]["subnetworks"] is True
    bwd, _ = run_job(mlp + ["parallelism=sdp_block_bwd"], run_dir=tmp_path / "bwd")
    assert bwd["final"]["eval_loss_workers"] is None and bwd["final"]["assembly_gap"] is None, bwd["final"]
    assert bwd["final"]["eval_loss_ensemble"] is None and bwd["eval_protocol"]["ensemble"] is True, bwd  # nothing to ensemble
