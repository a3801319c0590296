"""SDP's consolidation phase (``parallelism.consolidate``), distillation during it (``parallelism.distill_alpha``) and
its block drops (``consolidate_survival``), issue 39 item 2: the mechanism (at C = 1 it is DDP; alpha = 0 is no
distillation and survival 1 no drop, bit for bit), a resume across the phase switch and the budget's phase step
counts from the model's own FLOP count. The one-line refusals of bad settings are rows of the bad-input catalogue
(``tests/test_validation.py``, ``sdp-consolidate-*``, ``sdp-distill-*``, ``sdp-survival-*``); sdp-plan's consolidation peak against the tracker is ``tests/test_plan_peaks.py``
(``sdp_consolidate*``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from sdp.driver.budget import resolve_steps
from sdp.models.base import forward_flop_counts
from sdp.parallel.sdp_plan import plan_for
from sdp.registry import build
from tests.helpers import run_job, train_losses
from tests.hydra_cfg import compose_config

MLP = ["model=mlp", "dataset=digits", "cluster.world_size=2", "train.batch_size=8", "train.eval_every=0",
       "train.warmup_steps=1", "optim.schedule=constant", "train.budget=iterations"]


def phases(summary: dict) -> list[int]:
    return [p["steps"] for p in summary["budget"]["phases"]]


@pytest.mark.dist
@pytest.mark.core  # the equivalence no other default-tier test checks: consolidation at C = 1 is DDP
@pytest.mark.timeout(600)
def test_consolidation_at_full_coverage_is_ddp(tmp_path: Path) -> None:
    """C = 1: every worker holds every block, so the switch moves nothing and consolidation (backward masking of a
    model all held, every block activation-checkpointed) is DDP: the same loss at every step, from the first step
    (f = 1) or across a switch in the middle (f = 0.5), and the same evaluation."""
    ddp_summary, ddp = run_job(MLP + ["train.steps=6", "parallelism=ddp"], run_dir=tmp_path / "ddp")
    ref = train_losses(ddp)
    assert len(ref) == 6, ref
    for f in (1.0, 0.5):
        summary, rows = run_job(MLP + ["train.steps=6", "parallelism=sdp", "parallelism.coverage=1.0",
                                       f"parallelism.consolidate={f}"], run_dir=tmp_path / f"cons{f}")
        s1, s2 = phases(summary)
        assert s1 + s2 == 6 and (s1 == 0) == (f == 1.0) and s2 >= 1, summary["budget"]["phases"]
        info = summary["strategy_info"]["consolidate"]
        assert info == {"start_step": s1, "distill_alpha": 0.0, "switched": True, "survival": 1.0, "average": "holders",
                        "blocks_run_fraction": None}, info
        losses = train_losses(rows)
        for step, (a, b) in enumerate(zip(losses, ref, strict=True), start=1):
            assert abs(a - b) <= 1e-5, f"f={f} step {step} (switch after step {s1}): loss {a} vs DDP {b}"
        got, want = summary["final"], ddp_summary["final"]
        assert abs(got["eval_loss"] - want["eval_loss"]) <= 1e-5, f"f={f}: eval {got} vs DDP {want}"


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_consolidation_from_the_first_step_is_backward_masking(tmp_path: Path) -> None:
    """f = 1 under the FLOP budget runs no forward-masked step (phase 1 has 0 steps, the switch before step 0) and
    then is B_beta-SDP: with rescale=train (the consolidated blocks unscaled, as backward masking's) the same loss
    at every step and the same evaluation as ``parallelism=sdp_block_bwd`` of the same plan run for as many steps;
    C = 0.5 masks (its losses are not DDP's)."""
    cons, rows = run_job(MLP[:-1] + ["train.steps=6", "train.budget=flops", "parallelism=sdp", "parallelism.coverage=0.5",
                                     "parallelism.consolidate=1", "parallelism.rescale=train"], run_dir=tmp_path / "cons")
    s1, s2 = phases(cons)
    assert s1 == 0 and s2 == cons["steps"] and cons["strategy_info"]["consolidate"]["start_step"] == 0, cons["budget"]
    bwd, bwd_rows = run_job(MLP + [f"train.steps={s2}", "parallelism=sdp_block_bwd", "parallelism.coverage=0.5"],
                            run_dir=tmp_path / "bwd")
    assert train_losses(rows) == train_losses(bwd_rows) and cons["final"] == bwd["final"], (train_losses(rows), train_losses(bwd_rows))
    _, ddp_rows = run_job(MLP + [f"train.steps={s2}", "parallelism=ddp"], run_dir=tmp_path / "ddp")
    assert train_losses(rows) != train_losses(ddp_rows), "C = 0.5 masked nothing"


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_alpha_zero_is_no_distillation_and_alpha_half_is_not(tmp_path: Path) -> None:
    """distill_alpha=0 trains exactly what consolidation without the key trains (bit for bit, losses and evaluation);
    alpha = 0.5 leaves the first phase alone and changes the second (the teacher acts only after the switch)."""
    base = MLP + ["train.steps=8", "parallelism=sdp", "parallelism.coverage=0.5", "parallelism.consolidate=0.5"]
    plain, plain_rows = run_job(base, run_dir=tmp_path / "plain")
    zero, zero_rows = run_job(base + ["parallelism.distill_alpha=0"], run_dir=tmp_path / "zero")
    assert train_losses(plain_rows) == train_losses(zero_rows) and plain["final"] == zero["final"], (plain_rows, zero_rows)
    half, half_rows = run_job(base + ["parallelism.distill_alpha=0.5"], run_dir=tmp_path / "half")
    s1 = min(phases(plain)[0], phases(half)[0])
    a, b = train_losses(plain_rows), train_losses(half_rows)
    assert 0 < s1 < 8 and a[:s1] == b[:s1], (phases(plain), phases(half), a, b)
    assert a[phases(half)[0] + 1:] != b[phases(half)[0] + 1:], f"distillation changed nothing after the switch: {a} {b}"
    assert half["strategy_info"]["consolidate"]["distill_alpha"] == 0.5


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_survival_drops_blocks_after_the_switch_only(tmp_path: Path) -> None:
    """consolidate_survival=1 is consolidation without the key, bit for bit; at 0.5 consolidation's steps are cheaper,
    so it gets more of the budget's steps (budget.phases), the steps before the switch are unchanged (no draw
    before it), those after differ, and each rank ran about half its blocks there (rank 0's share: 4 blocks x ~20
    steps, std 0.056)."""
    base = MLP + ["train.steps=40", "parallelism=sdp", "parallelism.coverage=0.5", "parallelism.consolidate=0.5"]
    plain, plain_rows = run_job(base, run_dir=tmp_path / "plain")
    one, one_rows = run_job(base + ["parallelism.consolidate_survival=1"], run_dir=tmp_path / "one")
    assert train_losses(plain_rows) == train_losses(one_rows) and plain["final"] == one["final"], (plain_rows, one_rows)
    half, half_rows = run_job(base + ["parallelism.consolidate_survival=0.5"], run_dir=tmp_path / "half")
    s1, a, b = min(phases(half)[0], phases(plain)[0]), train_losses(plain_rows), train_losses(half_rows)
    assert sum(phases(half)) == 40 and phases(half)[1] > phases(plain)[1] and a[:s1] == b[:s1], (phases(half), a, b)
    assert a[phases(half)[0] + 1:] != b[phases(half)[0] + 1:], f"dropping blocks changed nothing after the switch: {a} {b}"
    info = half["strategy_info"]["consolidate"]
    assert info["survival"] == 0.5 and abs(info["blocks_run_fraction"] - 0.5) < 0.25, info
    assert all(x == x for x in b), b  # finite


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("extra", [["parallelism.distill_alpha=0.5"], ["parallelism.consolidate_survival=0.5"]])
def test_resume_after_the_switch_reaches_the_uninterrupted_run(tmp_path: Path, extra: list[str]) -> None:
    """A run stopped at a checkpoint written after the switch (its later checkpoints and summary removed, what a
    killed job leaves) and resumed with ``train.resume=auto`` rebuilds the consolidated model and the teacher (or,
    with survival below 1, each rank's draw generator) and ends exactly where the uninterrupted run ends: the same
    loss at every step and the same evaluation."""
    job = MLP + ["train.steps=8", "parallelism=sdp", "parallelism.coverage=0.5", "parallelism.consolidate=0.5",
                 *extra, "train.checkpoint_every=1", "train.checkpoint_keep=0"]
    full, rows = run_job(job, run_dir=tmp_path / "full")
    s1 = phases(full)[0]
    assert 0 < s1 < 7, full["budget"]["phases"]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed)
    for step in range(s1 + 2, 9):  # keep the checkpoint one step after the switch
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    (resumed / "summary.json").unlink()
    again, again_rows = run_job(job + ["train.resume=auto"], run_dir=resumed)
    assert train_losses(again_rows) == train_losses(rows), (train_losses(again_rows), train_losses(rows))
    assert again["final"] == full["final"], (again["final"], full["final"])


@pytest.mark.parametrize(("f", "alpha", "q"), [(0.3, 0.0, 1.0), (0.3, 0.5, 1.0), (1.0, 0.0, 1.0), (0.5, 0.0, 0.5)])
def test_phase_steps_follow_from_the_models_flops(f: float, alpha: float, q: float) -> None:
    """train.budget=flops: the first phase spends (1 - f) of DDP's FLOPs at the plan's forward-masking fraction,
    the second f at full forward + the blocks' recomputation + the input-gradient backward + the held weight
    gradients (+ the teacher's forward of the worker's own blocks), each counted here from the model's per-module
    FLOPs; the total is DDP's budget up to each phase's rounding. f = 1: no step of the first phase (consolidation
    from the first step, as under train.budget=iterations). Survival q < 1: every block branch term is q of its
    value (the blocks a step runs on average), the stem and head, and the teacher, whole."""
    base = 100
    cfg = compose_config("model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "parallelism=sdp",
                         "cluster.world_size=4", f"train.steps={base}", "train.budget=flops", "train.flops_ratio=measured",
                         f"parallelism.consolidate={f}", f"parallelism.distill_alpha={alpha}",
                         f"parallelism.consolidate_survival={q}")
    steps, info = resolve_steps(cfg)
    with torch.device("meta"):
        model = build(cfg.model)
    counts = forward_flop_counts(model)
    total, prefix = counts["Global"], type(model).__name__
    plan = plan_for(model=model, cfg=cfg.parallelism, world_size=4)
    blocks = {b: counts[f"{prefix}.blocks.{b}"] / total for b in range(len(model.blocks))}
    runs = {b: sum(1 for r in range(4) if r in plan.block_holders(b)) / 4 for b in blocks}  # workers running block b
    forward = 1 - sum(share * (1 - runs[b]) for b, share in blocks.items())
    first = forward  # forward masking: the backward follows the forward
    branches = sum(blocks.values())
    full = 1 - branches + q * branches  # the forward, and the input-gradient backward, of the blocks run
    held = 1 - branches + q * (forward - (1 - branches))  # weight gradients of the held blocks run
    second = (full + q * branches + full + held + (forward if alpha else 0)) / 3
    s1, s2 = round((1 - f) * base / first), round(f * base / second)
    assert [p["steps"] for p in info["phases"]] == [s1, s2] and steps == s1 + s2, (info["phases"], s1, s2)
    assert info["phases"][1]["fraction_computed"] == pytest.approx(second), info["phases"]
    ddp = base * info["global_batch"] * info["flops_per_sample"]
    per_step = info["global_batch"] * info["flops_per_sample"]
    assert abs(info["total_flops"] - ddp) <= (first + second) * per_step / 2 + 1e-6 * ddp, (info["total_flops"], ddp)


def test_distilled_loss_fits_the_teacher_on_the_scored_positions_only() -> None:
    """(1 - alpha) CE + alpha KL(teacher || student): no KL where the student is the teacher; the KL term is the mean
    over the scored targets of each row's KL, an unscored position (IGNORE_INDEX) adding nothing, as in the CE."""
    from torch.nn import functional as F

    from sdp.data.base import IGNORE_INDEX
    from sdp.parallel.sdp_distill import distilled_loss

    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    targets = torch.randint(0, 7, (2, 5), generator=g)
    ce = F.cross_entropy(student.reshape(-1, 7), targets.reshape(-1))
    assert torch.allclose(distilled_loss(ce=ce, student=student, teacher=student, targets=targets, alpha=0.5), 0.5 * ce)
    targets[0, :3] = IGNORE_INDEX
    kept = targets.reshape(-1) != IGNORE_INDEX
    log_s, log_t = (F.log_softmax(x.reshape(-1, 7)[kept], dim=-1) for x in (student, teacher))
    per_row = (log_t.exp() * (log_t - log_s)).sum(-1)
    got = distilled_loss(ce=ce, student=student, teacher=teacher, targets=targets, alpha=1.0)
    assert torch.allclose(got, per_row.mean()), (got, per_row)


@pytest.mark.parametrize("chunk", [3, 4, 1024])
def test_the_chunked_distillation_term_and_its_gradient_equal_autograds(chunk: int) -> None:
    """The KL term computed and differentiated ``chunk`` positions at a time (sdp_distill._ChunkedKL: no
    vocabulary-sized float32 copy of the batch) equals autograd over the whole batch, value and gradient in the
    student's logits, unscored positions included (zero gradient there); the teacher gets no gradient."""
    from torch.nn import functional as F

    from sdp.data.base import IGNORE_INDEX
    from sdp.parallel.sdp_distill import distilled_loss

    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[1, 2:] = IGNORE_INDEX
    a, b = student.clone().requires_grad_(True), student.clone().requires_grad_(True)
    t = teacher.clone().requires_grad_(True)
    ce = torch.zeros(())
    got = distilled_loss(ce=ce, student=a, teacher=t, targets=targets, alpha=0.7, chunk=chunk)
    kept = (targets.reshape(-1) != IGNORE_INDEX).float()
    log_s, log_t = F.log_softmax(b.reshape(-1, 11), dim=-1), F.log_softmax(teacher.reshape(-1, 11), dim=-1)
    want = 0.7 * ((log_t.exp() * (log_t - log_s)).sum(-1) * kept).sum() / kept.sum()
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    got.backward()
    want.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6), (a.grad - b.grad).abs().max()
    assert a.grad[1, 2:].abs().max() == 0 and t.grad is None, (a.grad[1], t.grad)
    half = student.to(torch.bfloat16).requires_grad_(True)
    distilled_loss(ce=ce, student=half, teacher=teacher.to(torch.bfloat16), targets=targets, alpha=1.0,
                   chunk=chunk).backward()
    assert half.grad.dtype == torch.bfloat16, half.grad.dtype
