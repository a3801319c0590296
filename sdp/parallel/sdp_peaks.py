"""SDP's peak rehearsal for ``sdp-plan`` (set-up, train, eval and re-draw peaks per rank), next to the
strategy it predicts; :mod:`sdp.planning.plan_peaks` holds the generic rehearsal it runs on.

Each rank's subnetwork is the strategy's own masking of the driver's plan on the meta device
(:func:`sdp.subnet.masking.rank_subnetworks`), with the buckets of :class:`sdp.subnet.sync.OwnerSetSync`
(the largest flat buffer of a step, or under ``parallelism.overlap`` every launched bucket until the sync
finishes); evaluation builds the model part by part next to the rank's own state
(:func:`sdp.planning.plan_peaks.rehearse_partwise`: one part, its broadcast buffer and one batch's activations at a
time); with ``resample_every`` the first re-draw is rehearsed too (``redraw_peak_bytes``:
:func:`sdp.parallel.sdp_plan.rehearse_redraw`). ``tests/test_plan_peaks.py`` compares with the CPU tracker.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from sdp.rank.evaluation import batch_norms
from sdp.metrics.comm import CommCounter
from sdp.models.base import SDPModel
from sdp.parallel.job import Job
from sdp.parallel.sdp_plan import redraw_peaks
from sdp.planning.plan_entries import nbytes
from sdp.planning.plan_peaks import rehearse, rehearse_partwise
from sdp.subnet import masking as M
from sdp.subnet.assemble import partwise_names
from sdp.subnet.holder_groups import GroupSet
from sdp.subnet.plan import Plan
from sdp.subnet.sync import OwnerSetSync


def sdp_peaks(*, cfg: DictConfig, job: Job, model: SDPModel, plan: Plan, eval_batch: int) -> list[dict[str, int]]:
    """Per rank, SDP's set-up, train and eval peaks for the driver's ``plan``: each rank's masked subnetwork
    rehearsed (:func:`sdp.planning.plan_peaks.rehearse`) with its owner-set buckets' flat buffers (overlapped:
    :func:`_overlap_stand_in`); evaluation part by part next to the rank's state (:func:`rehearse_partwise`),
    or a whole assembled copy for a model that cannot be cut; with ``resample_every`` the first re-draw
    (``cfg``: the ``parallelism`` node)."""
    assert plan is not None, "SDP's peak rehearsal reads the driver's plan (sdp.driver.preflight), got none"
    pc, world, batch = cfg, plan.world_size, job.batch_size
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    pieces = M.pieces(model, plan)
    partwise = bool(partwise_names(model))
    if partwise:  # evaluation part by part (SDPStrategy.eval_module)
        norms = batch_norms(model)
        reestimate = job.eval_bn == "reestimate" and bool(norms)
        eval_extra = rehearse_partwise(model=model, flats=_part_flats(pieces, n=world, forward=mode == "forward"),
                                       batches=[(eval_batch, False)] + ([(batch, True)] if reestimate else []),
                                       example=model.example_input)
        eval_extra += nbytes(b for m in norms for b in m.buffers()) if reestimate else 0  # re-estimated statistics kept per part
    else:  # a whole assembled copy next to the rank's state
        full_eval = rehearse(module=copy.deepcopy(model), trainable=[], batch=1, eval_batch=eval_batch, optimizer=job.optimizer,
                             example=model.example_input)
        eval_extra = nbytes(list(model.parameters()) + list(model.buffers())) + full_eval["eval"] - full_eval["setup"]
    groups = GroupSet(world_size=world, holder_sets=(), refresh=False)  # no process group is created
    out = []
    for r, mine, layout, trained in M.rank_subnetworks(model, plan, mode=mode, all_pieces=pieces):
        overlap = bool(pc.get("overlap", True))
        sync = OwnerSetSync(rank=r, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(), mode=mode,
                            bucket_cap_mb=float(pc.bucket_cap_mb), overlap=overlap)
        sync.close()  # its hooks would launch collectives; the stand-in below allocates what they do
        res = rehearse(module=mine, trainable=trained, batch=batch, eval_batch=eval_batch, optimizer=job.optimizer,
                       example=mine.example_input,
                       after_backward=_overlap_stand_in(sync) if overlap else None)
        flats = [sum(p.nbytes for p in items) for _, items in sync.grad_buckets + sync.refresh_buckets]
        out.append({"setup_peak_bytes": res["setup"], "train_peak_bytes": max(res["train"], res["state"] + max(flats, default=0)),
                    "eval_peak_bytes": res["state"] + eval_extra})
    if pc.get("resample_every"):  # the first re-draw (draw 0 -> 1), rehearsed as it runs (sdp.subnet.redraw)
        for entry, peak in zip(out, redraw_peaks(cfg=pc, optimizer=job.optimizer, model=model, plan=plan)):
            entry["redraw_peak_bytes"] = peak
    return out


def _overlap_stand_in(sync: Any) -> Callable[[], None]:
    """Meta stand-in for OwnerSetSync's overlapped all-reduces (``parallelism.overlap``): a gradient
    hook on every synced tensor counts its buckets down, and each ready bucket of the launch order
    allocates its flat buffer, which stays live until the sync finishes after backward (the returned
    callable: it allocates the buckets not launched yet, then frees them all), as the real one does."""
    live: list[torch.Tensor] = []
    need: list[int] = []
    state = {"next": 0, "left": []}
    tensors: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for b, (_, items) in enumerate(sync.grad_buckets):
        mine = {id(t): t for t in (sync._tensor(p) for p in items)}
        need.append(len(mine))
        for key, t in mine.items():
            tensors.setdefault(key, (t, []))[1].append(b)

    def launch(*, every: bool) -> None:
        while state["next"] < len(sync.launch_order):
            b = sync.launch_order[state["next"]]
            if state["left"][b] and not every:
                return
            live.append(torch.empty(sum(p.nbytes for p in sync.grad_buckets[b][1]), dtype=torch.uint8, device="meta"))
            state["next"] += 1

    def hook_for(bs: list[int]) -> Callable[[torch.Tensor], None]:
        def hook(_t: torch.Tensor) -> None:
            for b in bs:
                state["left"][b] -= 1
            launch(every=False)
        return hook

    for t, bs in tensors.values():
        if t.requires_grad:
            t.register_post_accumulate_grad_hook(hook_for(bs))

    def finish() -> None:
        launch(every=True)
        live.clear()
        state["next"], state["left"] = 0, list(need)

    state["left"] = list(need)
    return finish


def _part_flats(pieces: list[Any], *, n: int, forward: bool) -> dict[str, int]:
    """Per top-level part, the largest temporary that filling it allocates (sdp.subnet.assemble.fill
    with ``in_place``: a piece lacked by some rank is broadcast straight into its tensor, except a
    slice narrowed along a dimension other than the first, which goes through a contiguous copy;
    only under forward masking)."""
    out: dict[str, int] = {}
    for p in pieces:
        if forward and len(p.holders) < n and p.dim not in (None, 0):
            parts = p.name.split(".")
            name = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
            out[name] = max(out.get(name, 0), p.nbytes)
    return out
