"""Consolidation with world-averaged gradients (``parallelism.consolidate_average=world``, issue 39): every block's
gradient averaged over all ranks, kept with its optimizer state by the block's holders only
(:mod:`sdp.subnet.world_sync`). Its mechanism: from the first step at C = 0.5 it trains what DDP trains (each held
block steps with DDP's gradient, the non-held ones are refreshed from a holder); non-holders free their copies (the
gradient bytes a rank holds after backward are its held ones); the first phase is the holders' consolidation's; a
resume across the switch ends where the uninterrupted run ends. The budget's charge is
``tests/test_consolidate.py``'s phase-step test's rule with every block's weight gradients
(:func:`test_the_budget_charges_every_blocks_weight_gradients`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sdp.parallel.sdp_consolidate import later_phase_fraction
from sdp.metrics.flops import BlockShare
from tests.helpers import run_job, train_losses

MLP = ["model=mlp", "dataset=digits", "cluster.world_size=2", "train.batch_size=8", "train.eval_every=0",
       "train.warmup_steps=1", "optim.schedule=constant", "train.budget=iterations"]
WORLD = ["parallelism=sdp", "parallelism.coverage=0.5", "parallelism.consolidate_average=world",
         "parallelism.bucket_cap_mb=0.3"]  # the MLP's block is 0.26 MB: one bucket per block


def phases(summary: dict) -> list[int]:
    return [p["steps"] for p in summary["budget"]["phases"]]


@pytest.mark.dist
@pytest.mark.core  # the equivalence that makes the remedy what it claims: world averaging at C = 0.5 trains DDP's model
@pytest.mark.timeout(600)
def test_world_averaged_consolidation_from_the_first_step_is_ddp(tmp_path: Path) -> None:
    """f = 1 at C = 0.5, rescale none: each rank holds half the blocks, yet every step's loss and the evaluation are
    DDP's (float tolerance: the same sums, other buckets), and each rank ends a backward holding only its held
    gradients plus the shared parts, less than DDP's full set (that the holders' average trains otherwise: the next
    test, after the switch)."""
    ddp_summary, ddp = run_job(MLP + ["train.steps=6", "parallelism=ddp"], run_dir=tmp_path / "ddp")
    world, rows = run_job(MLP + ["train.steps=6", *WORLD, "parallelism.consolidate=1", "parallelism.rescale=none"],
                          run_dir=tmp_path / "world")
    assert phases(world) == [0, 6] and world["strategy_info"]["consolidate"]["average"] == "world", world["budget"]
    for step, (a, b) in enumerate(zip(train_losses(rows), train_losses(ddp), strict=True), start=1):
        assert abs(a - b) <= 1e-5, f"step {step}: world-averaged consolidation {a} vs DDP {b}"
    got, want = world["final"]["eval_loss"], ddp_summary["final"]["eval_loss"]
    assert abs(got - want) <= 1e-5, f"eval: {got} vs DDP {want}"
    full = [m["grad_bytes"] for m in ddp_summary["memory"]["per_rank"]]
    mine = [m["grad_bytes"] for m in world["memory"]["per_rank"]]
    assert all(0 < g < f for g, f in zip(mine, full)), f"gradient bytes after backward by rank: {mine} vs DDP's {full}"


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_world_averaging_acts_after_the_switch_and_resumes_across_it(tmp_path: Path) -> None:
    """f = 0.5: the steps before either run's switch are the holders' consolidation's (world averaging acts in phase 2
    only; its steps cost more, so its switch comes later), those after differ; a run stopped one step after the switch and resumed (``train.resume=auto``) rebuilds the
    world sync and ends exactly where the uninterrupted run ends."""
    job = MLP + ["train.steps=8", *WORLD, "parallelism.consolidate=0.5", "train.checkpoint_every=1", "train.checkpoint_keep=0"]
    full, rows = run_job(job, run_dir=tmp_path / "full")
    held, holder_rows = run_job([o for o in job if "consolidate_average" not in o], run_dir=tmp_path / "holders")
    s1, first = phases(full)[0], min(phases(full)[0], phases(held)[0])  # world's phase 2 costs more: fewer steps
    a, b = train_losses(rows), train_losses(holder_rows)
    assert 0 < s1 < 7 and a[:first] == b[:first] and a[s1 + 1:] != b[s1 + 1:], (phases(full), phases(held), a, b)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed)
    for step in range(s1 + 2, 9):
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    (resumed / "summary.json").unlink()
    again, again_rows = run_job(job + ["train.resume=auto"], run_dir=resumed)
    assert train_losses(again_rows) == a and again["final"] == full["final"], (train_losses(again_rows), a)


def test_the_budget_charges_every_blocks_weight_gradients() -> None:
    """World averaging computes every block's weight gradients on every rank: its step costs what the holders' step
    costs with the held forward fraction at 1 (a C = 1 step); the teacher's forward stays the worker's own."""
    shares = {b: BlockShare(branch=0.2, split=0.2) for b in range(4)}  # 0.8 of the forward in branches
    holders = later_phase_fraction(shares=shares, forward=0.6, alpha=0.0)
    world = later_phase_fraction(shares=shares, forward=0.6, alpha=0.0, weights=1.0)
    c1 = later_phase_fraction(shares=shares, forward=1.0, alpha=0.0)
    assert holders < world == c1, (holders, world, c1)
    taught = later_phase_fraction(shares=shares, forward=0.6, alpha=0.5, weights=1.0)
    assert abs(taught - world - 0.6 / 3) < 1e-12, (taught, world)
