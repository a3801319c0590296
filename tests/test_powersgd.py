"""PowerSGD through torch's DDP comm hook (sdp/parallel/powersgd.py), on 2 spawned gloo ranks.

- the mechanism: at full rank (r >= min(n, m) of every matrix, every tensor compressed) the decompressed
  average is exact, so training equals DDP's to float tolerance; at rank 1 it does not;
- the communication recorded is what the hook sends (the uncompressed tensors whole, then P and Q), equal to
  the sum over the model's tensors computed here from their shapes, and to ``sdp-plan``'s prediction; before
  ``start_iter`` the bucket whole;
- a resumed run (the checkpoint after compression has started) equals the uninterrupted one bit for bit,
  each rank restoring its own error feedback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sdp.driver.config import validate
from sdp.metrics.timing import PhaseTimer
from sdp.core.loss import loss_fn
from tests.helpers import CORE, batch, compose, config_dict, make_strategy, spawn

pytestmark = [pytest.mark.dist]

MODEL = ["model=mlp", "model.dim=16", "model.hidden=24", "model.depth=2", "dataset=digits", "cluster.world_size=2",
         "train.batch_size=8", "optim=sgd", "optim.optimizer.lr=0.05"]
START = 2  # parallelism.start_iter: steps 0 and 1 all-reduce the bucket whole, PowerSGD from step 2


def _params(strategy: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.unwrapped().named_parameters()}


def _train(strategy: Any, data: Any, cfg: Any, *, rank: int, world: int, first: int, last: int) -> list[dict[str, torch.Tensor]]:
    """Steps ``first`` .. ``last`` - 1 as the trainer runs them; the parameters after each."""
    out = []
    for step in range(first, last):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=PhaseTimer(device=torch.device("cpu")), step=step)
        strategy.ctx.comm.end_step()
        out.append(_params(strategy))
    return out


# ---- the mechanism: full rank equals DDP, rank 1 does not ---------------------------------------------------

def _curves(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, config in configs.items():
        strategy, data, cfg = make_strategy(config, rank, world)
        out[key] = {"params": _train(strategy, data, cfg, rank=rank, world=world, first=0, last=START + 4),
                    "stats": strategy.summary_extra().get("powersgd")}
    return out


@CORE
@pytest.mark.timeout(120)
def test_full_rank_powersgd_equals_ddp_and_rank_one_does_not() -> None:
    shapes = [p.shape for p in validate(compose([*MODEL, "parallelism=ddp"])).model.parameters()]  # the ranks' model (meta)
    full = max(min(s[0], s.numel() // s[0]) for s in shapes)  # r >= min(n, m) of every matrix
    psgd = ["parallelism=powersgd", f"parallelism.start_iter={START}", "parallelism.min_compression_rate=0"]
    configs = {"ddp": config_dict([*MODEL, "parallelism=ddp"]),
               "full": config_dict([*MODEL, *psgd, f"parallelism.rank={full}"]),
               "rank1": config_dict([*MODEL, *psgd, "parallelism.rank=1"])}
    got = spawn(_curves, world=2, args=(configs,), timeout_s=100)
    for r, g in enumerate(got):
        stats = g["full"]["stats"]
        assert stats["iter"] == START + 4 and stats["numel_after"] > stats["numel_before"], \
            f"rank {r}: compression did not run on every tensor at full rank: {stats}"
        for step, (ddp, full_rank, low) in enumerate(zip(g["ddp"]["params"], g["full"]["params"], g["rank1"]["params"])):
            worst = max((full_rank[k] - ddp[k]).abs().max().item() for k in ddp)
            assert worst < 1e-6, f"rank {r} step {step}: full-rank PowerSGD left DDP by {worst:.3g}"
            gap = max((low[k] - ddp[k]).abs().max().item() for k in ddp)
            if step >= START:
                assert gap > 1e-3, f"rank {r} step {step}: rank-1 PowerSGD equals DDP (gap {gap:.3g}): the test cannot fail"
            else:
                assert gap < 1e-5, f"rank {r} step {step}: before start_iter PowerSGD must all-reduce as DDP (gap {gap:.3g})"


# ---- the communication: what the hook sends, and sdp-plan's prediction -------------------------------------------

RANK = 2
COMM = [*MODEL, "parallelism=powersgd", f"parallelism.rank={RANK}", f"parallelism.start_iter={START}",
        "parallelism.min_compression_rate=1"]


def _comm(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    strategy, data, cfg = make_strategy(config, rank, world)
    strategy.ctx.comm.measuring = True
    _train(strategy, data, cfg, rank=rank, world=world, first=0, last=START + 3)
    return {"steps": strategy.ctx.comm.state_dict()["steps"], "stats": strategy.summary_extra()["powersgd"]}


@CORE
@pytest.mark.timeout(120)
def test_recorded_bytes_are_the_hooks_p_q_and_uncompressed_tensors_and_the_plan_predicts_them() -> None:
    from sdp.planning.planner import predict

    params = list(validate(compose(COMM)).model.parameters())  # the model the ranks build, on the meta device
    total = sum(p.numel() * 4 for p in params)
    p_bytes = q_bytes = whole = 0
    for p in params:  # torch's rule by hand: an n x m matrix (shape[0] x the rest) at rank min(n, m, r)
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, RANK)
        if (n + m) * r * 1 < n * m:
            p_bytes, q_bytes = p_bytes + n * r * 4, q_bytes + m * r * 4
        else:
            whole += p.numel() * 4
    assert whole and p_bytes and q_bytes, f"the model needs tensors of both kinds: whole={whole} P={p_bytes} Q={q_bytes}"
    got = spawn(_comm, world=2, args=(config_dict(COMM),), timeout_s=100)
    for r, g in enumerate(got):
        steps = [[tuple(rec) for rec in step] for step in g["steps"]]
        assert steps[:START] == [[("all_reduce", total, 2)]] * START, f"rank {r} before start_iter: {steps[:START]}"
        compressed = [("all_reduce", whole, 2), ("all_reduce", p_bytes, 2), ("all_reduce", q_bytes, 2)]
        for i, step in enumerate(steps[START:], start=START):
            assert step == compressed, f"rank {r} step {i}: recorded {step}, the hook sends {compressed}"
        assert g["stats"]["p_bytes"] == p_bytes and g["stats"]["q_bytes"] == q_bytes and g["stats"]["error_bytes"] == total, g["stats"]
    plan = predict(compose(COMM))
    for c in plan["comm"]["per_rank"]:
        assert c["bytes_per_step"] == whole + p_bytes + q_bytes and c["collectives_per_step"] == 3, c
    facts = plan["powersgd"]
    assert {k: facts[k] for k in ("error_bytes", "p_bytes", "q_bytes")} == \
        {k: got[0]["stats"][k] for k in ("error_bytes", "p_bytes", "q_bytes")}, (facts, got[0]["stats"])
    assert facts["uncompressed_bytes_per_step"] == total, facts


# ---- checkpoint: each rank's hook state, a bit-identical resume ------------------------------------------------

SAVE_AT, STEPS = START + 2, START + 5
RESUME = [*MODEL, "parallelism=powersgd", f"parallelism.rank={RANK}", f"parallelism.start_iter={START}"]
KEY = {"seed": 0, "global_batch": 16, "num_samples": 0}


def _resume(rank: int, world: int, config: dict[str, Any], run_dir: str) -> dict[str, Any]:
    from sdp.rank import checkpoint

    a, data, cfg = make_strategy(config, rank, world)
    sched_a = torch.optim.lr_scheduler.LambdaLR(a.optimizer, lambda k: 1.0 / (k + 1))
    _train(a, data, cfg, rank=rank, world=world, first=0, last=SAVE_AT)
    error = {k: v.clone() for k, v in a.hook.error_dict.items()}
    checkpoint.save(run_dir=Path(run_dir), step=SAVE_AT, strategy=a, scheduler=sched_a, train_state={"step": SAVE_AT},
                    data_key=KEY, keep=0)
    uninterrupted = _train(a, data, cfg, rank=rank, world=world, first=SAVE_AT, last=STEPS)
    b, _, _ = make_strategy(config, rank, world)
    sched_b = torch.optim.lr_scheduler.LambdaLR(b.optimizer, lambda k: 1.0 / (k + 1))
    checkpoint.load(path=checkpoint.step_dir(Path(run_dir), SAVE_AT), strategy=b, scheduler=sched_b, data_key=KEY)
    resumed = _train(b, data, cfg, rank=rank, world=world, first=SAVE_AT, last=STEPS)
    return {"error": error, "uninterrupted": uninterrupted, "resumed": resumed, "iter": (a.hook.iter, b.hook.iter)}


@CORE
@pytest.mark.timeout(120)
def test_resume_after_compression_started_is_bit_identical(tmp_path: Path) -> None:
    got = spawn(_resume, world=2, args=(config_dict(RESUME), str(tmp_path)), timeout_s=100)
    e0, e1 = got[0]["error"], got[1]["error"]
    assert e0 and any(not torch.equal(e0[k], e1[k]) for k in e0), "the ranks' error feedback is equal: nothing per rank tested"
    for r, g in enumerate(got):
        for step, (u, s) in enumerate(zip(g["uninterrupted"], g["resumed"]), start=SAVE_AT):
            differ = [k for k in u if not torch.equal(u[k], s[k])]
            assert not differ, f"rank {r} step {step}: the resumed run left the uninterrupted one at {differ}"
        assert g["iter"] == (STEPS, STEPS), f"rank {r}: hook iterations {g['iter']}, expected {STEPS} both"
