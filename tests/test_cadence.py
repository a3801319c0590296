"""The trainer's per-step decisions (:class:`sdp.rank.schedule.Cadence`): which steps log, evaluate and
checkpoint, and which fraction of the budget an evaluation stands for. Pure: no model, no ranks."""

from __future__ import annotations

from fractions import Fraction

import pytest
from omegaconf import OmegaConf

from sdp.rank.schedule import Cadence, budget_clock, eval_fractions


def cadence(*, steps: int = 10, log_every: int = 1, checkpoint_every: int = 0, eval_every: int = 0,
            eval_points: int | None = None, budget: dict | None = None) -> Cadence:
    train = OmegaConf.create({"steps": steps, "log_every": log_every, "checkpoint_every": checkpoint_every,
                              "eval_every": eval_every, "eval_points": eval_points})
    return Cadence.of(train=train, budget=budget)


def test_logs_every_log_every_steps_at_the_last_and_at_a_flagged_step() -> None:
    c = cadence(steps=10, log_every=4)
    logged = [n for n in range(1, 11) if c.logs(n, problem=None)]
    assert logged == [4, 8, 10], f"log_every=4 over 10 steps: multiples and the last, got {logged}"
    assert c.logs(5, problem="step 5: non-finite loss on rank(s) [1]; the run stops"), "a flagged step is logged"
    assert not c.logs(5, problem=""), "an empty problem is no problem"
    every = cadence(steps=3, log_every=1)
    assert [n for n in range(1, 4) if every.logs(n, problem=None)] == [1, 2, 3]


def test_checkpoints_at_multiples_and_the_last_step_and_never_at_zero() -> None:
    c = cadence(steps=10, checkpoint_every=3)
    saved = [n for n in range(1, 11) if c.checkpoints(n)]
    assert saved == [3, 6, 9, 10], f"checkpoint_every=3 over 10 steps: multiples and the last, got {saved}"
    exact = cadence(steps=9, checkpoint_every=3)
    assert [n for n in range(1, 10) if exact.checkpoints(n)] == [3, 6, 9], "the last step is one multiple, once"
    never = cadence(steps=10, checkpoint_every=0)
    assert not any(never.checkpoints(n) for n in range(1, 11)), "checkpoint_every=0 writes no checkpoint"


@pytest.mark.parametrize("steps,eval_every,eval_points", [(10, 4, None), (10, 0, None), (1333, 0, 4), (3, 0, 10),
                                                          (4000, 100, 5)])
def test_evaluates_exactly_at_eval_fractions(steps: int, eval_every: int, eval_points: int | None) -> None:
    c = cadence(steps=steps, eval_every=eval_every, eval_points=eval_points)
    expect = eval_fractions(steps=steps, eval_every=eval_every, eval_points=eval_points)
    got = [n for n in range(1, steps + 1) if c.evaluates(n)]
    assert got == sorted(expect), f"steps={steps} eval_every={eval_every} eval_points={eval_points}: {got}"
    assert c.evaluates(steps), "the last step is always evaluated"
    assert all(c.fraction(n) == f for n, f in expect.items()), (c.eval_at, expect)
    assert c.reference_steps == steps, "without a FLOP budget a fraction is of the run's own steps"


def test_evaluates_at_eval_every_multiples_only() -> None:
    c = cadence(steps=10, eval_every=4)
    assert [n for n in range(1, 11) if c.evaluates(n)] == [4, 8, 10]
    assert c.fraction(4) == Fraction(4, 10) and c.fraction(10) == 1
    assert c.fraction(5) == Fraction(5, 10), "off the schedule: the step's own share of the run"


def test_under_a_flop_budget_fractions_are_of_ddps_steps() -> None:
    """SDP at C = 0.5 runs 19 steps for DDP's 10; the budget scaled eval_every 5 -> 10: its first evaluation
    stands for DDP's first, at half the budget, and calibration counts DDP's steps."""
    budget = {"budget": "flops", "base_steps": 10, "schedule": {"train.eval_every": {"base": 5, "scaled": 10}}}
    c = cadence(steps=19, eval_every=10, budget=budget)
    assert c.reference_steps == 10 and budget_clock(budget=budget, steps=19) == (10, Fraction(1, 2))
    assert [n for n in range(1, 20) if c.evaluates(n)] == [10, 19]
    assert (c.fraction(10), c.fraction(19)) == (Fraction(1, 2), Fraction(1)), c.eval_at
    assert c.fraction(5) == Fraction(5, 19), "off the schedule: the run's own share, not DDP's"
    plain = cadence(steps=19, eval_every=10)
    assert plain.fraction(10) == Fraction(10, 19), "without the budget the fraction is the run's own"


def test_the_cadence_is_frozen() -> None:
    c = cadence()
    with pytest.raises(AttributeError):
        c.log_every = 2  # type: ignore[misc]
