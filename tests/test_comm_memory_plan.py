"""Communicator memory: NCCL groups share the default communicator's resources, and ``sdp-plan``
predicts each rank's groups and their device memory for every strategy.

- ``sdp.core.distctx.comm_options``: on NCCL the options every group is made with (the default group
  first) carry ``config.split_share = 1``, without which a split communicator gets buffers of its own;
  gloo takes none. Built without a GPU (torch's NCCL options are plain objects).
- ``sdp-plan`` at 8 ranks on the meta device: per rank the process groups (the default one included)
  and ``groups x cluster.comm_bytes_per_group`` bytes, printed beside the allocator figures, for the
  DDP family (one group), FSDP/HSDP and pipeline (their mesh groups) and SDP (one per holder set).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from sdp.errors import ConfigError
from tests.helpers import compose

MLP = ["experiment=smoke", "cluster.world_size=8", "train.batch_size=8", "model.depth=8", "model.dim=32", "model.hidden=64"]
# (id, overrides, the groups every rank is in, or None where they depend on the plan (SDP: > 1))
STRATEGIES = [
    ("ddp", ["parallelism=ddp"], 1),
    ("ddp_ac", ["parallelism=ddp_ac"], 1),
    ("ddp_layerdrop", ["parallelism=ddp_layerdrop"], 1),
    ("ddp_stochastic_depth", ["parallelism=ddp_stochastic_depth"], 1),
    ("powersgd", ["parallelism=powersgd"], 1),
    ("fsdp", ["parallelism=fsdp"], 1),
    ("hsdp", ["parallelism=fsdp", "parallelism.replicate=2"], 3),
    ("pipeline", ["parallelism=pipeline", "parallelism.microbatches=8"], 2),  # (dp=1 x pp=8): a 1-rank dp group
    ("pipeline-dp2", ["parallelism=pipeline", "parallelism.dp=2"], 3),
    ("local_sgd", ["parallelism=diloco"], 1),
    ("sdp", ["parallelism=sdp"], None),
    ("sdp_neuron_bwd", ["parallelism=sdp_neuron_bwd"], None),
]


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no NCCL")
def test_nccl_groups_are_made_with_split_share_and_the_jobs_timeout() -> None:
    from torch.distributed import ProcessGroupNCCL

    from sdp.core.distctx import comm_options

    options = comm_options(backend="nccl", timeout=timedelta(seconds=42))
    assert isinstance(options, ProcessGroupNCCL.Options)
    assert options.config.split_share == 1, f"split_share={options.config.split_share}: split groups get buffers of their own"
    assert options._timeout == timedelta(seconds=42), options._timeout
    assert comm_options(backend="nccl", timeout=timedelta(seconds=42)) is not options, "torch writes into the options: one per group"


def test_gloo_groups_take_no_backend_options() -> None:
    from sdp.core.distctx import comm_options

    assert comm_options(backend="gloo", timeout=timedelta(seconds=42)) is None


@pytest.mark.parametrize(("case", "sel", "groups"), STRATEGIES, ids=[s[0] for s in STRATEGIES])
def test_sdp_plan_prints_each_ranks_groups_and_communicator_memory_at_8_ranks(case: str, sel: list[str],
                                                                               groups: int | None) -> None:
    from sdp.planning.planner import format_plan, predict

    cfg = compose([*MLP, *sel])
    per_group = int(cfg.cluster.comm_bytes_per_group)
    plan = predict(cfg)
    mem = plan["memory"]["per_rank"]
    assert len(mem) == 8
    counts = [m["process_groups"] for m in mem]
    if groups is None:
        assert all(c > 1 for c in counts), f"{case}: SDP's holder sets give each rank groups of its own, got {counts}"
    else:
        assert counts == [groups] * 8, f"{case}: groups per rank {counts}, expected {groups}"
    assert [m["communicator_bytes"] for m in mem] == [c * per_group for c in counts]
    text = format_plan(plan)
    header = next(line for line in text.splitlines() if line.startswith("| rank |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert "groups" in cols and "NCCL comm. MiB" in cols, header
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ") and "rank" not in line]
    assert [int(r[cols.index("groups")]) for r in rows] == counts, text
    assert [float(r[cols.index("NCCL comm. MiB")]) for r in rows] == [c * per_group / 2**20 for c in counts], text


def test_comm_bytes_per_group_is_a_checked_config_key() -> None:
    from sdp.planning.planner import predict

    plan = predict(compose([*MLP, "parallelism=ddp", "cluster.comm_bytes_per_group=1048576"]))
    assert [m["communicator_bytes"] for m in plan["memory"]["per_rank"]] == [1048576] * 8
    with pytest.raises(ConfigError, match="cluster.comm_bytes_per_group"):
        predict(compose([*MLP, "parallelism=ddp", "cluster.comm_bytes_per_group=-1"]))


def _printed(text: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of format_plan's table."""
    header = next(line for line in text.splitlines() if line.startswith("| rank |"))
    rows = [line for line in text.splitlines() if line.startswith("| ") and line != header]
    return [c.strip() for c in header.strip("|").split("|")], [[c.strip() for c in r.strip("|").split("|")] for r in rows]


@pytest.mark.parametrize(("sel", "peaks"), [
    (["parallelism=ddp_stochastic_depth"], ("setup", "train", "eval")),
    (["parallelism=sdp", "parallelism.resample_every=2"], ("setup", "train", "redraw", "eval")),
], ids=["stochastic_depth", "sdp_redraw"])
def test_sdp_plan_prints_every_peak_it_predicts_and_only_its_own_note(sel: list[str], peaks: tuple[str, ...]) -> None:
    """The printed table shows each peak the JSON holds, with the JSON's value per rank, and the notes say
    the caveat of the planned strategy alone (stochastic depth's, not under SDP)."""
    from sdp.parallel import STRATEGIES
    from sdp.planning.planner import format_plan, predict

    names = {"setup": "set-up peak MiB", "train": "train peak MiB", "redraw": "re-draw peak MiB", "eval": "eval peak MiB"}
    plan = predict(compose([*MLP, "cluster.world_size=4", *sel]))
    mem = plan["memory"]["per_rank"]
    held = [f"{p}_peak_bytes" for p in names if all(f"{p}_peak_bytes" in m for m in mem)]
    assert held == [f"{p}_peak_bytes" for p in peaks], (held, mem[0].keys())
    text = format_plan(plan)
    cols, rows = _printed(text)
    for key, name in ((f"{p}_peak_bytes", n) for p, n in names.items()):
        if key in held:
            assert [float(r[cols.index(name)]) for r in rows] == [round(m[key] / 2**20, 2) for m in mem], (name, text)
        else:
            assert name not in cols, (name, cols)
    note = STRATEGIES.get("ddp_stochastic_depth").plan_note
    assert note and (note in text) == (sel[0] == "parallelism=ddp_stochastic_depth"), text
    assert (note in plan["notes"][0]) == (note in text), plan["notes"]
