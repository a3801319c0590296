"""The numerics guard in one process (fast): what it reports, and that ``skip`` really drops the update.
The multi-rank behaviour (every rank decides alike, the run ends) is in test_reliability.py."""

from __future__ import annotations

import pytest
import torch

from sdp.rank import guards
from sdp.parallel.base import StepResult
from sdp.core.distctx import DistContext

CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def setup(policy: str) -> tuple[torch.nn.Linear, torch.optim.Optimizer, guards.NumericsGuard]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    return lin, opt, guards.NumericsGuard(policy=policy, ctx=CTX, optimizer=opt)


def one_step(lin: torch.nn.Linear, opt: torch.optim.Optimizer, *, poison: bool) -> StepResult:
    loss = lin(torch.ones(4, 3)).pow(2).mean() * (float("nan") if poison else 1.0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return StepResult(loss_sum=loss.detach() * 4, count=4)


@pytest.mark.parametrize("policy", guards.POLICIES)
def test_finite_step_passes_and_updates(policy: str) -> None:
    lin, opt, guard = setup(policy)
    before = lin.weight.detach().clone()
    loss, problem = guard.check(step=1, result=one_step(lin, opt, poison=False))
    assert problem is None and loss > 0 and not torch.equal(before, lin.weight)


def test_skip_drops_the_update_of_a_nan_step() -> None:
    lin, opt, guard = setup("skip")
    before = lin.weight.detach().clone()
    loss, problem = guard.check(step=5, result=one_step(lin, opt, poison=True))
    assert loss != loss  # NaN is logged as NaN
    assert problem == ("step 5: non-finite loss on rank(s) [0] and non-finite gradient norm on rank(s) [0]; "
                       "update skipped (train.nan_policy=skip)")
    assert torch.equal(before, lin.weight) and guard.skipped_steps == 1
    assert guard.check(step=6, result=one_step(lin, opt, poison=False))[1] is None  # and training goes on


def test_stop_reports_the_step_and_rank() -> None:
    lin, opt, guard = setup("stop")
    _, problem = guard.check(step=3, result=one_step(lin, opt, poison=True))
    assert problem is not None and problem.startswith("step 3: non-finite loss on rank(s) [0]") and "stops" in problem
    with pytest.raises(guards.NonFiniteError, match=r"^step 3: non-finite .* \(rank 0 reporting\)$"):
        guard.stop_if(problem=problem)
    guard.stop_if(problem=None)  # a clean step goes on


def test_skip_never_stops_the_run() -> None:
    lin, opt, guard = setup("skip")
    _, problem = guard.check(step=2, result=one_step(lin, opt, poison=True))
    assert problem is not None, "the poisoned step is flagged"
    guard.stop_if(problem=problem)  # under skip the run goes on: no raise


def test_errors_inside_a_step_name_step_rank_and_timeout() -> None:
    with pytest.raises(guards.StepFailure, match=r"step 7 failed on rank 2 \(a collective did not complete within cluster.timeout_s=5"):
        with guards.naming_step(step=7, rank=2, timeout_s=5):
            raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    with pytest.raises(guards.NonFiniteError):  # already names its step: passed through untouched
        with guards.naming_step(step=7, rank=2, timeout_s=5):
            raise guards.NonFiniteError("step 7: ...")
