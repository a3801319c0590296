"""SDP in the driver: its plan from the config, and what ``sdp-plan`` predicts for it.

Apart from :mod:`sdp.parallel.sdp` (the strategy that runs on the ranks) so that the planner-side
modules it calls (:mod:`sdp.plan_peaks` builds the same plan) need not import the strategy. Every
prediction reuses the strategy's own code: :func:`plan_for`, :mod:`sdp.subnet.masking` applied on the
meta device, the owner-set buckets of :class:`sdp.subnet.sync.OwnerSetSync`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from omegaconf import DictConfig

from sdp.errors import ConfigError, unit_interval
from sdp.metrics.comm import CommCounter
from sdp.models.base import SDPModel
from sdp.plan_entries import Entry, Record, activations, nbytes, optim_bytes, rank_entry
from sdp.registry import build
from sdp.subnet import masking as M
from sdp.subnet.frontier import format_frontier, frontier
from sdp.subnet.plan import Plan, PlanError, build_plan, num_holders
from sdp.subnet.sync import GroupSet, OwnerSetSync, predicted_process_groups

BALANCE_KEYS = ("params", "flops", "activations")
MASKINGS = ("forward", "backward")
LABELS = {("block", "forward"): "B-SDP", ("block", "backward"): "B_β-SDP",  # the paper's names
          ("neuron", "forward"): "N-SDP", ("neuron", "backward"): "N_β-SDP"}


def realised_coverage(*, coverage: object, world_size: int) -> float:
    """The one check of ``parallelism.coverage`` (a number in (0, 1] that gives k >= 1 holders per unit)
    and what a worker computes of each unit on average: k / n, k = round(C x n)
    (:func:`sdp.subnet.plan.num_holders`, the rule the plan is built with; C = 0.3 on 4 workers is 0.25)."""
    unit_interval("parallelism.coverage", coverage)
    try:
        return num_holders(coverage=float(coverage), world_size=world_size) / world_size  # type: ignore[arg-type]
    except PlanError as exc:
        raise ConfigError(str(exc)) from None


def compute_fraction(*, masked: float, coverage: float, masking: str) -> float:
    """Fraction of the full model's training FLOPs computed on average by one worker. Under forward
    masking a worker runs the shared parts (stem, head, projection shortcuts) in full and a fraction C
    of every masked unit (block level: C of the blocks; neuron level: C of each split hidden width,
    which scales the sub-branch that runs it by C): ``r = (1 - masked) + C masked``, ``masked`` the
    share of the forward FLOPs narrowed at the plan's level (:func:`sdp.metrics.flops.masked_fraction`:
    block level the units' residual branches, neuron level the split sub-branches only). Under backward
    masking the forward and the input-gradient half of backward are full and only the weight-gradient
    third is masked:
    ``r = (2 + r_forward) / 3``. Only what ``torch.utils.flop_counter`` counts enters."""
    forward = (1.0 - masked) + coverage * masked
    if masking == "forward":
        return forward
    if masking == "backward":
        return (2.0 + forward) / 3.0
    raise ValueError(f"parallelism.masking={masking!r} not in {MASKINGS}")


def plan_for(*, model: SDPModel, cfg: DictConfig, world_size: int, draw: int = 0) -> Plan:
    """The plan of ``cfg`` (the parallelism node) for ``model``; same on every rank and in the driver."""
    return build_plan(
        model=model, world_size=world_size, coverage=float(cfg.coverage), level=str(cfg.level),
        assignment=str(cfg.assignment), groups=int(cfg.groups), drop_downsample=bool(cfg.drop_downsample),
        seed=int(cfg.plan_seed), draw=draw, balance=tuple(float(cfg.balance[r]) for r in BALANCE_KEYS),
        max_holder_sets=cfg.get("max_holder_sets"),  # absent from configs written before the key
    )


def predict(*, cfg: DictConfig, model: SDPModel, world: int, facts: dict[str, Any]) -> list[Entry]:
    """SDP: this rank's masked subnetwork (the strategy's own plan and masking applied on meta),
    owner-set gradient buckets and refresh broadcasts from :class:`sdp.subnet.sync.OwnerSetSync`."""
    pc = cfg.parallelism
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    plan = plan_for(model=model, cfg=pc, world_size=world)
    facts["plan"] = plan.summary()  # as summary.json["plan"]: units -> holders, holder sets, connectivity
    pieces = M.pieces(model, plan)
    # the groups SDPStrategy creates (the same holder sets, the same rule): summary.json's process_groups
    facts["process_groups"] = predicted_process_groups(world_size=world, holder_sets={p.holders for p in pieces},
                                                       refresh=mode == "backward")
    groups = GroupSet(world_size=world, holder_sets=(), refresh=False)  # no process group is created
    out = []
    for r, mine, layout, trained in M.rank_subnetworks(model, plan, mode=mode, all_pieces=pieces):
        sync = OwnerSetSync(rank=r, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(), mode=mode,
                            bucket_cap_mb=float(pc.bucket_cap_mb))
        records: list[Record] = [("all_reduce", sum(p.nbytes for p in items), len(h)) for h, items in sync.grad_buckets]
        records += [("broadcast", sum(p.nbytes for p in items) if r == min(h) else 0, len(groups.refresh_set(h)))
                    for h, items in sync.refresh_buckets]
        acts = activations(mine, mine.example_input(int(cfg.train.batch_size)).to("meta"))
        out.append(rank_entry(rank=r, params=nbytes(mine.parameters()), grads=nbytes(trained),
                              optim=optim_bytes(held=nbytes(trained), tensors=len(trained), optim=cfg.optim), acts=acts, records=records))
    return out


def plan_frontier(cfg: DictConfig) -> dict[str, Any]:
    """The SDP plan's floor and Pareto frontier over every assignment (:mod:`sdp.subnet.frontier`)."""
    if str(cfg.parallelism.masking) != "forward":
        raise ValueError(f"plan.frontier=true scores SDP with forward masking (backward masking keeps every parameter "
                         f"and activation on every worker), got parallelism.name={cfg.parallelism.name!r} "
                         f"masking={cfg.parallelism.get('masking')!r}")
    with torch.device("meta"):
        model = build(cfg.model)
    world = int(cfg.cluster.world_size)
    plan = plan_for(model=model, cfg=cfg.parallelism, world_size=world)
    result = frontier(plan=plan, full_activation_bytes=activations(model, model.example_input(2).to("meta")) / 2)
    title = (f"model={cfg.model.get('name', '')} world_size={world} coverage={cfg.parallelism.coverage} "
             f"level={plan.level} balance={dict(cfg.parallelism.balance)}")
    return {"assignments": result["assignments"], "connected_assignments": result["connected_assignments"],
            "floor": asdict(result["floor"]), "plan": asdict(result["plan"]),
            "frontier": [asdict(p) for p in result["frontier"]],
            "connected_frontier": [asdict(p) for p in result["connected_frontier"]],
            "text": format_frontier(result, title=title)}


def format_plan_summary(summary: dict[str, Any]) -> str:
    """The SDP plan in a few lines: who holds what, how many holder sets, whether workers are connected."""
    sets = " ".join("{" + ",".join(map(str, h)) + "}" for h in summary["plan"].values())
    return "\n".join([
        f"SDP plan: level={summary['level']} assignment={summary['assignment']} k={summary['k']} of "
        f"{summary['world_size']} workers; {summary['units']} units; {summary['holder_sets']} distinct holder sets; "
        f"overlap graph {'connected' if summary['connected'] else 'DISCONNECTED: ' + str(summary['components'])}; "
        f"{summary['unit_pairs_trained_together']:.0%} of unit pairs trained together by some worker",
        f"holders (unit 0, 1, ...): {sets}"])
