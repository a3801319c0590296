"""SDP in the driver: its plan from the config, and what ``sdp-plan`` predicts for it.

Apart from :mod:`sdp.parallel.sdp` (the strategy that runs on the ranks) so that the planner-side
modules it calls (:mod:`sdp.parallel.sdp_peaks`, on the same plan) need not import the strategy. Every
prediction reuses the strategy's own code: :func:`plan_for`, :mod:`sdp.subnet.masking` applied on the
meta device, the owner-set buckets of :class:`sdp.subnet.sync.OwnerSetSync`, and with
``resample_every`` the re-draw itself (:mod:`sdp.subnet.redraw`, rehearsed on meta:
:mod:`sdp.parallel.sdp_redraw_plan`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Iterable, Iterator

from omegaconf import DictConfig

from sdp.metrics.comm import CommCounter
from sdp.metrics.flops import BlockShare, forward_fraction
from sdp.models import gates as G
from sdp.models.base import SDPModel
from sdp.parallel.job import JobFacts
from sdp.parallel.plan_entries import Entry, Record, activations, measured_mean, measured_steps, nbytes, optim_bytes, rank_entry
from sdp.registry import build
from sdp.subnet import masking as M
from sdp.subnet.assemble import split_blocks
from sdp.parallel.sdp_redraw_plan import state_template
from sdp.subnet.moves import moves, traffic
from sdp.subnet.frontier import format_frontier, frontier
from sdp.subnet.plan import Plan, build_plan, measure_block_costs
from sdp.subnet.holder_groups import GroupSet, predicted_process_groups, refresh_set, with_refresh_sets
from sdp.subnet.sync import OwnerSetSync
from sdp.subnet.world_sync import WorldSync, average_of

BALANCE_KEYS = ("params", "flops", "activations")
MASKINGS = ("forward", "backward")
LABELS = {("block", "forward"): "B-SDP", ("block", "backward"): "B_β-SDP",  # the paper's names
          ("neuron", "forward"): "N-SDP", ("neuron", "backward"): "N_β-SDP"}


def compute_fraction(*, forward: float, masking: str) -> float:
    """Fraction of the full model's training FLOPs computed on average by one worker that computes a fraction
    ``forward`` of the forward FLOPs (:func:`sdp.metrics.flops.forward_fraction`). Under forward masking the
    backward follows the forward: ``r = forward``. Under backward masking the forward and the input-gradient
    half of backward are full and only the weight-gradient third is masked: ``r = (2 + forward) / 3``. Only
    what ``torch.utils.flop_counter`` counts enters."""
    if masking == "forward":
        return forward
    if masking == "backward":
        return (2.0 + forward) / 3.0
    raise ValueError(f"parallelism.masking={masking!r} not in {MASKINGS}")


def plan_fraction(*, plan: Plan | None, shares: dict[int, BlockShare], masking: str) -> float:
    """SDP's fraction of DDP's training FLOPs for ``plan`` (the driver's, draw 0): each block the plan
    declares units in is weighed by its holders (:meth:`Plan.block_coverage`: a block's residual branch by
    the workers that hold a unit of it, its split part at neuron level by each group's holders); a block that
    is no unit (``drop_downsample=false``: a downsampling block shared whole) and the stem, head and
    shortcuts run in full on every worker. A re-draw keeps it: every rule keeps each unit's k holders and,
    per block, the number of workers running it (a permutation of workers, of same-cost units, or windows
    that give every worker a group of every block)."""
    assert plan is not None, "SDP's FLOP fraction is its plan's: the budget hands it the driver's plan"
    return compute_fraction(forward=forward_fraction(shares=shares, computed=plan.block_coverage()), masking=masking)


def plan_for(*, model: SDPModel, cfg: DictConfig, world_size: int, draw: int = 0,
             block_costs: dict[int, tuple[float, float]] | None = None,
             base_holders: tuple[tuple[int, ...], ...] | None = None) -> Plan:
    """The plan of ``cfg`` (the parallelism node) for ``model``; same on every rank and in the driver.
    ``block_costs``, ``base_holders``: what :func:`next_plan` already knows (:func:`sdp.subnet.plan.build_plan`)."""
    return build_plan(
        model=model, world_size=world_size, coverage=float(cfg.coverage), level=str(cfg.level),
        assignment=str(cfg.assignment), groups=int(cfg.groups), drop_downsample=bool(cfg.drop_downsample),
        seed=int(cfg.plan_seed), draw=draw, balance=tuple(float(cfg.balance[r]) for r in BALANCE_KEYS),
        max_holder_sets=cfg.get("max_holder_sets"),  # absent from configs written before the key
        redraw=str(cfg.get("redraw", "relabel")),  # likewise
        block_costs=block_costs, base_holders=base_holders,
    )


def next_plan(*, model: SDPModel, cfg: DictConfig, world_size: int, draw: int, first: Plan,
              costs: dict[int, tuple[float, float]] | None) -> tuple[Plan, dict[int, tuple[float, float]]]:
    """Draw ``draw`` of a running job (a re-draw on a rank): the plan :func:`plan_for` builds, without redoing
    its two costly steps every draw: the model's block costs (``costs``: measured here the first time, one meta
    forward per block, then returned for the next draw) and draw 0's assignment (``first``, the driver's plan:
    the shuffle and capped rules start from its holders; the balanced search is most of a shuffle's time)."""
    assert first.draw == 0, f"first must be draw 0's plan, got draw {first.draw}"
    costs = costs if costs is not None else measure_block_costs(model)
    return plan_for(model=model, cfg=cfg, world_size=world_size, draw=draw, block_costs=costs, base_holders=first.holders), costs


def draw_at(*, step: int, every: int | None) -> int:
    """The draw a run trains 0-based step ``step`` on (``every``: ``parallelism.resample_every``): a re-draw before
    every step d R > 0 (``SDPStrategy._before_step``), so draw ``step // R``; without re-draws draw 0."""
    return step // int(every) if every else 0


def run_plans(*, model: SDPModel, cfg: DictConfig, first: Plan, draws: Iterable[int],
              costs: dict[int, tuple[float, float]] | None = None) -> Iterator[Plan]:
    """The plans of ``draws`` (from :func:`draw_at`), each as the ranks make it: draw 0 is ``first`` (the driver's),
    later ones :func:`next_plan`'s (``costs``: the model's block costs, measured here once when not given)."""
    for draw in draws:
        if draw == 0:
            yield first
        else:
            plan, costs = next_plan(model=model, cfg=cfg, world_size=first.world_size, draw=draw, first=first, costs=costs)
            yield plan


def plan_lists(plan: Plan) -> dict[str, Any]:
    """What identifies a plan, as plain types (``weights_only``-loadable, comparable with ``==``)."""
    return {"world_size": plan.world_size, "k": plan.k, "level": plan.level, "groups": plan.groups, "draw": plan.draw,
            "units": [[u.block, -1 if u.group is None else u.group] for u in plan.units],
            "holders": [list(h) for h in plan.holders]}


def predict(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan, facts: dict[str, Any]) -> list[Entry]:
    """SDP: this rank's masked subnetwork (the driver's ``plan`` and the strategy's masking applied on meta),
    owner-set gradient buckets and refresh broadcasts from :class:`sdp.subnet.sync.OwnerSetSync`
    (``cfg``: the ``parallelism`` node). With ``consolidate`` the comm fields are the mean over the measured steps
    of both phases, as summary.json's (:func:`consolidation_steps`: each phase's step in ``facts["consolidate"]``)."""
    assert plan is not None, "SDP's prediction reads the driver's plan (sdp.driver.preflight), got none"
    pc, world = cfg, plan.world_size
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    facts["plan"] = plan.summary()  # as summary.json["plan"]: units -> holders, holder sets, connectivity
    if (redraw := predict_redraw(cfg=pc, optimizer=job.optimizer, model=model, world=world, plan=plan)) is not None:
        facts["redraw"] = redraw  # the bytes of the first re-draw; its peaks: sdp.parallel.plan_peaks (redraw_peak_bytes)
    pieces = M.pieces(model, plan)
    # the groups SDPStrategy creates (the same holder sets, the same rule): summary.json's process_groups
    facts["process_groups"] = predicted_process_groups(world_size=world, holder_sets={p.holders for p in pieces},
                                                       refresh=with_refresh_sets(mode=mode))
    later = consolidation_steps(cfg=pc, job=job, model=model, plan=plan, pieces=pieces, facts=facts)
    if (cal := calibration(cfg=pc, model=model, plan=plan, steps=job.steps)) is not None:
        last = M.pieces(model, cal["plan"])
        facts["calibrate"] = {"steps": cal["steps"], "gates": cal["gates"], "gate_bytes_per_step": cal["gate_bytes"],
                              "per_rank": [{"rank": r, **fill_moves(pieces=last, rank=r, world=world)} for r in range(world)]}
    out = []
    for r, mine, layout, trained in M.rank_subnetworks(model, plan, mode=mode, all_pieces=pieces):
        records = step_records(pieces=pieces, layout=layout, rank=r, world=world, mode=mode, bucket_cap_mb=float(pc.bucket_cap_mb))
        weights = None
        if later is not None:  # summary.json's per-step fields: the mean over both phases' measured steps
            (n1, n2), step = later["measured_steps"], later["per_rank"][r]
            step.update(train_bytes_per_step=float(sum(b for _, b, _ in records)), train_collectives_per_step=len(records))
            records, weights = measured_mean([(n1, records), (n2, step.pop("records"))])
        acts = activations(mine, mine.example_input(job.batch_size).to("meta"), job=job)
        out.append(rank_entry(rank=r, params=nbytes(mine.parameters()), grads=nbytes(trained),
                              optim=optim_bytes(held=nbytes(trained), tensors=len(trained), optimizer=job.optimizer),
                              acts=acts, records=records, weights=weights))
    return out


def step_records(*, pieces: list[M.Piece], layout: dict[str, M.Local], rank: int, world: int, mode: str,
                 bucket_cap_mb: float, average: str = "holders") -> list[Record]:
    """One training step's records of ``rank`` (``layout``: its subnetwork masked by ``mode``): the owner-set
    gradient all-reduces and, under backward masking, the refresh broadcasts of :class:`OwnerSetSync`, whose
    source records the payload and each receiver 0, as the ranks record them (``average="world"``: consolidation's
    :class:`~sdp.subnet.world_sync.WorldSync`, every block's all-reduce over the world)."""
    groups = GroupSet(world_size=world, holder_sets=(), refresh=False)  # no process group is created
    sync = (WorldSync(rank=rank, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(), bucket_cap_mb=bucket_cap_mb)
            if average == "world" else OwnerSetSync(rank=rank, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(),
                                                    mode=mode, bucket_cap_mb=bucket_cap_mb))
    records: list[Record] = [("all_reduce", sum(p.nbytes for p in items), len(h)) for h, items in sync.grad_buckets]
    return records + [("broadcast", sum(p.nbytes for p in items) if rank == min(h) else 0, len(groups.refresh_set(h)))
                      for h, items in sync.refresh_buckets]


def fill_moves(*, pieces: list[M.Piece], rank: int, world: int) -> dict[str, int]:
    """What :func:`sdp.subnet.assemble.fill` under forward masking moves to ``rank`` (the consolidation switch,
    calibration's assembly): every piece some rank lacks is broadcast from its lowest holder over its refresh set
    (that holder and the non-holders: :func:`~sdp.subnet.holder_groups.refresh_set`), so ``rank`` receives
    (``received_bytes``) exactly the pieces it does not hold (``lacked_bytes``: the two are equal, no other holder is
    sent values it holds) and sends those it is the lowest holder of. Both keys stay (plans already written read them):
    when fill broadcast over the whole world, a holder other than the lowest received its own values again."""
    lacking = [p for p in pieces if len(p.holders) < world]
    return {"received_bytes": sum(p.nbytes for p in lacking if rank in refresh_set(p.holders, n=world) and rank != min(p.holders)),
            "lacked_bytes": sum(p.nbytes for p in lacking if rank not in p.holders),
            "sent_bytes": sum(p.nbytes for p in lacking if rank == min(p.holders))}


def calibration(*, cfg: DictConfig, model: SDPModel, plan: Plan, steps: int) -> dict[str, Any] | None:
    """Assembly calibration (``parallelism.calibrate_steps``; else None) after the last of ``steps`` steps: its step
    count, the plan it assembles (that step's draw), the unit blocks it gates, the gate count and the bytes each
    calibration step all-reduces over the world (:func:`sdp.parallel.sdp_calibrate.fit`: the gates' float32
    gradients and the loss)."""
    count = int(cfg.get("calibrate_steps") or 0)
    if not count:
        return None
    last = next(run_plans(model=model, cfg=cfg, first=plan, draws=[draw_at(step=steps - 1, every=cfg.get("resample_every"))]))
    blocks = sorted(split_blocks(last))
    gates = len(G.layout(model, blocks=blocks))
    return {"steps": count, "plan": last, "blocks": blocks, "gates": gates, "gate_bytes": (gates + 1) * 4}


def consolidation_steps(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan, pieces: list[M.Piece],
                        facts: dict[str, Any]) -> dict[str, Any] | None:
    """``parallelism.consolidate`` (else None): per rank one consolidation step's records (``records``, the
    backward-masked full model of the same plan: :func:`sdp.parallel.sdp_consolidate.widen`), what the switch moves
    (:func:`fill_moves`), and how many steps of each phase the run measures (``job``: as the budget resolved it, as
    ``sdp-plan`` hands it; a job without its phases: None, phase 1's step alone); kept in ``facts["consolidate"]``
    (the records taken out by :func:`predict`)."""
    if cfg.get("consolidate") is None or len(job.phase_steps) != 2:  # a job whose budget is not resolved: phase 1's
        return None
    world, out = plan.world_size, []
    for r, _, layout, _ in M.rank_subnetworks(model, plan, mode="backward", all_pieces=pieces):
        records = step_records(pieces=pieces, layout=layout, rank=r, world=world, mode="backward", bucket_cap_mb=float(cfg.bucket_cap_mb),
                               average=average_of(cfg))
        out.append({"rank": r, "records": records, "consolidate_bytes_per_step": float(sum(b for _, b, _ in records)),
                    "consolidate_collectives_per_step": len(records), "switch": fill_moves(pieces=pieces, rank=r, world=world)})
    facts["consolidate"] = {"start_step": job.phase_steps[0], "phase_steps": list(job.phase_steps),
                            "measured_steps": measured_steps(phase_steps=job.phase_steps, warmup=job.warmup_steps),
                            "per_rank": out}
    return facts["consolidate"]


def plan_frontier(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan) -> dict[str, Any]:
    """The floor and Pareto frontier of ``plan`` (the driver's) over every assignment (:mod:`sdp.subnet.frontier`;
    ``cfg``: the ``parallelism`` node)."""
    if str(cfg.masking) != "forward":
        raise ValueError(f"plan.frontier=true scores SDP with forward masking (backward masking keeps every parameter "
                         f"and activation on every worker), got parallelism.name={cfg.name!r} "
                         f"masking={cfg.get('masking')!r}")
    world = plan.world_size
    # on the units' scale: their activation costs come from a plain meta forward (sdp.subnet.units), not the job's device
    result = frontier(plan=plan, full_activation_bytes=activations(model, model.example_input(2).to("meta"), job=None) / 2)
    title = (f"model={job.model_name} world_size={world} coverage={cfg.coverage} "
             f"level={plan.level} balance={dict(cfg.balance)}")
    return {"assignments": result["assignments"], "connected_assignments": result["connected_assignments"],
            "floor": asdict(result["floor"]), "plan": asdict(result["plan"]),
            "frontier": [asdict(p) for p in result["frontier"]],
            "connected_frontier": [asdict(p) for p in result["connected_frontier"]],
            "text": format_frontier(result, title=title)}


def format_redraw_rule(summary: dict[str, Any]) -> str:
    """How re-draws choose the plan (``parallelism.redraw``) and, for rolling, what its windows achieve."""
    mode, info = summary.get("redraw", "relabel"), summary.get("redraw_info") or {}
    if mode == "rolling":
        bases = "; ".join(f"{f['units']} units: S={{{','.join(map(str, f['base']))}}}, g={f['g']}"
                          f"{'' if f['difference_cover'] else ' (no difference cover exists)'}" for f in info["families"])
        return (f"re-draws: rolling (FedRolex; replaces assignment={summary['assignment']}): worker w holds S + w*g + draw; "
                f"{bases}; {info['pair_coverage_over_draws']:.0%} of unit pairs trained together over the draws; "
                f"every worker holds every unit within {info['draws_to_hold_every_unit']} draws")
    if mode == "shuffle":
        return (f"re-draws: shuffle (ResIST-style) of {info.get('interchangeable_units', 0)} interchangeable units "
                f"(block classes {info.get('interchangeable_blocks', [])}), then a worker relabelling")
    return "re-draws: relabel (a seeded permutation of the workers; random assignment: fresh subsets)"


def format_plan_summary(summary: dict[str, Any]) -> str:
    """The SDP plan in a few lines: who holds what, how many holder sets, whether workers are connected,
    how re-draws choose the plan."""
    sets = " ".join("{" + ",".join(map(str, h)) + "}" for h in summary["plan"].values())
    return "\n".join([
        f"SDP plan: level={summary['level']} assignment={summary['assignment']} k={summary['k']} of "
        f"{summary['world_size']} workers; {summary['units']} units; {summary['holder_sets']} distinct holder sets; "
        f"overlap graph {'connected' if summary['connected'] else 'DISCONNECTED: ' + str(summary['components'])}; "
        f"{summary['unit_pairs_trained_together']:.0%} of unit pairs trained together by some worker",
        f"holders (unit 0, 1, ...): {sets}", format_redraw_rule(summary)])


def predict_redraw(*, cfg: DictConfig, optimizer: DictConfig, model: SDPModel, world: int,
                   plan: Plan | None = None) -> dict[str, Any] | None:
    """``sdp-plan``'s re-draw prediction (``parallelism.resample_every`` set in ``cfg``, the ``parallelism`` node;
    else None): the bytes every rank sends and receives at the first re-draw (draw 0, ``plan`` when the driver
    has it, -> draw 1: :func:`sdp.subnet.moves.traffic` on the two plans, each moving piece's state of
    ``optimizer`` (the ``optim.optimizer`` node) as :func:`state_template` describes it)."""
    pc = cfg
    if not pc.get("resample_every"):
        return None
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    old = M.pieces(model, plan if plan is not None else plan_for(model=model, cfg=pc, world_size=world))
    new = M.pieces(model, plan_for(model=model, cfg=pc, world_size=world, draw=1))
    values, carried = moves(old=old, new=new, mode=mode, world=world)
    full = dict(model.named_parameters()) | dict(model.named_buffers())
    template = state_template(optimizer_factory=build(optimizer), dtype=next(model.parameters()).dtype)
    table = traffic(values=values, state=carried, pieces=new, descs={i: template for i in carried},
                    shapes={k: t.shape for k, t in full.items()}, world=world)
    return {"predicted": "the first re-draw (draw 0 -> 1)",
            "every": int(pc.resample_every), "per_rank": [{"rank": r, **t} for r, t in enumerate(table)]}
