"""Re-draws keep holders identical (issue 13, part 3): after re-draws of the plan, every parameter
piece present on several ranks' checkpoints is bit-identical across them, and so is every piece of
optimizer state of the ranks that train it (SGD momentum, AdamW moments and step), at block and neuron
level, under forward and backward masking. Before state was carried (``sdp.subnet.carry``) a new
co-holder started without state and the holders drifted apart.

The ranks' checkpoint content is ``SDPStrategy.checkpoint_state()["local"]`` (what ``rank*.pt`` holds),
read piece by piece by ``tests/holders.py``, the same reader that counts differing tensors of a real
run's checkpoint directory (``python -m tests.holders <run>/checkpoints/step_N``).
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sdp.parallel.sdp_plan import plan_for, plan_lists
from sdp.core.loss import loss_fn
from sdp.registry import build
from tests.helpers import batch, compose, config_dict, core_cases, make_strategy, run_job, spawn
from tests.holders import compare, differing, pieces_of

MLP = ["model=mlp", "dataset=digits", "model.hidden=64", "model.depth=4", "train.batch_size=8"]
STEPS, EVERY = 5, 2  # re-draws before steps 2 and 4: two re-draws, the last one followed by an update
# (id, overrides): each level, masking, refresh and optimizer, SGD with Nesterov momentum and AdamW
# (the first is in the default tier, CORE below; the others, the neuron level with AdamW included, in the slow tier)
CASES = [
    ("block-fwd-sgd", ["parallelism=sdp", "optim=sgd"]),
    ("neuron-bwd-adamw", ["parallelism=sdp_neuron_bwd", "optim=adamw"]),
    ("neuron-fwd-adamw", ["parallelism=sdp_neuron_fwd", "optim=adamw"]),
    ("block-bwd-sgd", ["parallelism=sdp_block_bwd", "optim=sgd"]),
    ("neuron-global-adamw", ["parallelism=sdp_neuron_bwd", "parallelism.refresh=global", "optim=adamw"]),
]


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _train(rank: int, world: int, config: dict, early: bool) -> tuple[dict, int, dict]:
    strategy, data, cfg = make_strategy(config, rank, world)
    if early:  # a re-draw before any update: no optimizer state exists yet on any rank, none is made up
        strategy._redraw(draw=7)
        assert not strategy.optimizer.state, f"rank {rank}: state after a re-draw before the first step"
    for step in range(STEPS):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
    return strategy.checkpoint_state()["local"], strategy.redraws, strategy.ctx.comm.summary()["outside_training"]


def _meta_model(cfg):  # noqa: ANN001, ANN202
    with torch.device("meta"):
        return build(cfg.model)


def _check(config: dict, got: list[tuple[dict, int, dict]], *, redraws: int) -> dict:
    cfg = OmegaConf.create(config)
    assert [g[1] for g in got] == [redraws] * len(got), f"re-draws per rank {[g[1] for g in got]}, expected {redraws}"
    first = plan_lists(plan_for(model=_meta_model(cfg), cfg=cfg.parallelism, world_size=len(got)))
    assert got[0][0]["extra"]["plan"]["holders"] != first["holders"], "the re-draws changed no holders: nothing tested"
    res = compare([pieces_of(g[0], cfg=cfg, rank=r) for r, g in enumerate(got)])
    assert res["multi"] > 0 and res["trained_by_several"] > 0, f"nothing held by several ranks to compare: {res}"
    assert not res["params"], f"parameter pieces differ between ranks: {res['params']}"
    assert not res["missing_state"], f"pieces trained without state on some holders: {res['missing_state']}"
    assert not res["state"], f"optimizer state differs between holders: {res['state']}"
    return res


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "sel"), core_cases(CASES, ids=[c[0] for c in CASES], core={"block-fwd-sgd"}))
def test_redraws_keep_holders_identical(case: str, sel: list[str]) -> None:
    world = 4
    config = config_dict(MLP + sel + [f"parallelism.resample_every={EVERY}", f"cluster.world_size={world}"])
    got = spawn(_train, world=world, args=(config, False))
    _check(config, got, redraws=2)
    # the history went on: every trainer of every piece has state from the first step, not since a re-draw
    for r, (local, _, _) in enumerate(got):
        state = local["optimizer"]["state"]
        trained = local["optimizer"]["param_groups"][0]["params"]
        assert len(state) == len(trained), f"rank {r}: {len(trained) - len(state)} trained tensors without state"
        for s in state.values():
            if "step" in s:
                assert float(s["step"]) == STEPS, f"rank {r}: AdamW step {float(s['step'])}, expected {STEPS}"
            else:
                assert isinstance(s["momentum_buffer"], torch.Tensor), f"rank {r}: {s}"
    _check_traffic(config, got)


def _check_traffic(config: dict, got: list[tuple[dict, int, dict]]) -> None:
    """Re-draw traffic is recorded apart from the training steps' (comm phase "resample")."""
    if config["parallelism"]["refresh"] != "global":  # global refresh: every rank has everything, nothing moves
        seen = [g[2].get("resample", {}).get("collectives", 0) for g in got]
        assert all(c > 0 for c in seen), f"re-draw collectives per rank under phase resample: {seen}"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_redraw_without_optimizer_state() -> None:
    """SGD without momentum never has state, and a re-draw before the first step finds none: nothing is
    carried, nothing is invented, and the holders still agree."""
    world = 4
    config = config_dict(MLP + ["parallelism=sdp_neuron_fwd", "optim=sgd", "optim.optimizer.momentum=0",
                                "optim.optimizer.nesterov=false", f"parallelism.resample_every={EVERY}",
                                f"cluster.world_size={world}"])
    got = spawn(_train, world=world, args=(config, True))
    res = _check(config, got, redraws=3)
    assert all(not g[0]["optimizer"]["state"] for g in got), "SGD without momentum keeps no state"
    assert res["trained_by_several"] > 0
    _check_traffic(config, got)


def test_holders_reader_sees_a_difference() -> None:
    """The comparison is not blind: one perturbed element of one rank's momentum is reported."""
    a = {("w", 0): {"param": torch.ones(2), "state": {"momentum_buffer": torch.ones(2)}}}
    b = {("w", 0): {"param": torch.ones(2), "state": {"momentum_buffer": torch.tensor([1.0, 1.5])}}}
    res = compare([a, b])
    assert res["state"] == [("w", 0)] and not res["params"], res


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_redraws_keep_holders_identical_in_checkpoint_files(tmp_path) -> None:  # noqa: ANN001
    """The issue's measurement on a whole job (worker, trainer, checkpoint files on disk)."""
    sel = MLP + ["parallelism=sdp", "optim=sgd", f"parallelism.resample_every={EVERY}", f"train.steps={STEPS}",
                 f"train.checkpoint_every={STEPS}", "train.eval_every=0"]
    run_job(sel, world=4, run_dir=tmp_path)
    res = differing(tmp_path / "checkpoints" / f"step_{STEPS:08d}", cfg=compose([*sel, "cluster.world_size=4"]))
    assert res["trained_by_several"] > 0 and not (res["params"] or res["state"] or res["missing_state"]), res


def test_summary_lists_the_first_redraws_and_totals_every_one() -> None:
    """A run re-drawing every step writes a summary of fixed size: the first DRAWS_LISTED re-draws one by one,
    the totals and each rank's largest re-draw over all of them."""
    from sdp.subnet.redraw import DRAWS_LISTED, summary
    log = [{"draw": d, "sent_bytes": [d, 0], "received_bytes": [0, d], "peak_bytes": 1} for d in range(1, DRAWS_LISTED + 51)]
    info = summary(count=len(log), log=log, world=2)
    assert [d["draw"] for d in info["draws"]] == list(range(1, DRAWS_LISTED + 1)) and info["draws_listed"] == DRAWS_LISTED
    total = sum(range(1, DRAWS_LISTED + 51))
    assert info["bytes_moved"] == {"sent": [total, 0], "received": [0, total]}, info["bytes_moved"]
    assert info["largest_draw_bytes"] == {"sent": [DRAWS_LISTED + 50, 0], "received": [0, DRAWS_LISTED + 50]}, info
    assert summary(count=0, log=[], world=2)["largest_draw_bytes"] == {"sent": [0, 0], "received": [0, 0]}
