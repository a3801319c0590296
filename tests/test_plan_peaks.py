"""sdp-plan's predicted peaks (set-up, train, eval; sdp.parallel.plan_peaks) against the CPU live-tensor
tracker of the same config on 2 gloo ranks, per rank: within 10 %, except FSDP's training step, a rule rather than
a rehearsal (FSDP2's all-gather and reduce-scatter buffers are not rehearsed): an upper bound, at most 20 % above
(BOUNDS; it counts the largest block four times, the tracker finds about three), and the LM study's shape, within
1 % (the sampler's permutation is host-side work, as on a GPU: sdp.rank.device_batches). SDP's evaluation is
rehearsed part by part as it runs (sdp.rank.evaluation.partwise_totals); under re-draws every peak is the largest
over the draws the run makes (and the re-draw peak is checked too); the evaluation batch is a rank's share of the
real validation set (digits: no ``dataset.num_val``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import compose as compose_cfg, run_job

SMALL = ["model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=8", "train.batch_size=4",
         "train.steps=4", "train.warmup_steps=2", "train.eval_every=0", "train.eval_batch_size=8"]
LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "optim=adamw", "train.batch_size=4",
         "train.steps=4", "train.warmup_steps=2", "train.eval_every=0", "train.eval_batch_size=4", "model.n_kv_heads=null"]
CASES = {
    "ddp": ["parallelism=ddp", *SMALL],
    "sdp": ["parallelism=sdp", *SMALL],
    "sdp_block_bwd": ["parallelism=sdp_block_bwd", *SMALL],
    "fsdp": ["parallelism=fsdp", *SMALL],
    "sdp_llama": ["parallelism=sdp", *LLAMA],
    "ddp_llama": ["parallelism=ddp", *LLAMA],
    # train.precision=bf16: the rehearsal runs under the planner's emulation of CPU autocast (sdp.parallel.device_forward)
    "ddp_llama_bf16": ["parallelism=ddp", *LLAMA, "train.precision=bf16"],
    "fsdp_llama_bf16": ["parallelism=fsdp", *LLAMA, "train.precision=bf16"],
    # train.ac=op: each block keeps its matmul and attention outputs, in the checkpoint's cache (sdp/parallel/ac_op.py)
    "ddp_llama_ac_op": ["parallelism=ddp", *LLAMA, "train.ac=op"],
    # the default digits (359 validation images, 180 on a rank, below the default evaluation batch of 256)
    "ddp_digits": ["parallelism=ddp", "train.steps=4", "train.warmup_steps=2", "train.eval_every=0"],
    # local SGD / DiLoCo: the outer state at every phase, the sync's flat buffer (a sync after step 4, measured), and
    # (llama) an evaluation between two syncs (after step 2 of H = 3) holding a copy of the replica
    "diloco": ["parallelism=diloco", *SMALL, "parallelism.inner_steps=2"],
    "diloco_llama": ["parallelism=diloco", *LLAMA, "parallelism.inner_steps=3", "train.eval_every=2"],
    # cyclic roles differ by rank; relabel re-draws move them between the ranks, evaluated in every draw
    "sdp_redraw": ["parallelism=sdp", *SMALL, "parallelism.assignment=cyclic", "parallelism.resample_every=2",
                   "train.steps=8", "train.eval_every=2"],
    # consolidation (issue 39): the measured steps of both phases (5 + 3 of 8 steps), the teacher with distillation
    "sdp_consolidate_llama": ["parallelism=sdp", *LLAMA, "train.steps=8", "parallelism.consolidate=0.5"],
    "sdp_consolidate_kd_llama": ["parallelism=sdp", *LLAMA, "train.steps=8", "parallelism.consolidate=0.5",
                                 "parallelism.distill_alpha=0.5"],
    # and with world-averaged gradients: every parameter's gradient, each non-held one freed once its block is reduced
    "sdp_consolidate_world_llama": ["parallelism=sdp", *LLAMA, "train.steps=8", "parallelism.consolidate=0.5",
                                    "parallelism.consolidate_average=world"],
    # assembly calibration (issue 39): the frozen assembled model (the blocks a rank lacks received), gates, checkpoints
    "sdp_calibrate_llama": ["parallelism=sdp", *LLAMA, "parallelism.calibrate_steps=2"],
    "sdp_calibrate": ["parallelism=sdp", *SMALL, "parallelism.calibrate_steps=2"],
    # the LM study's data (200 000 sequences: the sampler's 1.6 MB epoch permutation, host-side work a GPU run does
    # not count, against a 10 MB training peak under AC) and model; held to 1 %: the rehearsal is exact here
    "ddp_ac_automaton": ["parallelism=ddp", "train.ac=full", "model=llama_tiny", "model.n_layers=8", "dataset=automaton",
                         "dataset.num_val=32", "optim=adamw", "train.batch_size=8", "train.steps=4",
                         "train.warmup_steps=2", "train.eval_every=0", "train.eval_batch_size=16"],
    # and FSDP+AC there: each block's gathered parameters freed by resize_(0) (sdp.metrics.live follows it)
    "fsdp_ac_automaton": ["parallelism=fsdp", "train.ac=full", "model=llama_tiny", "model.n_layers=8",
                          "dataset=automaton", "dataset.num_val=32", "optim=adamw", "train.batch_size=8", "train.steps=4",
                          "train.warmup_steps=2", "train.eval_every=0", "train.eval_batch_size=16"],
}
PEAKS = ("setup_peak_bytes", "train_peak_bytes", "eval_peak_bytes")
BOUNDS = {("fsdp", "train_peak_bytes"): (0.0, 0.20), ("fsdp_llama_bf16", "train_peak_bytes"): (0.0, 0.20),
          ("fsdp_ac_automaton", "train_peak_bytes"): (0.0, 0.05),
          **{("ddp_ac_automaton", key): (-0.01, 0.01) for key in PEAKS}}  # (predicted - measured) / measured; else ±10 %


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_predicted_peaks_match_the_cpu_tracker(name: str, tmp_path: Path) -> None:
    from sdp.planning.planner import predict

    summary, _ = run_job(CASES[name], world=2, run_dir=tmp_path)
    plan = predict(compose_cfg([*CASES[name], "cluster.world_size=2"]))
    errors, checked = [], 0
    keys = PEAKS + tuple(f"{phase}_peak_bytes" for phase in ("redraw", "consolidate", "calibrate") if phase in name)
    for pm, mm in zip(plan["memory"]["per_rank"], summary["memory"]["per_rank"]):
        assert mm["peak_source"] == "live_tensors", mm
        for key in keys:
            p, m = pm[key], mm[key]
            checked += 1
            low, high = BOUNDS.get((name, key), (-0.10, 0.10))
            if not low * m <= p - m <= high * m:
                errors.append(f"rank {mm['rank']} {key}: predicted {p / 2**20:.2f} MiB, measured {m / 2**20:.2f} MiB "
                              f"({(p - m) / m:+.1%})")
    assert checked == 2 * len(keys) and not errors, f"{name}: " + "; ".join(errors)


REDRAW = ["parallelism=sdp", "model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=8",
          "train.batch_size=4", "train.eval_batch_size=8", "cluster.world_size=4", "parallelism.resample_every=1"]


def test_peaks_under_redraws_are_the_largest_over_the_run_s_draws() -> None:
    """Issue 35 item 6: a relabel re-draw hands a rank another role, so sdp-plan's training and evaluation peak
    of a rank is the largest of its predictions for each draw the run makes (evaluated after every step here),
    not draw 0's; set-up stays draw 0's; the re-draw peak is at least each re-draw's between consecutive draws."""
    from dataclasses import replace

    from sdp.driver.config import validate
    from sdp.parallel.sdp_peaks import sdp_peaks
    from sdp.parallel.sdp_plan import run_plans
    from sdp.parallel.sdp_redraw_plan import redraw_peaks

    steps = 6
    cfg = compose_cfg([*REDRAW, f"train.steps={steps}"])
    built = validate(cfg)
    pc, job, model, first = cfg.parallelism, built.job, built.model, built.prepared
    whole = sdp_peaks(cfg=pc, job=job, model=model, plan=first, eval_batch=8, steps=steps,
                      eval_steps=frozenset(range(1, steps + 1)))
    plans = list(run_plans(model=model, cfg=pc, first=first, draws=range(steps)))
    each = [sdp_peaks(cfg=pc, job=job, model=model, plan=replace(p, draw=0), eval_batch=8, steps=1,
                      eval_steps=frozenset({1})) for p in plans]  # each draw's own prediction, as a one-step run
    grew = []
    for r, entry in enumerate(whole):
        assert entry["setup_peak_bytes"] == each[0][r]["setup_peak_bytes"], (r, entry, each[0][r])
        for key in ("train_peak_bytes", "eval_peak_bytes"):
            per_draw = [e[r][key] for e in each]
            assert entry[key] == max(per_draw), f"rank {r} {key}: {entry[key]}, per draw {per_draw}"
            grew += [(r, key, per_draw[0], entry[key])] if entry[key] > per_draw[0] else []
    assert grew, f"no rank takes a heavier role in a later draw: the case does not test the re-draws ({each})"
    for old, new in zip(plans, plans[1:]):
        one = redraw_peaks(cfg=pc, optimizer=job.optimizer, model=model, plans=[old, new])
        assert all(e["redraw_peak_bytes"] >= p for e, p in zip(whole, one)), \
            (new.draw, [e["redraw_peak_bytes"] for e in whole], one)


def test_a_long_run_is_predicted_over_one_rotation() -> None:
    """Many re-draws cost one rotation, not one rehearsal set per draw: 10,000 re-draws of a relabelled plan
    give every rank the largest of draw 0's roles (each rank holds each of them within the rotation)."""
    from sdp.driver.config import validate
    from sdp.parallel.sdp_peaks import sdp_peaks

    steps = 10_001
    cfg = compose_cfg([*REDRAW, f"train.steps={steps}"])
    built = validate(cfg)
    pc, job, model, first = cfg.parallelism, built.job, built.model, built.prepared
    whole = sdp_peaks(cfg=pc, job=job, model=model, plan=first, eval_batch=8, steps=steps, eval_steps=frozenset({steps}))
    draw0 = sdp_peaks(cfg=pc, job=job, model=model, plan=first, eval_batch=8, steps=1, eval_steps=frozenset({1}))
    top = max(e["train_peak_bytes"] for e in draw0)
    assert len({e["train_peak_bytes"] for e in draw0}) > 1, f"draw 0's roles are alike: nothing to rotate ({draw0})"
    assert [e["train_peak_bytes"] for e in whole] == [top] * len(whole), (whole, draw0)


def test_the_evaluation_batch_is_a_rank_s_share_of_the_real_validation_set() -> None:
    """Issue 35 item 8: the evaluation batch sdp-plan rehearses is ``min(train.eval_batch_size, ceil(N / world))``
    with N the validation set the dataset builds (digits sets no ``dataset.num_val``: 20 % of 1797 = 359)."""
    from sdp.driver.config import validate
    from sdp.planning.planner import eval_batch

    built = validate(compose_cfg(["parallelism=ddp", "cluster.world_size=2"]))
    assert built.val_samples == 359, built.val_samples
    assert eval_batch(eval_batch_size=256, val_samples=built.val_samples, world=2) == 180
    assert eval_batch(eval_batch_size=64, val_samples=built.val_samples, world=2) == 64
    synthetic = validate(compose_cfg(["parallelism=ddp", "dataset=synthetic", "dataset.image_size=8", "dataset.num_val=40",
                                      "cluster.world_size=4"]))
    assert synthetic.val_samples == 40 and eval_batch(eval_batch_size=256, val_samples=40, world=4) == 10
    assert eval_batch(eval_batch_size=256, val_samples=41, world=4) == 11, "rank 0 holds the largest share"


def test_the_evaluation_after_calibration_counts_the_workers_own_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``parallelism.calibrate_steps`` the last evaluation follows the calibration, which dropped the gradients;
    forward-masked SDP's evaluation then also runs each worker's own subnetwork (eval.subnetworks, eval.ensemble), so
    that pass, less the gradients, bounds the predicted evaluation peak from below. Isolated here by a part-by-part
    evaluation that costs nothing (at the CPU cases' shapes the assembled model's parts outweigh the own pass, so
    test_predicted_peaks_match_the_cpu_tracker cannot tell)."""
    import sdp.parallel.sdp_peaks as sp
    from sdp.driver.config import validate

    steps = 4
    cfg = compose_cfg(["parallelism=sdp", *LLAMA, "parallelism.calibrate_steps=2", "eval.subnetworks=true",
                       "cluster.world_size=2"])
    built = validate(cfg)
    seen: dict[int, dict[str, int]] = {}
    real = sp._rank_peaks

    def spy(**kw: object):  # noqa: ANN202 - records what each rank's rehearsal gave
        for r, got in real(**kw):
            seen[r] = got
            yield r, got

    monkeypatch.setattr(sp, "_eval_extra", lambda **_: 0)
    monkeypatch.setattr(sp, "_rank_peaks", spy)
    out = sp.sdp_peaks(cfg=cfg.parallelism, job=built.job, model=built.model, plan=built.prepared, eval_batch=4,
                       steps=steps, eval_steps=frozenset({steps}))
    for r, entry in enumerate(out):
        own = seen[r]["own_eval"] - seen[r]["grads"]
        assert own > seen[r]["state"] - seen[r]["grads"], (r, seen[r])  # the pass allocates: the case can tell
        assert entry["eval_peak_bytes"] == own, (r, entry["eval_peak_bytes"], own, seen[r])
