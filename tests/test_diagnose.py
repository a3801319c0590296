"""``sdp-bench diagnose`` (issue 39, item 1): the final weights a run keeps (``train.save_final``), the figures the
diagnosis computes from them on the run's validation set, and the rule that names the explanation.

The multi-rank cases train two tiny block-level forward-masked SDP runs on 2 gloo ranks: at C = 1 nothing is
assembled (every block input is its holders', the residual-stream average is the assembled model); at C = 0.5 the
diagnosis must reproduce the run's own evaluation (``summary.json``) from the saved weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import run_job

LLAMA = ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "model.n_layers=4", "optim=adamw",
         "train.batch_size=4", "train.steps=6", "train.warmup_steps=0", "train.eval_every=0", "train.eval_batch_size=8",
         "parallelism=sdp", "eval.subnetworks=true", "eval.ensemble=true", "memory.tracker=false"]


def diag_of(*, assembled: float, ensemble: float, residual: float, drift: list[float], sweep: dict[float, float],
            workers: float | None = None) -> dict[str, Any]:
    """A diagnosis' figures as :func:`sdp.bench.diagnose.measure` records them, built from the given numbers."""
    mults = sorted(sweep)
    best = min(mults, key=sweep.__getitem__)
    return {"eval_scale": 0.5, "losses": {"assembled": assembled, "ensemble": ensemble, "residual_average": residual,
                                          "workers_mean": ensemble if workers is None else workers},
            "drift": [{"block": b, "holders": {"0": d}, "mean": d} for b, d in enumerate(drift)],
            "scale_sweep": {"multipliers": mults, "loss": [sweep[m] for m in mults], "best_multiplier": best,
                            "best_loss": sweep[best]}}


GROWING, FLAT = [0.0, 0.02, 0.1, 0.2], [0.05, 0.05, 0.05, 0.05]


@pytest.mark.parametrize("case, expected", [
    # the residual average recovers 80 % of the 0.1 gap, drift grows 0.01 -> 0.15, the factor is best: mismatch only
    (dict(assembled=2.1, ensemble=2.0, residual=2.02, drift=GROWING, sweep={0.5: 2.3, 1.0: 2.1, 2.0: 2.4}),
     ["composition mismatch"]),
    # the same gap recovered by the residual average, but the drift is flat: not mismatch
    (dict(assembled=2.1, ensemble=2.0, residual=2.02, drift=FLAT, sweep={0.5: 2.3, 1.0: 2.1, 2.0: 2.4}), []),
    # 0.75x the factor recovers 70 % of the gap, the residual average 10 %: branch magnitude only
    (dict(assembled=2.1, ensemble=2.0, residual=2.09, drift=GROWING, sweep={0.75: 2.03, 1.0: 2.1, 1.5: 2.2}),
     ["branch magnitude"]),
    # both recover most of the gap
    (dict(assembled=2.1, ensemble=2.0, residual=2.01, drift=GROWING, sweep={0.75: 2.03, 1.0: 2.1, 1.5: 2.2}),
     ["composition mismatch", "branch magnitude"]),
    # a scale recovering 40 % (below half) and a residual average recovering 30 %: neither
    (dict(assembled=2.1, ensemble=2.0, residual=2.07, drift=GROWING, sweep={0.75: 2.06, 1.0: 2.1, 1.5: 2.2}), []),
    # a gap below the floor: nothing to explain, whatever the rest says
    (dict(assembled=2.005, ensemble=2.0, residual=2.0, drift=GROWING, sweep={0.75: 2.0, 1.0: 2.005}), []),
], ids=["mismatch", "flat-drift", "magnitude", "both", "neither", "no-gap"])
def test_the_rule_names_the_explanation_the_numbers_support(case: dict[str, Any], expected: list[str]) -> None:
    from sdp.bench.diagnosis_verdict import markdown, section, verdict

    diag = diag_of(**case)
    v = verdict(diag)
    print(case, "->", v["explanations"], v["lines"])
    assert v["explanations"] == expected, (case, v)
    assert len(v["lines"]) == max(len(expected), 1), v  # one sentence per explanation, or the one saying none / no gap
    gap = case["assembled"] - case["ensemble"]
    assert v["gap"] == pytest.approx(gap), v
    if gap >= 0.01:
        assert v["recovered_by_residual_average"] == pytest.approx((case["assembled"] - case["residual"]) / gap), v
    full = {**diag, "verdict": v, "run_dir": "r", "step": 6, "dtype": "fp32", "world_size": 2, "blocks": 4,
            "rescale": "eval", "tokens": 10}
    text = "\n".join(markdown(full) + section([full]))
    assert all(e in text for e in expected) and v["lines"][0] in text, text


def test_the_ensemble_in_one_process_is_the_ranks_arithmetic() -> None:
    """:func:`sdp.rank.eval_ensemble.log_mean_prob` reduced over dim 0 (the diagnosis) is log(mean p) per row,
    exact where a float32 probability underflows; it is the function ``add_batch`` calls across ranks."""
    from sdp.bench.diagnose import _reduce_workers
    from sdp.rank.eval_ensemble import log_mean_prob

    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 5, 7, dtype=torch.float64), -1)[:, :, 0]  # 3 workers x 5 rows
    lp[0, 0], lp[1, 0], lp[2, 0] = -200.0, -201.0, -300.0
    got = log_mean_prob(lp.clone(), workers=3, reduce=_reduce_workers).squeeze(0)
    want = torch.logsumexp(lp, 0) - math.log(3)
    assert torch.allclose(got, want, rtol=0, atol=1e-12) and torch.isfinite(got).all(), (got, want)


def test_final_weights_round_trip_in_the_dtype_asked_for(tmp_path: Path) -> None:
    """The writer casts floating tensors (bf16: half the bytes, the values rounded as ``Tensor.to`` rounds) and
    keeps integer ones; the reader merges every rank's file and names a missing one."""
    from types import SimpleNamespace

    from sdp.errors import ConfigError
    from sdp.rank import final_weights

    torch.manual_seed(0)
    shares = [{"a.weight": torch.randn(4, 3)}, {"b.weight": torch.randn(5), "b.count": torch.tensor([3])}]
    for rank, tensors in enumerate(shares):
        strategy = SimpleNamespace(name="sdp", ctx=SimpleNamespace(rank=rank, world_size=2),
                                   final_state=lambda t=tensors, r=rank: {"tensors": t, "facts": {"x": 1}, "own": {"r": r}})
        final_weights.save(run_dir=tmp_path, strategy=strategy, dtype="bf16", step=7)
    fw = final_weights.load(tmp_path)
    assert fw.meta["step"] == 7 and fw.meta["dtype"] == "bf16" and fw.meta["facts"] == {"x": 1}, fw.meta
    assert fw.own == {0: {"r": 0}, 1: {"r": 1}}, fw.own
    for name, t in {**shares[0], **shares[1]}.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert fw.tensors[name].dtype == want.dtype and torch.equal(fw.tensors[name], want), name
    (tmp_path / "final" / "rank00001.pt").unlink()
    with pytest.raises(ConfigError, match="rank00001.pt is missing"):
        final_weights.load(tmp_path)


def test_save_final_is_refused_for_a_strategy_that_keeps_no_final_weights() -> None:
    """Before any rank starts: DDP keeps none (Strategy.final_state is None), so the key is named and refused."""
    from sdp.driver.config import validate
    from sdp.errors import ConfigError
    from tests.helpers.jobs import compose

    with pytest.raises(ConfigError, match=r"train\.save_final='fp32' is invalid: allowed: none for parallelism\.name=ddp"):
        validate(compose(["parallelism=ddp", "train.save_final=fp32", "cluster.world_size=2"]), launching=False)
    validate(compose(["parallelism=sdp", "train.save_final=bf16", "cluster.world_size=2"]), launching=False)


def test_a_run_recorded_before_the_key_is_the_same_job_only_without_final_weights() -> None:
    """``train.skip_done``: a run recorded before ``train.save_final`` kept no weights, so it is the same job at
    ``none`` and must run again where the weights are asked for."""
    from sdp.driver import sweep
    from tests.helpers import config_dict

    for value, same in (("none", True), ("bf16", False)):
        now = sweep.flatten(config_dict(["parallelism=sdp", f"train.save_final={value}"]))
        then = {k: v for k, v in now.items() if k != "train.save_final"}
        diff = sweep.first_difference(now=now, then=then)
        assert (diff is None) == same, (value, diff)


class Runs:
    """2-rank B-SDP runs with fp32 final weights, each trained once per module when a test first asks for it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory, self.done = factory, {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.done:
            run_dir = self.factory.mktemp(name)
            cov = {"c100": "1.0", "c50": "0.5", "c50_automaton": "0.5"}[name]
            # the automaton scores some targets only (IGNORE_INDEX on the rest): what the diagnosis must skip as the
            # run's evaluation skips it
            data = ["dataset=automaton", "dataset.num_samples=256", "dataset.num_val=32"] if name.endswith("automaton") else []
            run_job([*LLAMA, *data, f"parallelism.coverage={cov}", "train.save_final=fp32"], run_dir=run_dir, world=2)
            self.done[name] = run_dir
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory)


@pytest.mark.dist  # slow tier: the same diagnosis as the core case below, at another coverage
@pytest.mark.timeout(600)
def test_at_full_coverage_nothing_drifts_and_the_residual_average_is_the_assembled_model(runs: Runs) -> None:
    """C = 1: every worker's chain is the assembled model's, so each block's input equals its holders' (1 - cos = 0),
    the residual-stream average equals the assembled model's loss exactly, and so do the workers' and the run's own."""
    from sdp.bench.diagnose import diagnose

    d = diagnose(runs["c100"])
    loss = d["losses"]
    print(json.dumps({k: d[k] for k in ("losses", "drift", "run_figures")}, indent=1))
    assert d["eval_scale"] == 1.0 and all(set(h) == {0, 1} for h in d["plan"].values()), d["plan"]
    assert all(x == pytest.approx(0.0, abs=1e-12) for b in d["drift"] for x in b["holders"].values()), d["drift"]
    assert loss["residual_average"] == loss["assembled"] == loss["workers_mean"], loss
    # the ensemble's log-softmax in float32 against cross-entropy's: equal to float32 rounding (as tests/test_ensemble.py)
    assert loss["ensemble"] == pytest.approx(loss["assembled"], rel=1e-6), loss
    assert loss["assembled"] == pytest.approx(d["run_figures"]["eval_loss"], rel=1e-12), d["run_figures"]
    assert loss["ensemble"] == pytest.approx(d["run_figures"]["eval_loss_ensemble"], rel=1e-12), d["run_figures"]
    assert d["verdict"]["explanations"] == [], d["verdict"]


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [pytest.param("c50_automaton", marks=pytest.mark.core), "c50"])
def test_the_diagnosis_reproduces_the_runs_own_evaluation_from_the_final_weights(runs: Runs, name: str) -> None:
    """C = 0.5 (k = 1 of 2): the files hold one model (each block from its one holder, the shared parts from rank 0);
    the scale sweep at 1x the factor (k / n = 0.5), the assembled model, the workers' mean and their ensemble equal
    the run's own evaluation in summary.json; block 0 reads the embedding in every chain (drift 0) while a deeper
    block held by one worker sees another stream at assembly (drift > 0); diagnosis.json is written and
    ``sdp-bench slim-runs`` keeps what it reads."""
    from sdp.bench.diagnose import DIAGNOSIS, diagnose, load
    from sdp.bench.slim_runs import slim_run
    from sdp.rank import final_weights
    from sdp.subnet.assemble import tensor_map

    run = runs[name]
    fw = final_weights.load(run)
    plan = fw.meta["facts"]["plan"]
    assert plan["k"] == 1 and fw.meta["dtype"] == "fp32", fw.meta
    full = tensor_map(load(run).model)  # every tensor of the model, its values filled from the files exactly once
    assert sum(t.numel() for t in fw.tensors.values()) == sum(t.numel() for t in full.values()), (len(fw.tensors), len(full))
    held = {r: fw.own[r]["blocks"] for r in fw.own}
    assert sorted(b for bs in held.values() for b in bs) == [0, 1, 2, 3], held  # each block once: k = 1
    slim_run(run)  # drops plan.json, logs; the diagnosis reads config.yaml, summary.json and final/
    d = diagnose(run)
    loss, runf, sweep = d["losses"], d["run_figures"], d["scale_sweep"]
    print(json.dumps({k: d[k] for k in ("losses", "run_figures", "drift", "scale_sweep", "verdict")}, indent=1))
    assert d["eval_scale"] == 0.5 and sweep["scales"][sweep["multipliers"].index(1.0)] == 0.5, d
    assert sweep["loss"][sweep["multipliers"].index(1.0)] == pytest.approx(runf["eval_loss"], rel=1e-12), (sweep, runf)
    assert loss["assembled"] == pytest.approx(runf["eval_loss"], rel=1e-12), (loss, runf)
    assert loss["workers_mean"] == pytest.approx(runf["eval_loss_workers"], rel=1e-12), (loss, runf)
    assert loss["ensemble"] == pytest.approx(runf["eval_loss_ensemble"], rel=1e-12), (loss, runf)
    drift = {b["block"]: b for b in d["drift"]}
    assert drift[0]["mean"] == pytest.approx(0.0, abs=1e-12), drift[0]
    assert max(b["mean"] for b in d["drift"]) > 1e-6, d["drift"]
    assert json.loads((run / DIAGNOSIS).read_text())["losses"] == loss
    assert (run / "final" / "meta.json").is_file() and not (run / "plan.json").exists()
