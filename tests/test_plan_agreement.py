"""Ranks that derive different SDP plans fail at once, naming the ranks (issue 35, item 12).

Every rank derives each re-drawn plan itself (and, under Slurm tasks or torchrun, the first one too),
then creates the plan's process groups and moves its pieces in an order read from it. A divergence (a float
tie broken differently, a library that differs between nodes) used to give mismatched communicators and
transfers waiting for a peer: a hang until ``cluster.timeout_s``. Now the ranks compare a digest of the plan
first (:func:`sdp.subnet.holder_groups.check_same_plan`); here one rank's plan is perturbed on purpose.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from sdp.parallel import sdp as sdp_module
from sdp.parallel import sdp_plan
from tests.helpers import config_dict, make_strategy, spawn

WORLD, ODD = 3, 2  # 3 ranks at C = 0.5 (k = 2): the units' holder sets differ, so a swap changes the plan
CONFIG = ["model=mlp", "dataset=digits", "model.hidden=64", "model.depth=4", "train.batch_size=8", "parallelism=sdp",
          "parallelism.resample_every=2", f"cluster.world_size={WORLD}"]


def _perturbed(plan):  # noqa: ANN001, ANN202
    """``plan`` with the holders of unit 0 and of the first unit held otherwise swapped."""
    holders = list(plan.holders)
    other = next(u for u, h in enumerate(holders) if h != holders[0])
    holders[0], holders[other] = holders[other], holders[0]
    return dataclasses.replace(plan, holders=tuple(holders))


def _diverge(rank: int, world: int, config: dict, where: str) -> tuple[str | None, float]:
    if rank == ODD and where == "redraw":
        real_next = sdp_plan.next_plan
        sdp_plan.next_plan = lambda **kw: (lambda plan, costs: (_perturbed(plan), costs))(*real_next(**kw))
    if rank == ODD and where == "setup":  # the plan a rank draws itself (prepared None: as a process's own driver)
        real_for = sdp_module.plan_for
        sdp_module.plan_for = lambda **kw: _perturbed(real_for(**kw))
    start = time.monotonic()
    try:
        strategy, _, _ = make_strategy(config, rank, world)
        strategy._redraw(draw=1)
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["redraw", "setup"])
def test_a_rank_with_another_plan_is_named_not_waited_for(where: str) -> None:
    got = spawn(_diverge, world=WORLD, args=(config_dict(CONFIG), where), timeout_s=150)
    draw = 1 if where == "redraw" else 0
    for rank, (msg, seconds) in enumerate(got):
        assert msg is not None, f"rank {rank} went on with a plan rank {ODD} does not share"
        assert msg.startswith(f"PlanMismatch: draw {draw} of the SDP plan: ranks [{ODD}] derived a different plan from "
                              "rank 0's"), f"rank {rank}: {msg}"
        assert seconds < 30, f"rank {rank} took {seconds:.0f} s to fail (a wait for a peer, not the check)"
