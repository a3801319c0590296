"""SDP's peak rehearsal for ``sdp-plan`` (set-up, train, eval and re-draw peaks per rank), next to the
strategy it predicts; :mod:`sdp.parallel.plan_peaks` holds the generic rehearsal it runs on.

Each rank's subnetwork is the strategy's own masking of the driver's plan on the meta device
(:func:`sdp.subnet.masking.rank_subnetworks`), with the buckets of :class:`sdp.subnet.sync.OwnerSetSync`
(the largest flat buffer of a step, or under ``parallelism.overlap`` every launched bucket until the sync
finishes); evaluation: part by part next to the rank's state (:func:`sdp.parallel.plan_peaks.rehearse_partwise`), then
under forward masking the worker's own subnetwork (``eval.subnetworks``, ``eval.ensemble``); with ``resample_every`` every
peak is the largest over the run's draws, re-draws rehearsed (``redraw_peak_bytes``: :mod:`sdp.parallel.sdp_redraw_plan`); with
``calibrate_steps`` the calibration after the last step (``calibrate_peak_bytes``: :mod:`sdp.parallel.sdp_calibrate_peaks`)
and the last step's evaluation after it (the own pass too), on the rank's state without gradients (calibration drops
them). With ``consolidate`` the consolidation phase's training peak (``consolidate_peak_bytes``: :func:`consolidate_peaks`,
the backward-masked full model with every block checkpointed, and the teacher where ``distill_alpha`` > 0) and the
evaluations after its switch on its state. ``tests/test_plan_peaks.py`` compares with the CPU tracker."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.models.base import SDPModel, batch_norms
from sdp.parallel.job import JobFacts
from sdp.parallel.sdp_calibrate_peaks import not_held_bytes, step_peak
from sdp.parallel.sdp_plan import draw_at, run_plans
from sdp.parallel.sdp_redraw_plan import redraw_peaks
from sdp.parallel.plan_entries import nbytes
from sdp.parallel.plan_peaks import rehearse, rehearse_partwise
from sdp.parallel.ac import apply_checkpointing
from sdp.parallel.sdp_distill import distilled_loss, frozen_teacher
from sdp.parallel.sdp_sync_peaks import sync_stand_in
from sdp.core.loss import loss_fn
from sdp.subnet import masking as M
from sdp.subnet.assemble import partwise_names
from sdp.subnet.holder_groups import GroupSet, refresh_set
from sdp.subnet.plan import Plan
from sdp.subnet.units import measure_block_costs
from sdp.subnet.sync import OwnerSetSync
from sdp.subnet.world_sync import WorldSync, average_of


def sdp_peaks(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan, eval_batch: int, steps: int,
              eval_steps: frozenset[int]) -> list[dict[str, int]]:
    """Per rank, SDP's set-up, train and eval peaks over the plans a run of ``steps`` steps trains on: draw 0 (the
    driver's ``plan``), then with ``resample_every`` its re-draws (:func:`sdp.parallel.sdp_plan.run_plans`), each of
    which hands a rank another role: its training peak is the largest over the draws it trains on, its evaluation
    peak the largest over the draws it evaluates in (``eval_steps``: the 1-based steps evaluated after), set-up
    draw 0's, and ``redraw_peak_bytes`` the largest re-draw between those draws (``cfg``: the ``parallelism`` node).
    Each rank's masked subnetwork is rehearsed (:func:`sdp.parallel.plan_peaks.rehearse`) with its owner-set
    buckets' flat buffers (overlapped: :func:`~sdp.parallel.sdp_sync_peaks.sync_stand_in`); evaluation part by part next to the rank's
    state (:func:`rehearse_partwise`), or a whole assembled copy for a model that cannot be cut.

    Cheap over many draws: a subnetwork is rehearsed once per distinct :func:`_key` (a relabelling re-draw hands
    the ranks draw 0's roles again), a re-draw once per pair of roles (:func:`_role`), the block costs are measured
    once, and the draws stop at one full rotation where the run makes more (:func:`_rotated`, and every re-draw
    from one of draw 0's roles to another made; ``rolling``: where its windows repeat); evaluations are placed
    exactly."""
    assert plan is not None, "SDP's peak rehearsal reads the driver's plan (sdp.driver.preflight), got none"
    pc, world, every = cfg, plan.world_size, cfg.get("resample_every")
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    costs = measure_block_costs(model) if every else None
    rehearsed: dict[Any, dict[str, int]] = {}
    evals: dict[Any, int] = {}
    out = [{"setup_peak_bytes": 0, "train_peak_bytes": 0, "eval_peak_bytes": 0} for _ in range(world)]
    calibrating = bool(int(pc.get("calibrate_steps") or 0))  # the last step's evaluation follows it, without gradients
    eval_draws = {draw_at(step=s - 1, every=every) for s in eval_steps if not (calibrating and s == steps)}
    roles: list[set[Any]] = [set() for _ in range(world)]
    own = mode == "forward" and (job.eval_subnetworks or job.eval_ensemble)  # Trainer.evaluate's own-subnetwork pass

    def eval_extra(pieces: list[Any], *, rank: int) -> int:  # rehearsed once per distinct set of part buffers
        flats = _part_flats(pieces, n=world, rank=rank, forward=mode == "forward")
        if (key := tuple(sorted(flats.items()))) not in evals:  # ranks and draws share them
            evals[key] = _eval_extra(job=job, model=model, flats=flats, eval_batch=eval_batch)
        return evals[key]

    def visit(p: Plan, *, train: bool) -> None:
        pieces = M.pieces(model, p)
        for r, got in _rank_peaks(cfg=pc, job=job, model=model, plan=p, pieces=pieces, mode=mode, eval_batch=eval_batch,
                                  rehearsed=rehearsed):
            entry = out[r]
            if p.draw == 0:
                entry["setup_peak_bytes"] = got["setup"]
            if train:
                entry["train_peak_bytes"] = max(entry["train_peak_bytes"], got["train"])
                roles[r].add(_role(p, r))
            if p.draw in eval_draws:
                entry["eval_peak_bytes"] = max(entry["eval_peak_bytes"], got["state"] + eval_extra(pieces, rank=r),
                                               got["own_eval"] if own else 0)

    plans, pairs, rotated = [], set(), False
    base = {_role(plan, r) for r in range(world)}
    for p in run_plans(model=model, cfg=pc, first=plan, draws=range(draw_at(step=steps - 1, every=every) + 1), costs=costs):
        pairs |= {(_role(plans[-1], r), _role(p, r)) for r in range(world)} if plans else set()
        plans.append(p)
        visit(p, train=True)
        # one full rotation: every rank has held every role and every re-draw from one role to another has been
        # made (not before a first re-draw: ranks alike at draw 0, e.g. LLaMA's equal blocks, still re-draw)
        if p.draw > 0 and p.redraw == "rolling" and p.holders == plan.holders:
            break  # its windows repeat from here, and so does every rank's sequence of re-draws
        rotated = p.draw > 0 and _rotated(first=plan, plan=p, seen=roles, capped=pc.get("max_holder_sets") is not None) \
            and pairs >= {(a, b) for a in base for b in base}
        if rotated:
            break
    later = sorted(d for d in eval_draws if d > plans[-1].draw)  # evaluations after the rotation, in their own draws
    for p in run_plans(model=model, cfg=pc, first=plan, draws=later, costs=costs):
        visit(p, train=False)
    if calibrating:  # assembly calibration after the last step, on its draw (sdp_calibrate_peaks), then its evaluation
        last = next(iter(run_plans(model=model, cfg=pc, first=plan, draws=[draw_at(step=steps - 1, every=every)], costs=costs)))
        step = step_peak(model=model, plan=last, batch=job.batch_size, precision=job.precision, device=job.device)
        pieces = M.pieces(model, last)
        for r, got in _rank_peaks(cfg=pc, job=job, model=model, plan=last, pieces=pieces, mode=mode,
                                  eval_batch=eval_batch, rehearsed=rehearsed):
            state = got["state"] - got["grads"]  # calibration dropped the gradients (sdp_calibrate.calibrate)
            out[r]["calibrate_peak_bytes"] = state + not_held_bytes(model=model, plan=last, rank=r) + step
            out[r]["eval_peak_bytes"] = max(out[r]["eval_peak_bytes"], state + eval_extra(pieces, rank=r),
                                            got["own_eval"] - got["grads"] if own else 0)
    if pc.get("consolidate") is not None:  # consolidation's steps, and the evaluations after its switch
        extra = _eval_extra(job=job, model=model, flats={}, eval_batch=eval_batch)
        for entry, (peak, state) in zip(out, consolidate_peaks(cfg=pc, job=job, model=model, plan=plan, eval_batch=eval_batch)):
            entry["consolidate_peak_bytes"] = peak
            entry["eval_peak_bytes"] = max(entry["eval_peak_bytes"], state + extra)
    if len(plans) > 1:  # the re-draws between them, rehearsed as they run (sdp.subnet.redraw)
        for entry, peak in zip(out, redraw_peaks(cfg=pc, optimizer=job.optimizer, model=model, plans=plans, role=_role,
                                                 rotated=rotated and len(plans) - 1 < draw_at(step=steps - 1, every=every))):
            entry["redraw_peak_bytes"] = peak
    return out


def consolidate_peaks(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan,
                      eval_batch: int) -> list[tuple[int, int]]:
    """Per rank, (the training peak of a consolidation step, its state after one): the backward-masked full model of
    the driver's ``plan`` with every block activation-checkpointed (what :func:`sdp.parallel.sdp_consolidate.widen`
    makes of the rank's subnetwork), its held parameters trained, the owner-set buckets and refresh buffers as in
    :func:`_rank_peaks` (``consolidate_average=world``: its release of non-held gradients too); with ``distill_alpha`` > 0 the rank's frozen forward-masked subnetwork beside it, run
    without gradients on the same batch, and the distilled loss (:func:`~sdp.parallel.sdp_distill.distilled_loss`)."""
    alpha, overlap = float(cfg.get("distill_alpha") or 0), bool(cfg.get("overlap", True))
    world = average_of(cfg) == "world"  # sdp.subnet.world_sync
    checkpointed = copy.deepcopy(model)
    apply_checkpointing(checkpointed, every=1)
    pieces = M.pieces(model, plan)
    teachers = {r: mine for r, mine, _, _ in M.rank_subnetworks(model, plan, mode="forward", all_pieces=pieces)} if alpha else {}
    groups = GroupSet(world_size=plan.world_size, holder_sets=(), refresh=False)  # no process group is created
    out = []
    for r, mine, layout, trained in M.rank_subnetworks(checkpointed, plan, mode="backward", all_pieces=pieces):
        if world:  # every parameter's gradient, each non-held one released as the ranks release it
            mine.requires_grad_(True)
        sync = (WorldSync if world else partial(OwnerSetSync, mode="backward"))(
            rank=r, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(), bucket_cap_mb=float(cfg.bucket_cap_mb),
            overlap=overlap)
        sync.close()  # its hooks would launch collectives; the stand-in allocates what they do
        module: nn.Module = _Distilled(student=mine, teacher=frozen_teacher(teachers[r]), alpha=alpha) if alpha else mine
        res = rehearse(module=module, trainable=trained, batch=job.batch_size, eval_batch=eval_batch, optimizer=job.optimizer,
                       example=mine.example_input, precision=job.precision, device=job.device,
                       after_backward=sync_stand_in(sync, overlap=overlap, release=True) if world else
                       sync_stand_in(sync, overlap=True) if overlap else None,
                       loss=module.loss if isinstance(module, _Distilled) else loss_fn)
        flats = [sum(q.nbytes for q in items) for _, items in sync.grad_buckets + sync.refresh_buckets]
        out.append((max(res["train"], res["state"] + max(flats, default=0)), res["state"]))
    return out


class _Distilled(nn.Module):
    """The rehearsal's stand-in of a distilled consolidation step: the teacher's forward without gradients, then the
    student's; :meth:`loss` takes the teacher's logits (alive until the backward frees them, as on the ranks)."""

    def __init__(self, *, student: nn.Module, teacher: nn.Module, alpha: float) -> None:
        super().__init__()
        self.student, self.teacher, self.alpha, self.taught = student, teacher, alpha, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.taught = self.teacher(x)
        return self.student(x)

    def loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        taught, self.taught = self.taught, None
        return distilled_loss(ce=loss_fn(out, targets), student=out, teacher=taught, targets=targets, alpha=self.alpha)


def _eval_extra(*, job: JobFacts, model: SDPModel, flats: dict[str, int], eval_batch: int) -> int:
    """What evaluation adds to a rank's state: the model part by part (SDPStrategy.eval_module; ``flats``: each
    part's broadcast buffer, :func:`_part_flats`), re-estimated BatchNorm statistics kept per part, or a whole
    assembled copy for a model that cannot be cut."""
    if partwise_names(model):
        norms = batch_norms(model)
        reestimate = job.eval_bn == "reestimate" and bool(norms)
        extra = rehearse_partwise(model=model, flats=flats, example=model.example_input, precision=job.precision,
                                  device=job.device, batches=[(eval_batch, False)] + ([(job.batch_size, True)] if reestimate else []))
        return extra + (nbytes(b for m in norms for b in m.buffers()) if reestimate else 0)
    full_eval = rehearse(module=copy.deepcopy(model), trainable=[], batch=1, eval_batch=eval_batch, optimizer=job.optimizer,
                         example=model.example_input, precision=job.precision, device=job.device)
    return nbytes(list(model.parameters()) + list(model.buffers())) + full_eval["eval"] - full_eval["setup"]


def _rank_peaks(*, cfg: DictConfig, job: JobFacts, model: SDPModel, plan: Plan, pieces: list[Any], mode: str, eval_batch: int,
                rehearsed: dict[Any, dict[str, int]]) -> Iterator[tuple[int, dict[str, int]]]:
    """Per rank of ``plan``: its set-up and train peaks and its state after a step, rehearsed unless
    ``rehearsed`` already holds its :func:`_key` (filled here)."""
    groups = GroupSet(world_size=plan.world_size, holder_sets=(), refresh=False)  # no process group is created
    overlap = bool(cfg.get("overlap", True))
    for r, mine, layout, trained in M.rank_subnetworks(model, plan, mode=mode, all_pieces=pieces):
        sync = OwnerSetSync(rank=r, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(), mode=mode,
                            bucket_cap_mb=float(cfg.bucket_cap_mb), overlap=overlap)
        sync.close()  # its hooks would launch collectives; the stand-in below allocates what they do
        key = _key(mine=mine, trained=trained, sync=sync)
        if key not in rehearsed:
            res = rehearse(module=mine, trainable=trained, batch=job.batch_size, eval_batch=eval_batch,
                           optimizer=job.optimizer, example=mine.example_input, precision=job.precision, device=job.device,
                           after_backward=sync_stand_in(sync, overlap=True) if overlap else None, ensemble=job.eval_ensemble)
            flats = [sum(q.nbytes for q in items) for _, items in sync.grad_buckets + sync.refresh_buckets]
            rehearsed[key] = {"setup": res["setup"], "train": max(res["train"], res["state"] + max(flats, default=0)),
                              "state": res["state"], "grads": nbytes(trained), "own_eval": res["eval"]}
        yield r, rehearsed[key]


def _key(*, mine: nn.Module, trained: list[nn.Parameter], sync: Any) -> tuple[Any, ...]:
    """Everything a rank's rehearsal allocates by: its subnetwork's tensors in order (shape, dtype, trained or
    not) and its gradient buckets (members by position, bytes, in launch order) and refresh buffers. Two ranks
    or draws with equal keys rehearse to the same bytes, whichever blocks they hold."""
    params = list(mine.parameters())
    index, mine_trained = {id(t): i for i, t in enumerate(params)}, {id(t) for t in trained}
    tensors = tuple((tuple(t.shape), t.dtype, id(t) in mine_trained) for t in params)
    order = sync.launch_order if sync.overlap else range(len(sync.grad_buckets))
    grads = tuple((tuple(sorted(index.get(id(sync._tensor(q)), -1) for q in sync.grad_buckets[b][1])),
                   sum(q.nbytes for q in sync.grad_buckets[b][1])) for b in order)
    refresh = tuple(sum(q.nbytes for q in items) for _, items in sync.refresh_buckets)
    return tensors, tuple((tuple(b.shape), b.dtype) for b in mine.buffers()), grads, refresh


def _role(plan: Plan, rank: int) -> tuple[Any, ...]:
    """A rank's role in ``plan`` up to which interchangeable units it holds: the costs of its units and of the
    block remainders it holds with them."""
    units = sorted((u.params, u.flops, u.act_bytes) for u in (plan.units[i] for i in plan.held_units(rank)))
    return tuple(units), tuple(sorted(n for b, n in plan.remainder.items() if rank in plan.block_holders(b)))


def _rotated(*, first: Plan, plan: Plan, seen: list[set[Any]], capped: bool) -> bool:
    """Whether the draws up to ``plan`` make one full rotation, after which no later draw hands a rank a role
    (:func:`_role`) it has not held: under ``relabel`` (cyclic or balanced assignment, or capped holder sets) and
    ``shuffle`` every draw relabels draw 0's roles (``first``), so a rotation is done once every rank has held each
    of them (``seen``: the roles each rank held); ``rolling`` repeats once its windows are back at draw 0's. A
    random assignment without a cap draws fresh subsets every time: no rotation, every draw of the run counts."""
    if plan.redraw == "rolling":
        return plan.draw > 0 and plan.holders == first.holders
    if plan.redraw == "relabel" and plan.assignment == "random" and not capped:
        return False
    return all(held >= {_role(first, r) for r in range(first.world_size)} for held in seen)


def _part_flats(pieces: list[Any], *, n: int, rank: int, forward: bool) -> dict[str, int]:
    """Per top-level part, the largest temporary that filling it allocates on ``rank`` (sdp.subnet.assemble.fill with
    ``in_place``: a piece lacked by some rank is broadcast straight into its tensor on its holders' refresh set, except
    a slice narrowed along a dimension other than the first, which goes through a contiguous copy; forward masking)."""
    out: dict[str, int] = {}
    for p in pieces:
        if forward and len(p.holders) < n and p.dim not in (None, 0) and rank in refresh_set(p.holders, n=n):
            parts = p.name.split(".")
            name = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
            out[name] = max(out.get(name, 0), p.nbytes)
    return out
