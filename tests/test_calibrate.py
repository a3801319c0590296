"""SDP's assembly calibration (``parallelism.calibrate_steps``, sdp/parallel/sdp_calibrate.py, sdp/models/gates.py):
gates at their initial factor change nothing, a folded gate computes what the gated model computed, fitting the
gates on 2 ranks lowers the assembled model's loss on its calibration batches, a run with learning rate 0 evaluates
what a run without calibration evaluates, the FLOP budget charges it from the model's FLOP count, a resumed run
re-runs it to the same gates, and bad settings are refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sdp.core.loss import loss_fn
from sdp.models import gates as G
from sdp.models.base import SDPModel
from sdp.models.llama import LLaMA
from sdp.models.mlp import MLP
from sdp.models.resnet import ResNetCIFAR
from sdp.parallel.sdp_final import eval_scale
from tests.helpers import CORE, batch, compose, config_dict, make_strategy, run_job, spawn

LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "optim=adamw", "train.batch_size=2",
         "train.eval_batch_size=3", "parallelism=sdp", "eval.ensemble=false"]


def _models() -> dict[str, tuple[SDPModel, torch.Tensor]]:
    torch.manual_seed(0)
    llama = LLaMA(vocab_size=32, dim=16, n_layers=3, n_heads=2, hidden=24, max_seq_len=8)
    resnet = ResNetCIFAR(num_classes=5, width=4, image_size=8, blocks_per_stage=(1, 1), block="bottleneck")
    mlp = MLP(input_shape=(12,), dim=8, hidden=16, depth=2, num_classes=3)
    return {"llama": (llama, torch.randint(0, 32, (2, 8))), "resnet": (resnet.eval(), torch.randn(2, 3, 8, 8)),
            "mlp": (mlp, torch.randn(2, 12))}


@pytest.mark.parametrize("name", ["llama", "resnet", "mlp"])
def test_gates_at_the_factor_leave_the_outputs_unchanged(name: str) -> None:
    """Gates attached at the branch factor the forward used (k/n here) give exactly its outputs, and taking them
    off gives them back: the gate replaces the factor and nothing else."""
    model, x = _models()[name]
    blocks = [b for b, _ in model.sdp_units()]
    for b in blocks:
        model.blocks[b].branch_scale = 0.5
    with torch.no_grad():
        before = model(x)
        G.attach(model, blocks=blocks, init=0.5, device=x.device)
        gated = model(x)
        G.remove(model, blocks=blocks)
        after = model(x)
    assert torch.equal(gated, before), (gated - before).abs().max()
    assert torch.equal(after, before), (after - before).abs().max()


@pytest.mark.parametrize("name", ["llama", "resnet", "mlp"])
def test_a_folded_gate_computes_what_the_gated_model_computed(name: str) -> None:
    """Non-unit gates, different per branch, folded into each branch's last layer (or closing norm): the plain model
    gives the gated model's outputs to float tolerance, with no gate left and branch_scale 1."""
    model, x = _models()[name]
    blocks = [b for b, _ in model.sdp_units()]
    for b in blocks:
        model.blocks[b].branch_scale = 0.5
    vector, where = G.attach(model, blocks=blocks, init=0.5, device=x.device)
    with torch.no_grad():
        vector.copy_(torch.linspace(0.3, 1.7, len(where)))
        gated = model(x)
        plain = model(x)
    G.remove(model, blocks=blocks)
    with torch.no_grad():
        unfolded = model(x)
        for b, values in G.values(vector, where).items():
            G.fold(model.blocks[b], values)
        folded = model(x)
    assert torch.equal(gated, plain)
    assert not torch.allclose(unfolded, gated, atol=1e-4), "the gates changed nothing: the test could not fail"
    assert all(model.blocks[b].gates is None and model.blocks[b].branch_scale == 1.0 for b in blocks)
    assert torch.allclose(folded, gated, rtol=1e-5, atol=1e-6), (folded - gated).abs().max()


def _fit_lowers(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    from sdp.parallel import sdp_calibrate as C
    from sdp.subnet.assemble import split_blocks

    strategy, data, cfg = make_strategy(config, rank, world)
    for step in range(4):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
    batches = [batch(data, cfg, step=s, rank=rank, world_size=world) for s in range(4, 7)]
    blocks = sorted(split_blocks(strategy.plan))
    init = eval_scale(plan=strategy.plan, rescale=strategy.rescale)
    kept = {k: v.clone() for k, v in strategy.module.state_dict().items()}
    common = dict(blocks=blocks, batches=batches, loss_fn=loss_fn, autocast=strategy.autocast, ctx=strategy.ctx)
    with C.assembled(module=strategy.module, skeleton=strategy.skeleton, pieces=strategy.pieces, layout=strategy.layout,
                     plan=strategy.plan, groups=strategy.groups, ctx=strategy.ctx) as full:
        _, before = C.fit(model=full, init=init, lr=0.0, **common)
        gates, fitted = C.fit(model=full, init=init, lr=0.05, **{**common, "batches": batches * 10})
        for b in blocks:
            G.fold(full.blocks[b], gates[b])
        _, after = C.fit(model=full, init=1.0, lr=0.0, **common)
    # the held blocks were the training module's own: put back what the fold changed, then compare
    strategy.module.load_state_dict(kept)
    return {"before": before, "after": after, "gates": gates, "fitted": fitted, "init": init}


@pytest.mark.dist
@CORE
def test_fitting_the_gates_on_two_ranks_lowers_the_loss_on_the_calibration_batches() -> None:
    """2 ranks, block-level SDP at C = 0.5 (each rank holds half the blocks) after 4 steps: the assembled model's
    world-mean loss on the calibration batches, with the factor before and the folded gates after fitting on those
    batches, goes down; both ranks fit the same gates (their gradients averaged over the world)."""
    config = config_dict([*LLAMA, "model.n_layers=4"])
    out = spawn(_fit_lowers, world=2, args=(config,))
    assert out[0]["gates"] == out[1]["gates"], (out[0]["gates"], out[1]["gates"])
    assert out[0]["before"] == out[1]["before"] and out[0]["after"] == out[1]["after"], out
    before, after = sum(out[0]["before"]) / 3, sum(out[0]["after"]) / 3
    moved = max(abs(g - out[0]["init"]) for v in out[0]["gates"].values() for g in v.values())
    assert moved > 1e-3, f"the gates stayed at {out[0]['init']}: {out[0]['gates']}"
    assert after < before, f"calibration raised the loss on its batches: {before:.5f} -> {after:.5f} ({out[0]['gates']})"


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


JOB = [*LLAMA, "train.steps=6", "train.budget=iterations", "train.eval_every=0"]


@pytest.mark.dist
@CORE
def test_a_run_with_learning_rate_0_evaluates_what_a_run_without_calibration_evaluates(tmp_path: Path) -> None:
    """2 ranks, same seed and steps: calibration with lr 0 (gates at k/n, folded) evaluates the model the run without
    calibration evaluates (k/n as a factor), to float tolerance; the workers' own subnetworks are untouched (equal
    bit for bit); the summary says what ran (steps, gates, losses, its memory peak, its traffic in phase
    "calibrate") and the metrics log one row per calibration step."""
    plain, _ = run_job(JOB, run_dir=tmp_path / "plain", world=2)
    cal, rows = run_job([*JOB, "parallelism.calibrate_steps=3", "parallelism.calibrate_lr=0"], run_dir=tmp_path / "cal", world=2)
    info = cal["strategy_info"]["calibrate"]
    k_over_n = cal["strategy_info"]["plan"]["k"] / 2
    assert info["steps"] == 3 and len(info["losses"]) == 3 and info["init"] == k_over_n, info
    assert all(g == info["init"] for v in info["gates"].values() for g in v.values()), info["gates"]
    assert sorted(info["gates"]) == ["0", "1", "2", "3"] and all(sorted(v) == ["attention", "feed_forward"]
                                                                  for v in info["gates"].values()), info["gates"]
    assert "calibrate" not in plain["strategy_info"], plain["strategy_info"]
    a, b = plain["final"], cal["final"]
    assert a["eval_loss_workers"] == b["eval_loss_workers"], (a, b)
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6), (a["eval_loss"], b["eval_loss"])
    assert [r["calibrate_step"] for r in rows if "calibrate_loss" in r] == [1, 2, 3], rows
    for m, c in zip(cal["memory"]["per_rank"], cal["comm"]["per_rank"]):
        assert m["calibrate_peak_bytes"] and m["calibrate_peak_bytes"] > 0, m
        assert c["outside_training"]["calibrate"]["collectives"] >= 3, c["outside_training"]
    assert cal["budget"]["post_training"]["steps"] == 3, cal["budget"]


def test_the_flops_budget_charges_calibration_from_the_models_flop_count() -> None:
    """Under train.budget=flops the training steps shrink by calibration's FLOPs (3 forwards of the full model per
    sample: forward, recomputation, backward to the activations) over one SDP step's, counted from the model: the
    run's training and calibration together spend at most DDP's budget and within one step of it."""
    from sdp.driver.budget import resolve_steps
    from sdp.parallel.sdp_calibrate import step_fraction
    from sdp.registry import build

    base = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "parallelism=sdp", "train.steps=50",
            "train.budget=flops", "train.flops_ratio=measured", "cluster.world_size=4"]
    off_steps, off = resolve_steps(compose(base))
    cfg = compose([*base, "parallelism.calibrate_steps=20"])
    steps, info = resolve_steps(cfg)
    with torch.device("meta"):
        per_sample = build(cfg.model).flops_per_sample()
    r, batch_ = off["fraction_computed"], off["global_batch"]
    budget = 50 * batch_ * per_sample
    calibration = 20 * batch_ * per_sample * step_fraction()
    assert info["post_training"] == {"phase": "calibrate", "steps": 20, "step_fraction": step_fraction(), "flops": calibration}
    assert steps == round((budget - calibration) / (batch_ * per_sample * r)) < off_steps, (steps, off_steps)
    spent = steps * batch_ * per_sample * r + calibration
    assert info["total_flops"] == pytest.approx(spent) and abs(spent - budget) <= batch_ * per_sample * r, (spent, budget)


@pytest.mark.parametrize("overrides, message", [
    (["parallelism.calibrate_steps=-1"], ["parallelism.calibrate_steps=-1", "integer >= 0"]),
    (["parallelism.calibrate_lr=-0.1"], ["parallelism.calibrate_lr=-0.1", ">= 0"]),
    (["parallelism=sdp_neuron_fwd", "parallelism.calibrate_steps=5"], ["parallelism.level='neuron'", "block with"]),
    (["parallelism=sdp_block_bwd", "parallelism.calibrate_steps=5"], ["parallelism.masking='backward'", "forward with"]),
    (["parallelism.calibrate_steps=5", "model.tie_embeddings=true"], ["parallelism.calibrate_steps=5", "tied weights"]),
], ids=["negative-steps", "negative-lr", "neuron-level", "backward-masking", "tied-embeddings"])
def test_bad_calibration_settings_are_refused_in_one_line(overrides: list[str], message: list[str]) -> None:
    """Each refused before any rank starts, in one line naming the key, the value and what is allowed."""
    from sdp.driver.config import validate
    from sdp.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose([*LLAMA, *overrides]), launching=False)
    text = str(err.value)
    assert "\n" not in text.strip() and all(m in text for m in message), text


@pytest.mark.dist
def test_a_resumed_run_ends_with_the_same_gates_and_evaluation(tmp_path: Path) -> None:
    """Calibration is checkpointed with the last step (it runs before that checkpoint). A run killed during
    calibration (its last checkpoint is step 3) resumes, trains steps 4-6 and re-runs calibration on the same
    batches: the same gates, losses and final evaluation, bit for bit. A run killed after it resumes from step 6
    with the checkpoint's gates and runs nothing again."""
    import json
    import shutil

    from sdp.results.rundir import rank_file

    job = [*JOB, "train.checkpoint_every=3", "train.checkpoint_keep=0", "parallelism.calibrate_steps=4",
           "parallelism.calibrate_lr=0.05"]
    full, rows = run_job(job, run_dir=tmp_path / "full", world=2)
    assert any(g != full["strategy_info"]["calibrate"]["init"] for v in full["strategy_info"]["calibrate"]["gates"].values()
               for g in v.values()), full["strategy_info"]["calibrate"]
    for name, drop in (("during", (6,)), ("after", ())):
        again = tmp_path / name
        shutil.copytree(tmp_path / "full", again)
        for step in drop:
            shutil.rmtree(again / "checkpoints" / f"step_{step:08d}")
        (again / "summary.json").unlink()
        resumed, rows_again = run_job([*job, "train.resume=auto"], run_dir=again, world=2)
        assert resumed["final"]["eval_loss"] == full["final"]["eval_loss"], (name, resumed["final"], full["final"])
        cal_rows = [r for r in rows_again if "calibrate_loss" in r]
        assert cal_rows == [r for r in rows if "calibrate_loss" in r], (name, json.dumps(cal_rows))
        if name == "during":  # trained steps 4-6 and calibrated again
            assert resumed["strategy_info"]["calibrate"] == full["strategy_info"]["calibrate"], resumed["strategy_info"]
        else:  # nothing left to run: the summary is rebuilt from the final checkpoint, which holds the gates
            assert resumed["rebuilt"], resumed
            assert resumed["strategy_info"] == full["strategy_info"], (resumed["strategy_info"], full["strategy_info"])
            for rank in range(2):
                state = torch.load(again / "checkpoints" / "step_00000006" / rank_file(rank), weights_only=True)
                assert state["local"]["extra"]["calibrate"] == full["strategy_info"]["calibrate"], state["local"]["extra"]
