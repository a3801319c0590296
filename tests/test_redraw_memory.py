"""Plan re-draws that cost no more memory than training (issue 28, item 1): a re-draw moves only the
pieces that change hands, one tensor at a time (``sdp.subnet.redraw``), so that

- every new holder of a parameter piece has exactly the value its old holders had, and every new
  trainer exactly the optimizer state its old trainers had (bit for bit, AdamW moments and step), which
  is what the full-model assembly gave; the reference is the ranks' own state just before the re-draw;
- its peak on every rank, measured by the CPU live-tensor tracker around the re-draw alone, is at most
  the peak of the training step before it. The re-draw that assembled the full model on every rank
  exceeded it (the full model next to the rank's state, gradients and both optimizer states);
- ``summary.json`` records each re-draw's peak per rank and the bytes every rank sent and received,
  and ``sdp-plan`` predicts them (bytes exactly, peak within 10 %) from the two plans.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import batch, compose, config_dict, core_cases, make_strategy, run_job, spawn
from tests.holders import pieces_of

LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=32", "model.n_kv_heads=null", "optim=adamw",
         "train.batch_size=4"]
STEPS, EVERY = 5, 2  # re-draws before steps 2 and 4
CASES = [("block-fwd", ["parallelism=sdp", "parallelism.coverage=0.5"]),  # B-SDP C = 0.5
         ("neuron-fwd", ["parallelism=sdp_neuron_fwd", "parallelism.coverage=0.5"])]  # N-SDP


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _train(rank: int, world: int, config: dict) -> dict[str, Any]:
    """STEPS steps with re-draws; the live tracker's peak of every step and of every re-draw alone (each
    re-draw is wrapped: peak reset before it, read and reset after it), and the ranks' checkpoint content
    just before and just after every re-draw (copied with the tracker paused, so nothing of it counts)."""
    from sdp.metrics.live import LiveTensorTracker
    from sdp.core.loss import loss_fn
    from sdp.rank.worker import dataset_tensors

    tracker = LiveTensorTracker()
    tracker.__enter__()
    strategy, data, cfg = make_strategy(config, rank, world)
    tracker.label(dataset_tensors(data), "ignored")  # the in-memory dataset is not the strategy's memory
    out: dict[str, Any] = {"steps": [], "redraws": [], "snapshots": []}

    def snapshot() -> dict:
        tracker.__exit__(None, None, None)
        local = copy.deepcopy(strategy.checkpoint_state()["local"])
        tracker.__enter__()
        return local

    real = strategy._redraw

    def measured(*, draw: int) -> None:
        before = snapshot()
        tracker.reset_peak()
        real(draw=draw)
        out["redraws"].append(tracker.peak)
        out["snapshots"].append((before, snapshot()))
        tracker.reset_peak()  # the step's own peak starts after the re-draw

    strategy._redraw = measured
    for step in range(STEPS):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        tracker.reset_peak()
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
        out["steps"].append(tracker.peak)
    tracker.__exit__(None, None, None)
    return out


def _expected(ranks: list[dict[tuple, dict[str, Any]]], *, trained: bool) -> dict[tuple, Any]:
    """Piece -> the one value (``trained``: optimizer state) all ranks that have it agree on."""
    out: dict[tuple, Any] = {}
    for r, pieces in enumerate(ranks):
        for key, entry in pieces.items():
            value = entry["state"] if trained else entry["param"]
            if value is None:
                continue
            if key in out:
                assert _same(out[key], value), f"{'state' if trained else 'value'} of {key} differs between old holders (rank {r})"
            out[key] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _check_moved(config: dict, got: list[dict[str, Any]]) -> int:
    """Every piece on every new holder (trainer) equals its value (state) on the old holders (trainers)."""
    cfg = OmegaConf.create(config)
    checked = 0
    for d in range(len(got[0]["snapshots"])):
        before = [pieces_of(g["snapshots"][d][0], cfg=cfg, rank=r) for r, g in enumerate(got)]
        after = [pieces_of(g["snapshots"][d][1], cfg=cfg, rank=r) for r, g in enumerate(got)]
        old_holders = {k: {r for r, p in enumerate(before) if k in p} for k in set().union(*before)}
        assert any(old_holders[k] != {r for r, p in enumerate(after) if k in p} for k in old_holders), \
            f"re-draw {d} changed no holder: nothing tested"
        for trained in (False, True):
            want = _expected(before, trained=trained)
            for r, pieces in enumerate(after):
                for key, entry in pieces.items():
                    value = entry["state"] if trained else entry["param"]
                    if value is None or (trained and not value and not want.get(key)):
                        continue
                    assert key in want, f"re-draw {d}, rank {r}: piece {key} had no {'state' if trained else 'value'} before"
                    assert _same(value, want[key]), \
                        f"re-draw {d}, rank {r}: {'optimizer state' if trained else 'value'} of {key} is not the old holders'"
                    checked += 1
    return checked


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("case", "sel"), core_cases(CASES, ids=[c[0] for c in CASES], core=set()))  # slow tier (CI time; tests/test_traffic_plan.py runs re-draws in the default tier)
def test_redraw_moves_pieces_exactly_within_the_training_peak(case: str, sel: list[str]) -> None:
    world = 4
    config = config_dict(LLAMA + sel + [f"parallelism.resample_every={EVERY}", f"cluster.world_size={world}"])
    got = spawn(_train, world=world, args=(config,), timeout_s=480)
    assert [len(g["redraws"]) for g in got] == [STEPS // EVERY] * world, [len(g["redraws"]) for g in got]
    assert _check_moved(config, got) > 0
    mib = 2**20
    report = [f"rank {r}: re-draws {[f'{p / mib:.3f}' for p in g['redraws']]} MiB, steps {[f'{p / mib:.3f}' for p in g['steps']]} MiB"
              for r, g in enumerate(got)]
    for r, g in enumerate(got):
        for d, peak in enumerate(g["redraws"]):
            step_before = g["steps"][EVERY * (d + 1) - 1]
            assert peak <= step_before, f"{case}: rank {r} re-draw {d} peak {peak / mib:.3f} MiB > the step before it " \
                                        f"{step_before / mib:.3f} MiB\n" + "\n".join(report)
    print(f"\n{case} (live tensor peaks):\n" + "\n".join(report))


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_summary_records_redraws_as_sdp_plan_predicts(tmp_path: Path) -> None:
    """One job with one re-draw (draw 0 -> 1): per rank its measured peak (memory phase ``redraw``) is
    within the training peak and within 10 % of sdp-plan's rehearsal, and the bytes every rank sent and
    received are sdp-plan's exactly."""
    from sdp.planning.planner import predict

    sel = LLAMA + CASES[0][1] + [f"parallelism.resample_every={EVERY}", f"train.steps={EVERY + 1}", "train.warmup_steps=1",
                                 "train.eval_every=0", "train.eval_batch_size=4"]
    summary, _ = run_job(sel, world=4, run_dir=tmp_path)
    plan = predict(compose([*sel, "cluster.world_size=4"]))
    info = summary["strategy_info"]["redraw"]
    assert info["count"] == 1 and [d["draw"] for d in info["draws"]] == [1], info
    for r, (mm, pm, pr) in enumerate(zip(summary["memory"]["per_rank"], plan["memory"]["per_rank"], plan["redraw"]["per_rank"])):
        assert len(mm["redraw_peaks_bytes"]) == 1 and mm["redraw_peak_bytes"] == mm["redraw_peaks_bytes"][0], mm
        assert mm["redraw_peak_bytes"] <= mm["train_peak_bytes"], (r, mm)
        p, m = pm["redraw_peak_bytes"], mm["redraw_peak_bytes"]
        assert abs(p - m) <= 0.10 * m, f"rank {r}: predicted re-draw peak {p / 2**20:.3f} MiB, measured {m / 2**20:.3f} MiB"
        assert (info["bytes_moved"]["sent"][r], info["bytes_moved"]["received"][r]) == (pr["sent_bytes"], pr["received_bytes"]), \
            (r, info["bytes_moved"], pr)
    assert sum(info["bytes_moved"]["received"]) > 0, info


def test_rehearsal_moves_the_bytes_the_plans_give() -> None:
    """sdp-plan: the meta-device rehearsal of the first re-draw moves, on every rank, exactly the bytes
    :func:`sdp.subnet.redraw.traffic` derives from the two plans (values, AdamW's two moments)."""
    from sdp.parallel.sdp_plan import plan_for, predict_redraw
    from sdp.parallel.sdp_redraw_plan import rehearse_redraw, state_template
    from sdp.registry import build

    for sel in (CASES[0][1], CASES[1][1]):
        cfg = compose(LLAMA + sel + ["parallelism.resample_every=2", "cluster.world_size=4"])
        with torch.device("meta"):
            model = build(cfg.model)
        predicted = predict_redraw(cfg=cfg.parallelism, optimizer=cfg.optim.optimizer, model=model, world=4)
        assert predicted is not None and sum(t["received_bytes"] for t in predicted["per_rank"]) > 0, predicted
        factory = build(cfg.optim.optimizer)
        template = state_template(optimizer_factory=factory, dtype=torch.float32)
        assert sorted(k for k, d in template.items() if d[0] == "tensor") == ["exp_avg", "exp_avg_sq"], template
        plans = [plan_for(model=model, cfg=cfg.parallelism, world_size=4, draw=d) for d in (0, 1)]
        for t in predicted["per_rank"]:
            got = rehearse_redraw(skeleton=model, old_plan=plans[0], new_plan=plans[1], rank=t["rank"], mode="forward",
                                  optimizer_factory=factory, template=template)
            assert (got["sent_bytes"], got["received_bytes"]) == (t["sent_bytes"], t["received_bytes"]), (sel, got, t)
            assert got["peak_bytes"] > 0


def test_a_measured_phase_is_kept_out_of_the_step_peak() -> None:
    """The re-draw's memory phase: its peak is recorded on its own and the enclosing train phase's peak
    does not include it (summary ``redraw_peak_bytes``, ``redraw_peaks_bytes``)."""
    from sdp.metrics.memory import PeakTracker, measured_phase

    peak = PeakTracker(device=torch.device("cpu"))
    peak.start()
    try:
        peak.set_phase("train")
        a = torch.empty(1000, dtype=torch.uint8)
        with measured_phase("redraw") as m:
            b = torch.empty(5000, dtype=torch.uint8)
            del b
        c = torch.empty(2000, dtype=torch.uint8)
        del a, c
        out = peak.summary()
    finally:
        peak.stop()
    assert m["peak_bytes"] is not None and m["peak_bytes"] >= 6000, m
    assert out["redraw_peaks_bytes"] == [m["peak_bytes"]] and out["redraw_peak_bytes"] == m["peak_bytes"], out
    assert 3000 <= out["train_peak_bytes"] < 6000, out
    with measured_phase("redraw") as none:  # no tracker started: nothing measured
        pass
    assert none["peak_bytes"] is None
