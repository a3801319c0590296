"""Process groups live as long as a plan uses them, and every group has the job's timeout.

A re-drawn SDP plan (``parallelism.resample_every``) has new holder sets: their groups are created and
the groups of holder sets the new plan no longer uses are destroyed (``GroupSet.redraw``), so the live
groups are those of the current plan, not of every plan drawn so far (each one an NCCL communicator
with device memory). Counted from torch's own registry (``sdp.metrics.groups.process_groups``), on
spawned gloo ranks driving ``SDPStrategy._redraw`` as the trainer does.

Every group, holder sets and DeviceMesh dimensions (FSDP/HSDP, pipeline) alike, gets the default
group's timeout (``cluster.timeout_s``) instead of torch's per-backend default (30 minutes on gloo, 10
on NCCL); and the strategies' group counts are those ``sdp-plan`` predicts.
"""

from __future__ import annotations

import pytest

from tests.helpers import config_dict, core_cases, make_strategy, spawn

MLP = ["model=mlp", "dataset=digits", "model.hidden=64", "model.depth=6", "train.batch_size=8"]


def _live_groups_after_redraws(rank: int, world: int, config: dict) -> list[dict]:
    from sdp.metrics.groups import process_groups
    from sdp.subnet.holder_groups import group_rank_sets, with_refresh_sets

    strategy, _, _ = make_strategy(config, rank, world)
    out = []
    for draw in range(1, 5):
        strategy._redraw(draw=draw)
        plan_sets = group_rank_sets(world_size=world, holder_sets={p.holders for p in strategy.pieces},
                                    refresh=with_refresh_sets(mode=strategy.mode))
        out.append({"plan": sorted(plan_sets), "held": sorted(strategy.groups.groups),
                    "live": process_groups()["count"], "mine": 1 + sum(rank in s for s in plan_sets)})
    return out


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("par", core_cases(["parallelism=sdp", "parallelism=sdp_neuron_bwd"], ids=["block-fwd", "neuron-bwd"],
                                           core=set()))  # ~12 s each (4 spawned ranks)
def test_redraw_destroys_the_groups_the_new_plan_does_not_use(par: str) -> None:
    world = 4
    got = spawn(_live_groups_after_redraws, world=world,
                args=(config_dict(MLP + [par, f"cluster.world_size={world}"]),))
    ever = {tuple(s) for r in got for d in r for s in d["plan"]}
    assert len(ever) > len(got[0][-1]["plan"]), f"the re-draws changed no holder set: nothing tested ({ever})"
    for rank, draws in enumerate(got):
        for i, d in enumerate(draws):
            assert d["held"] == d["plan"], f"rank {rank} draw {i + 1}: groups held {d['held']} != the plan's {d['plan']}"
            assert d["live"] == d["mine"], (f"rank {rank} draw {i + 1}: {d['live']} live process groups in torch, "
                                            f"the plan uses {d['mine']} (default included)")


def _timeouts(rank: int, world: int, config: dict) -> dict:
    import torch
    from torch.distributed.distributed_c10d import _get_default_group

    from sdp.metrics.groups import process_groups

    strategy, _, _ = make_strategy(config, rank, world)
    timeout = lambda g: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # noqa: E731
    if hasattr(strategy, "mesh"):
        groups = [strategy.mesh.get_group(d) for d in range(strategy.mesh.ndim)]
    else:
        groups = [g for s, g in strategy.groups.groups.items() if rank in s]
    return {"world": timeout(_get_default_group()), "count": process_groups()["count"],
            "groups": [(g.size(), timeout(g)) for g in groups]}


# (id, overrides): HSDP's 2-D mesh, pipeline with two replicas (a 2-D mesh), SDP's holder sets
MESHES = [("hsdp", ["parallelism=fsdp", "parallelism.replicate=2"]),
          ("pipeline-dp2", ["parallelism=pipeline", "parallelism.dp=2", "parallelism.microbatches=2"]),
          ("sdp-holder-sets", ["parallelism=sdp_neuron_bwd"])]


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "sel"), core_cases(MESHES, ids=[m[0] for m in MESHES], core=set()))
def test_every_group_has_the_jobs_timeout_and_the_planned_count(case: str, sel: list[str]) -> None:
    from sdp.planning.planner import predict
    from tests.helpers import compose

    world = 4
    overrides = MLP + sel + [f"cluster.world_size={world}"]
    got = spawn(_timeouts, world=world, args=(config_dict(overrides),))
    for rank, g in enumerate(got):
        assert any(size < world for size, _ in g["groups"]), f"{case}: rank {rank} has no sub-group: nothing tested"
        assert all(t == g["world"] for _, t in g["groups"]), (
            f"{case}: rank {rank} group timeouts {g['groups']} (size, s), the default group's is {g['world']} s")
    planned = predict(compose(overrides))["memory"]["per_rank"]
    assert [p["process_groups"] for p in planned] == [g["count"] for g in got], \
        f"{case}: sdp-plan's groups per rank {[p['process_groups'] for p in planned]}, measured {[g['count'] for g in got]}"
