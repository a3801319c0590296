"""Fast unit tests of the foundation's pure pieces: data order, LR schedule, comm maths, registry."""

from __future__ import annotations

import math

import pytest
import torch

from sdp.data.base import GlobalBatchSampler
from sdp.metrics.comm import CommCounter, wire_bytes
from sdp.registry import Registry
from sdp.results.contract import scrub
from sdp.rank.schedule import lr_lambda


@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_global_batch_same_whatever_the_split(replicas: int):
    s = GlobalBatchSampler(num_samples=1000, global_batch=64, seed=3)
    for step in (0, 1, 14, 15, 16, 40):
        shards = [s.shard(step, replica=r, replicas=replicas) for r in range(replicas)]
        joined = torch.cat(shards)
        assert torch.equal(joined, s.indices(step)), f"step {step}: shards do not tile the global batch"
        assert len(set(joined.tolist())) == 64, "duplicate sample inside one global batch"


def test_global_batch_is_pure_function_of_seed_and_step():
    a = GlobalBatchSampler(num_samples=500, global_batch=32, seed=1)
    b = GlobalBatchSampler(num_samples=500, global_batch=32, seed=1)
    order = [40, 3, 17, 3, 0]
    for step in order:  # b visits in another order (a resumed run jumps ahead)
        assert torch.equal(a.indices(step), GlobalBatchSampler(num_samples=500, global_batch=32, seed=1).indices(step))
    assert not torch.equal(a.indices(0), GlobalBatchSampler(num_samples=500, global_batch=32, seed=2).indices(0))
    epoch = torch.cat([b.indices(s) for s in range(b.steps_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch), "an epoch repeats samples"


def test_global_batch_larger_than_dataset_is_rejected():
    with pytest.raises(ValueError, match="exceeds the 10 training samples"):
        GlobalBatchSampler(num_samples=10, global_batch=16, seed=0)


def test_lr_schedules():
    cos = lr_lambda(schedule="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    lin = lr_lambda(schedule="linear", warmup_steps=0, total_steps=100, min_lr_ratio=0.0)
    assert lin(50) == pytest.approx(0.5)
    assert lr_lambda(schedule="constant", warmup_steps=0, total_steps=5, min_lr_ratio=0)(4) == 1.0
    with pytest.raises(ValueError, match="optim.schedule='step'"):
        lr_lambda(schedule="step", warmup_steps=0, total_steps=5, min_lr_ratio=0)


def test_ring_wire_bytes():
    assert wire_bytes(kind="all_reduce", payload=1000, group_size=4) == pytest.approx(1500)
    assert wire_bytes(kind="all_reduce", payload=1000, group_size=1) == 0
    assert wire_bytes(kind="all_gather", payload=1000, group_size=4) == pytest.approx(750)
    assert wire_bytes(kind="send", payload=10, group_size=2) == 10


def test_comm_counter_averages_measured_steps_only():
    c = CommCounter()
    c.record(kind="all_reduce", payload=999, group_size=2)  # warm-up step, not measured
    c.end_step()
    c.measuring = True
    for _ in range(2):
        c.record(kind="all_reduce", payload=100, group_size=4)
        c.record(kind="broadcast", payload=20, group_size=2)
        c.end_step()
    c.phase = "eval"
    c.record(kind="broadcast", payload=5, group_size=2)
    s = c.summary()
    assert s["bytes_per_step"] == 120 and s["collectives_per_step"] == 2 and s["measured_steps"] == 2
    assert s["by_group_size"]["4"]["bytes"] == 100
    assert math.isclose(s["wire_bytes_per_step"], 150 + 20)
    assert s["outside_training"]["eval"] == {"bytes": 5, "collectives": 1}


def test_registry_error_names_key_value_and_allowed():
    reg: Registry[int] = Registry(kind="strategy", key="parallelism.name")
    reg.register("ddp")(1)
    with pytest.raises(KeyError, match=r"parallelism.name='dpp' is not a known strategy; allowed: ddp"):
        reg.get("dpp")


def test_scrub_removes_secrets():
    out = scrub({"logger": {"wandb": {"api_key": "abc", "project": "p"}}, "x": [{"token": 1}]})
    assert out["logger"]["wandb"]["api_key"] == "<redacted>" and out["logger"]["wandb"]["project"] == "p"
    assert out["x"][0]["token"] == "<redacted>"


def test_rank_failure_survives_pickling():
    """The Slurm launcher pickles a job's exception back to the submitting process."""
    import pickle

    from sdp.driver.launch import RankFailure

    e = pickle.loads(pickle.dumps(RankFailure("rank 1 of 2 failed", rank=1, exitcode=-9)))
    assert (str(e), e.rank, e.exitcode) == ("rank 1 of 2 failed", 1, -9)


def test_eval_points_place_evaluations_at_the_same_budget_fractions() -> None:
    """A FLOP-matched run with 4x the steps is evaluated at the same fractions of its budget, not 4x as often."""
    from sdp.rank.schedule import eval_steps

    assert eval_steps(steps=1000, eval_every=0, eval_points=5) == {200, 400, 600, 800, 1000}
    assert eval_steps(steps=4000, eval_every=100, eval_points=5) == {800, 1600, 2400, 3200, 4000}
    assert eval_steps(steps=1333, eval_every=0, eval_points=4) == {334, 667, 1000, 1333}
    assert eval_steps(steps=3, eval_every=0, eval_points=10) == {1, 2, 3}
    assert eval_steps(steps=10, eval_every=4, eval_points=None) == {4, 8, 10}
    assert eval_steps(steps=10, eval_every=0, eval_points=None) == {10}
