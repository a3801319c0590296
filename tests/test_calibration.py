"""One BatchNorm calibration set (sdp.rank.evaluation.calibration_steps, Trainer.calibration): the same
training samples for every strategy at the same fraction of its budget, and for both of SDP's
evaluations (assembled model and each worker's own subnetwork), so the assembly gap measures
assembly and nothing else: exactly 0 at C = 1, where nothing is assembled."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from sdp.rank.evaluation import calibration_steps
from sdp.rank.schedule import eval_fractions

TINY_RESNET = ["model=resnet18_cifar", "model.width=4", "dataset=digits", "dataset.image_size=8", "train.batch_size=8",
               "train.steps=3", "train.warmup_steps=0", "train.eval_every=0", "optim=sgd"]


def test_every_eval_point_calibrates_where_ddp_does_at_the_same_fraction_of_the_budget() -> None:
    ddp, sdp = eval_fractions(steps=500, eval_every=0, eval_points=4), eval_fractions(steps=985, eval_every=0, eval_points=4)
    assert sorted(ddp.values()) == sorted(sdp.values()) == [Fraction(i, 4) for i in range(1, 5)], (ddp, sdp)
    for (n_ddp, f_ddp), (n_sdp, f_sdp) in zip(sorted(ddp.items()), sorted(sdp.items())):
        mine = calibration_steps(fraction=f_ddp, reference_steps=500, count=4)
        theirs = calibration_steps(fraction=f_sdp, reference_steps=500, count=4)
        assert mine == theirs == range(n_ddp - 4, n_ddp), (n_ddp, n_sdp, mine, theirs)  # DDP: its own last 4 steps
    every = eval_fractions(steps=1000, eval_every=100, eval_points=None)  # SDP at C = 0.5, eval_every under flops
    assert calibration_steps(fraction=every[200], reference_steps=500, count=4) == range(96, 100)  # DDP's step 100
    scaled = eval_fractions(steps=985, eval_every=198, eval_points=None, cadence=Fraction(100, 500))  # the budget's ceil
    assert [calibration_steps(fraction=scaled[s], reference_steps=500, count=4).stop for s in (198, 396, 792, 985)] \
        == [100, 200, 400, 500], scaled
    assert calibration_steps(fraction=Fraction(1, 985), reference_steps=500, count=4) == range(0, 1)


def _trainer(overrides: list[str], *, steps: int, budget: dict[str, Any] | None) -> Any:
    """A Trainer around a stand-in strategy (replica 0 of 2): only its data order and calibration are used."""
    from sdp.results.loggers import NullLogger
    from sdp.metrics.timing import PhaseTimer
    from sdp.parallel import DistContext
    from sdp.registry import build
    from sdp.rank.trainer import Trainer
    from tests.helpers import compose

    cfg = compose(overrides)
    cfg.train.steps = steps  # as the driver resolves it
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    module = nn.Linear(2, 2)
    strategy = SimpleNamespace(ctx=ctx, module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                               data_parallel=lambda: (0, 2), name="stand-in")
    return Trainer(cfg=cfg, strategy=strategy, data=build(cfg.dataset), logger=NullLogger(),  # type: ignore[arg-type]
                   timer=PhaseTimer(device=ctx.device), budget=budget)


def test_the_trainer_calibrates_ddp_and_sdp_on_identical_samples_under_a_flop_budget() -> None:
    common = ["model=mlp", "dataset=digits", "train.batch_size=4", "train.eval_points=2", "eval.bn_batches=3",
              "train.budget=flops"]
    budget = {"budget": "flops", "base_steps": 10}
    ddp, sdp = _trainer(common, steps=10, budget=budget), _trainer(common, steps=19, budget=budget)
    ddp.state.step, sdp.state.step = 5, 10  # both halfway: eval point 1 of 2
    for every in (False, True):
        a, b = ddp.calibration(every_replica=every), sdp.calibration(every_replica=every)
        assert len(a) == len(b) == (2 if every else 1)
        for shard_a, shard_b in zip(a, b):
            xa, xb = list(shard_a()), list(shard_b())
            assert len(xa) == len(xb) == 3 and all(torch.equal(u, v) for u, v in zip(xa, xb))
    scaled = {**budget, "schedule": {"train.eval_every": {"base": 5, "scaled": 10}}}  # eval_every scaled by the budget
    ddp_every = _trainer([*common, "train.eval_points=null", "train.eval_every=5"], steps=10, budget=scaled)
    sdp_every = _trainer([*common, "train.eval_points=null", "train.eval_every=10"], steps=19, budget=scaled)
    ddp_every.state.step, sdp_every.state.step = 5, 10  # both at their first evaluation (10 / 19 is past halfway)
    xa, xb = (list(t.calibration(every_replica=False)[0]()) for t in (ddp_every, sdp_every))
    assert len(xa) == len(xb) == 3 and all(torch.equal(u, v) for u, v in zip(xa, xb))
    x_all = ddp.data.train.tensors[0]  # DDP's own last 3 steps: both replicas' halves of each global batch
    shards = [list(s()) for s in ddp.calibration(every_replica=True)]
    for j, step in enumerate(range(2, 5)):
        expect = x_all[ddp.sampler.indices(step)]
        assert torch.equal(torch.cat([shards[0][j], shards[1][j]]), expect), f"calibration batch {j} is not step {step}'s"


def _c1_gap(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from sdp.results.loggers import NullLogger
    from sdp.metrics.timing import PhaseTimer
    from sdp.rank.trainer import Trainer
    from tests.helpers import make_strategy

    out = {}
    for name, config in configs.items():
        strategy, data, cfg = make_strategy(config, rank, world)
        trainer = Trainer(cfg=cfg, strategy=strategy, data=data, logger=NullLogger(),
                          timer=PhaseTimer(device=strategy.ctx.device))
        out[name] = trainer.fit().last_eval
    return out


@pytest.mark.dist
@pytest.mark.core
@pytest.mark.timeout(300)
def test_the_assembly_gap_is_exactly_zero_at_full_coverage_under_every_protocol() -> None:
    """C = 1 under each ``eval.bn``: the assembled model is DDP's bit for bit, each worker's own subnetwork is
    the assembled model (gap exactly 0) and the workers' ensemble is DDP's evaluation. Under ``average`` this
    holds only if every evaluated model carries the statistics averaged over the ranks that ran each layer:
    with each worker's own running statistics the gap was -1.6e-05 and the ensemble was not DDP's."""
    from tests.helpers import config_dict, spawn

    configs = {f"{name}-{bn}": config_dict([*TINY_RESNET, *overrides, "cluster.world_size=2", f"eval.bn={bn}"])
               for bn in ("reestimate", "average")
               for name, overrides in (("ddp", ["parallelism=ddp"]), ("sdp", ["parallelism=sdp", "parallelism.coverage=1.0"]))}
    for r, got in enumerate(spawn(_c1_gap, world=2, args=(configs,), timeout_s=280)):
        for bn in ("reestimate", "average"):
            sdp, ddp = got[f"sdp-{bn}"], got[f"ddp-{bn}"]
            print(f"rank {r} eval.bn={bn}: DDP {ddp['eval_loss']!r} | assembled {sdp['eval_loss']!r} workers' "
                  f"{sdp['eval_loss_workers']!r} gap {sdp['assembly_gap']!r} ensemble {sdp['eval_loss_ensemble']!r}")
            assert sdp["eval_loss"] == ddp["eval_loss"], f"rank {r} {bn}: C = 1 is DDP bit for bit: {sdp} vs {ddp}"
            assert sdp["assembly_gap"] == 0.0, f"rank {r} {bn}: nothing is assembled at C = 1, yet the gap is nonzero: {sdp}"
            assert sdp["eval_loss_workers"] == sdp["eval_loss"] and sdp["eval_accuracy_workers"] == sdp["eval_accuracy"], sdp
            # the ensemble's loss is a log-mean-exp summed in float64 (sdp.rank.eval_ensemble), DDP's a float32
            # cross-entropy: equal to that rounding (3e-8 here; each worker's own statistics gave 4e-7)
            assert sdp["eval_loss_ensemble"] == pytest.approx(ddp["eval_loss"], rel=1e-7, abs=0), (r, bn, sdp, ddp)
            assert sdp["eval_accuracy_ensemble"] == ddp["eval_accuracy"], (r, bn, sdp, ddp)
        assert got["ddp-average"]["eval_loss"] != got["ddp-reestimate"]["eval_loss"], f"the protocols must differ here: {got}"
