"""SDP's traffic outside the training step, as ``sdp-plan`` predicts it: evaluating the assembled model and the
workers' own subnetworks (comm phase "eval"), re-drawing the plan ("resample"), the consolidation switch
("consolidate") and assembly calibration ("calibrate"); and what each rank writes in a checkpoint (:func:`checkpoint_tensors`).

Why a module of its own: the numbers come from the code the ranks run, asked dry, not from a second formula.
Assembly and the ``eval.bn=average`` statistics call :func:`sdp.subnet.assemble.average_statistics` (the very
function :func:`~sdp.subnet.assemble.fill` and :func:`~sdp.subnet.assemble.own_evaluated` call) with a reduce
that records and moves nothing; the broadcasts follow :func:`~sdp.subnet.assemble.fill`'s rule on the same
pieces (:func:`sdp.subnet.masking.pieces`); a re-draw is :func:`sdp.subnet.redraw.redraw` itself, rehearsed on the
meta device per rank with :class:`sdp.parallel.sdp_redraw_plan.DryWire`, which records through the ranks'
own wire code. ``tests/test_traffic_plan.py`` holds the predictions to what 4-rank runs measure, byte for byte.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from sdp.models.base import SDPModel
from sdp.parallel.job import JobFacts
from sdp.parallel.sdp_plan import calibration, draw_at, run_plans
from sdp.parallel.sdp_redraw_plan import rehearse_redraw, state_template
from sdp.parallel.plan_entries import optimizer_state
from sdp.parallel.plan_entries import EvalTraffic, Record
from sdp.registry import build
from sdp.subnet import masking as M
from sdp.subnet.assemble import average_statistics, fill_sends, partwise_names, tensor_map
from sdp.subnet.holder_groups import refresh_set
from sdp.subnet.masking import Piece
from sdp.subnet.plan import Plan
from sdp.subnet.redraw import masked_on_meta
from sdp.subnet.sync import by_dtype


def _statistics(*, pieces: list[Piece], full: dict[str, torch.Tensor], masking: str, rank: int,
                world: int) -> list[Record]:
    """The records of :func:`average_statistics` on ``pieces`` (their floating-point buffers) for ``rank``, run dry."""
    records: list[Record] = []

    def target(p: Piece) -> torch.Tensor:
        t = full[p.name]
        return torch.empty(p.nbytes // t.element_size(), dtype=t.dtype, device="meta")

    def reduce(flat: torch.Tensor, h: tuple[int, ...]) -> None:
        records.append(("all_reduce", flat.numel() * flat.element_size(), len(h)))

    stats = [p for p in pieces if not p.is_param and full[p.name].is_floating_point()]
    average_statistics(pieces=stats, target=target, masking=masking, rank=rank, world_size=world, reduce=reduce)
    return records


def _fill(*, pieces: list[Piece], full: dict[str, torch.Tensor], masking: str, rank: int, world: int,
          in_place: bool) -> list[Record]:
    """The records of :func:`sdp.subnet.assemble.fill` of ``pieces`` on ``rank``: the statistics' holder-set sums,
    then under forward masking the broadcasts of what some rank lacks from its lowest holder over its holder set's
    refresh set, where ``rank`` is in it (one per holder set and dtype, or with ``in_place`` one per piece; a receiver records
    payload 0, as the ranks do)."""
    out = _statistics(pieces=pieces, full=full, masking=masking, rank=rank, world=world)
    if masking != "forward":
        return out
    for h, items in fill_sends(pieces, world=world):
        ranks = refresh_set(h, n=world)
        if rank not in ranks:
            continue
        if in_place:
            sizes = [p.nbytes for p in items]
        else:  # one flat per dtype (sdp.subnet.sync.broadcast_pieces)
            sizes = [sum(items[i].nbytes for i in mine) for mine in by_dtype([full[p.name].dtype for p in items])]
        out += [("broadcast", size if rank == min(h) else 0, len(ranks)) for size in sizes]
    return out


def eval_traffic(spec: type, *, cfg: DictConfig, job: JobFacts, model: SDPModel, prepared: Plan, step: int) -> EvalTraffic:
    """``SDPSpec.eval_traffic``: what the evaluation after 1-based step ``step`` moves, under the plan that step trained
    on (``prepared``: the driver's, draw 0; later draws :func:`draw_at`) besides the protocol's own traffic: building the assembled
    model (:class:`sdp.subnet.assemble.PartwiseAssembly`, every part once per pass, or :func:`assemble` whole) and,
    under forward masking, the workers' own subnetworks (``eval.bn=average``: their statistics averaged,
    :func:`~sdp.subnet.assemble.own_evaluated`); after the consolidation switch (:func:`switched`) backward
    masking's assembly (statistics averaged, nothing broadcast) and no worker model. ``cfg``: the ``parallelism`` node."""
    draw = draw_at(step=step - 1, every=cfg.get("resample_every"))
    plan = next(run_plans(model=model, cfg=cfg, first=prepared, draws=[draw]))
    world, mode = plan.world_size, M.masking_mode(masking=str(cfg.masking), refresh=str(cfg.refresh))
    if switched(cfg=cfg, job=job, step=step):  # the consolidated model: backward masking's, no worker models of its own
        mode = "backward"
    pieces, full = M.pieces(model, plan), tensor_map(model)
    if world == 1:
        return EvalTraffic(build=[[]], partwise=False, own=[[]] if mode == "forward" else None)
    names = partwise_names(model)
    parts = [[p for p in pieces if p.name.startswith(f"{name}.")] for name in names]
    build_records = [[r for part in parts for r in _fill(pieces=part, full=full, masking=mode, rank=rank, world=world,
                                                          in_place=True)] if names else
                     _fill(pieces=pieces, full=full, masking=mode, rank=rank, world=world, in_place=False)
                     for rank in range(world)]
    own = None
    if mode == "forward":
        average = job.eval_bn == "average"
        own = [_statistics(pieces=[p for p in pieces if rank in p.holders], full=full, masking=mode, rank=rank,
                           world=world) if average else [] for rank in range(world)]
    return EvalTraffic(build=build_records, partwise=bool(names), own=own)


def switched(*, cfg: DictConfig, job: JobFacts, step: int) -> bool:
    """Whether the evaluation after 1-based ``step`` comes after the consolidation switch (``parallelism.consolidate``;
    the switch precedes 0-based step ``job.phase_steps[0]``): the strategy then evaluates as backward masking does."""
    return cfg.get("consolidate") is not None and len(job.phase_steps) == 2 and step > job.phase_steps[0]


def checkpoint_tensors(spec: type, *, cfg: DictConfig, job: JobFacts, model: SDPModel, step: int,
                       prepared: Plan) -> list[dict[str, list[torch.Tensor]]]:
    """``SDPSpec.checkpoint_tensors``: every rank's own file (:meth:`SDPStrategy.checkpoint_state`, all ``"local"``)
    holds its module's state dict, its subnetwork under the plan the checkpoint's step trained on masked as set-up
    and re-draws mask it (:func:`sdp.subnet.redraw.masked_on_meta`), and the optimizer state of what it trains."""
    draw = draw_at(step=step - 1, every=cfg.get("resample_every"))
    plan = next(run_plans(model=model, cfg=cfg, first=prepared, draws=[draw]))
    mode = M.masking_mode(masking=str(cfg.masking), refresh=str(cfg.refresh))
    out = []
    for rank in range(plan.world_size):
        module, pieces, layout = masked_on_meta(skeleton=model, plan=plan, rank=rank, mode=mode)
        trained = list(module.parameters()) if mode == "global" else list(M.held_parameters(layout, pieces, rank))
        out.append({"local": [*module.state_dict(keep_vars=True).values(),
                              *optimizer_state(optimizer=job.optimizer, params=trained)]})
    return out


def phase_traffic(spec: type, *, cfg: DictConfig, job: JobFacts, model: SDPModel, steps: int,
                  prepared: Plan) -> dict[str, list[list[Record]]]:
    """``SDPSpec.phase_traffic``: the comm phases "resample", every re-draw of the run (:func:`redraw_traffic`),
    "consolidate", the consolidation switch (:func:`switch_traffic`), and "calibrate" (:func:`calibrate_traffic`)."""
    return {"resample": redraw_traffic(cfg=cfg, job=job, model=model, plan=prepared, steps=steps),
            "consolidate": switch_traffic(cfg=cfg, job=job, model=model, plan=prepared),
            "calibrate": calibrate_traffic(cfg=cfg, model=model, plan=prepared, steps=steps)}


def switch_traffic(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan) -> list[list[Record]]:
    """Per rank, the records of the consolidation switch (``parallelism.consolidate``; none without, or where the
    budget left no second phase): :func:`sdp.parallel.sdp_consolidate.widen` fills the blocks each rank lacks from
    the driver's plan (consolidation allows no re-draw), :func:`sdp.subnet.assemble.fill` of every piece in place."""
    world = plan.world_size
    if cfg.get("consolidate") is None or len(job.phase_steps) != 2:
        return [[] for _ in range(world)]
    pieces, full = M.pieces(model, plan), tensor_map(model)
    return [_fill(pieces=pieces, full=full, masking="forward", rank=r, world=world, in_place=True) for r in range(world)]


def calibrate_traffic(*, cfg: DictConfig, model: SDPModel, plan: Plan, steps: int) -> list[list[Record]]:
    """Per rank, the records of assembly calibration (``parallelism.calibrate_steps``; none without) after the last of
    ``steps`` steps, on that step's plan: :func:`sdp.parallel.sdp_calibrate.assembled` fills each unit block in
    place, one :func:`sdp.subnet.assemble.fill` per block in order, then every calibration step all-reduces the gates'
    gradients and the loss over the world in float32 (:func:`sdp.parallel.sdp_calibrate.fit`, recorded at any world)."""
    world, cal = plan.world_size, calibration(cfg=cfg, model=model, plan=plan, steps=steps)
    if cal is None:
        return [[] for _ in range(world)]
    pieces, full = M.pieces(model, cal["plan"]), tensor_map(model)
    fills = [[rec for b in cal["blocks"] for rec in _fill(pieces=[p for p in pieces if p.name.startswith(f"blocks.{b}.")],
                                                          full=full, masking="forward", rank=r, world=world, in_place=True)]
             if world > 1 else [] for r in range(world)]  # fill moves nothing on one rank
    gates = ("all_reduce", cal["gate_bytes"], world)
    return [mine + [gates] * cal["steps"] for mine in fills]


def redraw_traffic(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan, steps: int) -> list[list[Record]]:
    """Per rank, the records of every re-draw a run of ``steps`` steps makes (``parallelism.resample_every``; none
    without), each rehearsed for every rank (:func:`rehearse_redraw`). The state descriptions' all-gather moves
    every rank's pickled descriptions: its payload is their sum, the same on every rank."""
    world = plan.world_size
    out: list[list[Record]] = [[] for _ in range(world)]
    if not cfg.get("resample_every") or world == 1:
        return out
    mode = M.masking_mode(masking=str(cfg.masking), refresh=str(cfg.refresh))
    factory = build(job.optimizer)
    template = state_template(optimizer_factory=factory, dtype=next(model.parameters()).dtype)
    draws = sorted({draw_at(step=s, every=int(cfg.resample_every)) for s in range(steps)})
    plans = list(run_plans(model=model, cfg=cfg, first=plan, draws=draws))
    for old, new in zip(plans, plans[1:]):
        each: list[dict[str, Any]] = [rehearse_redraw(skeleton=model, old_plan=old, new_plan=new, rank=r, mode=mode,
                                                      optimizer_factory=factory, template=template) for r in range(world)]
        gathered = [e["described_bytes"] for e in each]
        for r, e in enumerate(each):
            out[r] += e["records"]
            if e["described_bytes"] is not None:  # every rank gathers, or none (the same moving pieces)
                out[r].append(("all_gather", sum(g or 0 for g in gathered), world))
    return out


def format_phase_moves(plan: dict[str, Any]) -> list[str]:
    """``sdp-plan``'s lines on consolidation and calibration, where the plan has them: what each rank receives and
    sends at the switch or the assembly (comm phase ``consolidate`` / ``calibrate``; the comm counter counts a
    broadcast's bytes at its source only), and consolidation's step against phase 1's, or the gates' all-reduce."""
    mib, lines = 2**20, []
    if (c := plan.get("consolidate")) is not None:
        lines.append(f"consolidation from step {c['start_step']} (phases of {c['phase_steps']} steps, {c['measured_steps']} "
                     "measured; comm/step in the table: their mean), per rank:")
        lines += [f"  rank {e['rank']}: switch receives {e['switch']['received_bytes'] / mib:.3f} MiB (blocks it lacks: "
                  f"{e['switch']['lacked_bytes'] / mib:.3f}), sends {e['switch']['sent_bytes'] / mib:.3f} MiB; step "
                  f"{e['consolidate_bytes_per_step'] / mib:.3f} MiB in {e['consolidate_collectives_per_step']} collectives "
                  f"(phase 1: {e['train_bytes_per_step'] / mib:.3f} MiB in {e['train_collectives_per_step']})" for e in c["per_rank"]]
    if (c := plan.get("calibrate")) is not None:
        lines.append(f"calibration: {c['steps']} steps, {c['gates']} gates, each step all-reduces {c['gate_bytes_per_step']} "
                     "bytes over the world (the gates' gradients and the loss, float32); the assembly, per rank:")
        lines += [f"  rank {e['rank']}: receives {e['received_bytes'] / mib:.3f} MiB (blocks it lacks: "
                  f"{e['lacked_bytes'] / mib:.3f}), sends {e['sent_bytes'] / mib:.3f} MiB" for e in c["per_rank"]]
    return lines


PLAN_HOOKS = (eval_traffic, phase_traffic, checkpoint_tensors)  # SDPSpec's, in this order
