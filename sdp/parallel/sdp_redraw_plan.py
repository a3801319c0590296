"""SDP's re-draws as ``sdp-plan`` predicts them: the re-draw itself (:func:`sdp.subnet.redraw.redraw`) rehearsed on
the meta device under the live-tensor tracker, with a wire that sends nothing (:class:`DryWire`).

Apart from :mod:`sdp.parallel.sdp_plan` (the plan and the bytes it predicts) because this is a rehearsal of the
ranks' own code, with its own stand-ins (the wire, each moving piece's optimizer state, :func:`state_template`);
the peaks of a run's re-draws (:func:`redraw_peaks`) are asked by :mod:`sdp.parallel.sdp_peaks`.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn

from sdp.metrics.comm import CommCounter
from sdp.metrics.live import LiveTensorTracker
from sdp.models.base import SDPModel
from sdp.parallel.device_forward import device_optimizer
from sdp.registry import build
from sdp.subnet import masking as M
from sdp.subnet import redraw as R
from sdp.subnet.carry import Described, describe
from sdp.subnet.moves import moves
from sdp.subnet.plan import Plan


class DryWire(R.Wire):
    """``sdp-plan``'s stand-in on the meta device: the same buffers, nothing sent; every moving piece's
    state described by ``template`` (the optimizer's state of one parameter, :func:`state_template`). Its
    sends, receives and reductions are recorded by the ranks' own :class:`~sdp.subnet.redraw.Wire` code into
    ``comm`` (phase "resample"); the all-gather of the state descriptions moves every rank's pickled
    descriptions, so the wire keeps this rank's (``described_bytes``, None when it gathers nothing) and the
    caller, who rehearses every rank, records their sum (:func:`redraw_records`)."""

    def __init__(self, *, template: Described, moving: list[int]) -> None:
        self.template, self.moving = template, moving
        self.sent = self.received = 0
        self.comm = CommCounter(phase="resample")
        self.described_bytes: int | None = None

    def _post(self, ops: list[tuple[bool, int, torch.Tensor]]) -> None:
        pass

    def _reduce(self, flat: torch.Tensor, ranks: tuple[int, ...]) -> None:
        pass

    def gather(self, mine: dict[int, Described]) -> list[dict[int, Described]]:
        self.described_bytes = len(pickle.dumps(mine))  # what gather_descriptions pickles of this rank's
        return [{i: dict(self.template) for i in self.moving}]


def state_template(*, optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                   dtype: torch.dtype) -> Described:
    """The optimizer's state of one parameter after a step, described: what ``sdp-plan`` takes every
    moving piece's state to be (SGD with momentum: one buffer; Adam(W): two moments and a step)."""
    p = nn.Parameter(torch.zeros(2, dtype=dtype, device="meta"))  # as the rehearsal's state (step on the CPU; fused: meta)
    opt = device_optimizer(factory=optimizer_factory, params=[p])
    p.grad = torch.zeros_like(p)
    opt.step()
    return {key: describe(key=key, value=v, param=p) for key, v in opt.state.get(p, {}).items()}


def rehearse_redraw(*, skeleton: nn.Module, old_plan: Plan, new_plan: Plan, rank: int, mode: str,
                    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer], template: Described) -> dict[str, int]:
    """``sdp-plan``'s prediction of this rank's re-draw from ``old_plan`` to ``new_plan``:
    :func:`sdp.subnet.redraw.redraw` run on the meta device under the live-tensor tracker, from the rank's state after a
    training step (parameters, gradients, optimizer state, as a run has it), with a :class:`DryWire`.
    Returns ``peak_bytes`` (the tracker's peak), ``sent_bytes``, ``received_bytes``, ``records`` (the (kind, payload,
    group size) the wire recorded) and ``described_bytes`` (:class:`DryWire`)."""
    # built untracked (a deep copy on meta leaves storages the tracker would count), then the old one labelled
    new_model, new, new_layout = R.masked_on_meta(skeleton=skeleton, plan=new_plan, rank=rank, mode=mode)
    module, old, old_layout = R.masked_on_meta(skeleton=skeleton, plan=old_plan, rank=rank, mode=mode)
    tracker = LiveTensorTracker(device_type="meta")
    with tracker:
        tracker.label(list(module.parameters()) + list(module.buffers()), "parameters")
        trained = list(module.parameters()) if mode == "global" else list(M.held_parameters(old_layout, old, rank))
        optimizer = device_optimizer(factory=optimizer_factory, params=trained)
        for t in trained:
            t.grad = torch.zeros_like(t)
        optimizer.step()
        tracker.reset_peak()
        _, carried = moves(old=old, new=new, mode=mode, world=old_plan.world_size)
        wire = DryWire(template=template, moving=sorted(carried))
        full = {k: t for k, t in list(skeleton.named_parameters()) + list(skeleton.named_buffers())}
        R.redraw(module=module, optimizer=optimizer, old=old, old_layout=old_layout, new_model=new_model, new=new,
                 new_layout=new_layout, rank=rank, world=old_plan.world_size, mode=mode, device="meta", full=full, wire=wire)
        return {"peak_bytes": tracker.peak, "sent_bytes": wire.sent, "received_bytes": wire.received,
                "records": wire.comm.phase_records("resample"),
                "described_bytes": wire.described_bytes}


def redraw_peaks(*, cfg: DictConfig, optimizer: DictConfig, model: SDPModel, plans: list[Plan],
                 role: Callable[[Plan, int], Any] | None = None, rotated: bool = False) -> list[int]:
    """Per rank, the predicted peak of the re-draws between consecutive ``plans`` (:func:`rehearse_redraw` of each,
    the largest; ``plans``: the draws in order, from :func:`run_plans`; ``cfg``: the ``parallelism`` node,
    ``optimizer``: the ``optim.optimizer`` node); zeros without a re-draw. ``role`` (rank's role in a plan): a
    re-draw from role a to role b is rehearsed once, on the first rank that makes it, and stands for every rank
    that makes it; ``rotated``: ``plans`` make a full rotation of the role pairs, after which a longer run hands
    any rank any of them: every rank gets the largest."""
    pc, world = cfg, plans[0].world_size
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    factory = build(optimizer)
    template = state_template(optimizer_factory=factory, dtype=next(model.parameters()).dtype)
    values: dict[Any, int] = {}
    out = [0] * world
    for old, new in zip(plans, plans[1:]):
        for r in range(world):
            key = (role(old, r), role(new, r)) if role is not None else (old.draw, r)
            if key not in values:
                values[key] = rehearse_redraw(skeleton=model, old_plan=old, new_plan=new, rank=r, mode=mode,
                                              optimizer_factory=factory, template=template)["peak_bytes"]
            out[r] = max(out[r], values[key])
    return [max(values.values(), default=0)] * world if rotated else out


def format_redraw(plan: dict[str, Any]) -> list[str]:
    """``sdp-plan``'s lines on the first re-draw (none without ``resample_every``): each rank's predicted
    peak next to its training peak, and the bytes it sends and receives."""
    facts = plan.get("redraw")
    if not facts:
        return []
    mib = 2**20
    mem = {m["rank"]: m for m in plan["memory"]["per_rank"]}
    lines = [f"re-draw every {facts['every']} steps, bytes predicted for {facts['predicted']}, peaks the largest over the "
             f"run's re-draws (up to one full rotation):"]
    for t in facts["per_rank"]:
        m = mem.get(t["rank"], {})
        peak = f"peak {m['redraw_peak_bytes'] / mib:.2f} MiB (train {m['train_peak_bytes'] / mib:.2f}), " \
            if m.get("redraw_peak_bytes") is not None and m.get("train_peak_bytes") is not None else ""
        lines.append(f"  rank {t['rank']}: {peak}receives {t['received_bytes'] / mib:.2f} MiB, sends {t['sent_bytes'] / mib:.2f} MiB")
    return lines
