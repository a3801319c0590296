"""SDP's consolidation phase (``parallelism.consolidate``) and distillation during it (``parallelism.distill_alpha``).

Why: block-level SDP with forward masking trains each worker's own chain of blocks, but the model one deploys is
the assembled one, whose blocks were never chained that way in training. Consolidation spends the last fraction
``f`` of the FLOP budget training the assembled composition itself: at a step boundary the driver's budget decides
(:func:`sdp.driver.budget.split_phases`, ``summary.json`` ``budget.phases``; the ranks read it as
:attr:`sdp.parallel.job.JobFacts.phase_steps`), each worker's forward-masked subnetwork becomes the backward-masked
full model of the same plan (:func:`widen`): the blocks it lacks are allocated, filled with the assembled model's
values (the holders' current values, broadcast from the lowest holder, BatchNorm statistics averaged over holders:
:func:`sdp.subnet.assemble.fill`, the code evaluation assembles with; comm phase ``"consolidate"``), frozen
(``requires_grad=False``), every block is scaled as evaluation scales it (so the trained composition is the
evaluated one) and activation-checkpointed (:mod:`sdp.parallel.ac`). From then on the strategy is backward masking as
``masking=backward`` runs it: full forward, weight gradients and optimizer state for held blocks only, averaged
over their holders, non-held blocks refreshed from a holder after each update. The held parameters stay the same
objects, so their optimizer state carries over unchanged.

Block drops: with ``consolidate_survival`` q < 1 each rank runs each block with probability q per consolidation step
(its own draw, seeded by seed and rank, checkpointed), kept branches unscaled: LayerDrop inside the assembled model,
whose full model the LM study found good where training at exactly k blocks was not (REPORT.md's depth table). A
skipped block's held weights get a zero gradient on that rank: the holders' average counts it as zero.

World averaging: with ``consolidate_average=world`` each block's gradient is averaged over all ranks instead of its
holders (every rank computes every block's weight gradient, the holders keep it: :mod:`sdp.subnet.world_sync`), the
budget charging every block's weight gradients.

Distillation: with ``distill_alpha`` > 0 the worker's own subnetwork is frozen at the switch (:func:`~sdp.parallel.sdp_distill.frozen_teacher`)
and consolidation's loss is ``(1 - alpha) CE + alpha KL(teacher || model)`` on the worker's own batch
(:func:`~sdp.parallel.sdp_distill.distilled_loss`): no logit traffic; averaged over the workers' gradients it fits the workers' ensemble.

Memory in phase 2 (per rank, fp32, Adam; P the model's parameter bytes, h the held share): parameters P, gradients
and Adam moments of the held part 3 h P, so 2.5 P at h = 0.5 against DDP's 4 P before any activation; activations
are one checkpointed input per block plus one block's recomputation; world averaging adds about two blocks'
transient gradients; the teacher adds h P and its logits (the KL is chunked: :mod:`sdp.parallel.sdp_distill`). ``sdp-plan`` predicts phase 2's peak (``consolidate_peak_bytes``,
:func:`sdp.parallel.sdp_peaks.consolidate_peaks`) and the tracker measures it (memory phase ``consolidate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from sdp.core.distctx import DistContext
from sdp.errors import require
from sdp.metrics.flops import forward_fraction
from sdp.metrics.memory import later_phase as later_memory_phase
from sdp.models.base import SDPModel
from sdp.parallel.ac import apply_checkpointing
from sdp.parallel.ddp_drop import draw_active, draw_generator
from sdp.parallel.job import JobFacts
from sdp.parallel.sdp_distill import distilled_loss, frozen_teacher
from sdp.parallel.spec import LaterPhase
from sdp.subnet import masking as M
from sdp.subnet.assemble import fill, set_branch_scales, tensor_map
from sdp.subnet.holder_groups import GroupSet
from sdp.subnet.plan import Plan
from sdp.subnet.world_sync import WorldSync, average_of

PHASE = "consolidate"  # the budget's phase name, the comm phase of the switch, the memory phase of its steps


@dataclass(frozen=True)
class Consolidation:
    """When consolidation starts (0-based ``start`` step, the driver's phase boundary) and its distillation weight."""

    start: int
    alpha: float
    survival: float = 1.0  # each block's probability of running in a consolidation step, per rank (1: every block)
    average: str = "holders"  # a block's gradient averaged over its holders | "world": all ranks (sdp.subnet.world_sync)

    @classmethod
    def of(cls, *, cfg: DictConfig, job: JobFacts) -> Consolidation | None:
        """From the ``parallelism`` node and the job's phase steps (None: ``consolidate`` is null). Refused, naming
        the key: consolidation without the driver's two phases (a strategy built outside the driver must pass them)."""
        f = cfg.get("consolidate")
        if f is None:
            return None
        require(len(job.phase_steps) == 2, "parallelism.consolidate", f,
                f"a run whose budget split it into two phases (JobFacts.phase_steps={job.phase_steps}): run it through the driver")
        return cls(start=int(job.phase_steps[0]), alpha=float(cfg.get("distill_alpha") or 0),
                   survival=float(cfg.get("consolidate_survival", 1.0)), average=average_of(cfg))


def later_phase_fraction(*, shares: dict[int, Any], forward: float, alpha: float, survival: float = 1.0,
                         weights: float | None = None) -> float:
    """Consolidation's training FLOPs per step as a fraction of DDP's (3 forwards): the full forward (1), the
    recomputation of every block under activation checkpointing (the unit blocks' branch shares, ``shares``:
    :class:`sdp.metrics.flops.BlockShare` per block; stem, head and shortcuts are not recomputed), the backward's
    input gradients in full (1) and weight gradients of the held share (``forward``: the forward fraction a worker
    holds, :func:`sdp.metrics.flops.forward_fraction`), plus, with distillation (``alpha`` > 0), the teacher's
    forward (the worker's own subnetwork: ``forward`` again). ``survival`` q < 1: each block's branch runs with
    probability q, so every branch term (forward, recomputation, both backwards) is q of its full value on average;
    the stem, head and the teacher are not dropped. ``weights``: the forward fraction whose weight gradients are
    computed where it is not the held one (``consolidate_average=world``: 1, every block's)."""
    branches = sum(s.branch for s in shares.values())
    rest = 1.0 - branches  # stem, head, shortcuts: run whatever the draw
    full, held = rest + survival * branches, rest + survival * ((forward if weights is None else weights) - rest)
    return (2.0 * full + held + survival * branches + (forward if alpha > 0 else 0.0)) / 3.0


def widen(*, module: SDPModel, skeleton: SDPModel, plan: Plan, pieces: list[M.Piece], layout: dict[str, M.Local],
          rank: int, groups: GroupSet, ctx: DistContext, scale: float, values: bool) -> dict[str, M.Local]:
    """Turn this rank's forward-masked ``module`` (``layout``) in place into the backward-masked full model of
    ``plan`` and return its layout: every tensor it lacks allocated on the device with the full model's shape
    (``skeleton``) and frozen, every block active, scaled by ``scale`` (what evaluation scales each unit by) and
    activation-checkpointed. ``values``: fill them with the assembled model's values (collective, comm phase
    :data:`PHASE`); False: a resumed run, whose checkpoint holds them."""
    full = tensor_map(skeleton)
    for p in pieces:
        if M.locate(p, layout) is not None or p.name in layout:
            continue
        owner, leaf = M._owner(module, p.name)
        t = torch.empty_like(full[p.name], device=ctx.device)
        if p.is_param:
            owner._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        else:
            owner._buffers[leaf] = t
    for block in module.blocks:
        block.active = True
    if values:
        with ctx.comm.phase_as(PHASE):
            fill(state=tensor_map(module), pieces=pieces, layout=layout, masking="forward", groups=groups, ctx=ctx,
                 in_place=True)
    set_branch_scales(module, plan, scale=scale)
    apply_checkpointing(module, every=1)
    return M.apply(module, plan, rank=rank, masking="backward", all_pieces=pieces)


class Consolidating:
    """:class:`sdp.parallel.sdp.SDPStrategy`'s consolidation: the switch at the budget's phase boundary, the
    distilled step, and what a checkpoint keeps of them (the teacher; whether the switch happened)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self.consolidation = Consolidation.of(cfg=self.cfg, job=self.job)  # type: ignore[attr-defined]
        self.consolidated, self.teacher = False, None
        s: Any = self  # each rank its own draws, as the drop baselines' (their stream 1)
        self.drops = draw_generator(seed=s.job.seed, rank=s.ctx.rank, stream=2)
        self.blocks_run, self.drawn = 0, 0

    def _consolidate_at(self, *, step: int, timer: Any) -> None:
        """Before 0-based ``step``: the switch where consolidation starts (timed as the step's ``resample``
        phase, the time a re-draw's moves are counted in)."""
        if self.consolidation is not None and step == self.consolidation.start and not self.consolidated:
            with timer.phase("resample"):
                self._consolidate(resumed=False)

    def _consolidate(self, *, resumed: bool) -> None:
        """The switch (module docstring): the teacher frozen first (``distill_alpha`` > 0), the steps from here on
        measured as memory phase :data:`PHASE`, this rank's subnetwork widened in place (:func:`widen`), its sync
        rewired for backward masking (the refresh sets' groups exist from set-up: forward masking's fill uses them
        too, so the switch creates none); the held parameters, and so their
        optimizer state, are the same objects. ``resumed``: the structure only, a checkpoint's values follow."""
        s: Any = self
        assert self.consolidation is not None and s.module is not None and s.groups is not None
        if self.consolidation.alpha > 0:
            self.teacher = frozen_teacher(s.module)
        later_memory_phase(PHASE)
        layout = widen(module=s.module, skeleton=s.skeleton, plan=s.plan, pieces=s.pieces, layout=s.layout,
                       rank=s.ctx.rank, groups=s.groups, ctx=s.ctx, values=not resumed,
                       scale=s.plan.k / s.plan.world_size if s.rescale == "eval" else 1.0)
        s.mode, self.consolidated = "backward", True
        s._wire(s.module, plan=s.plan, pieces=s.pieces, layout=layout)
        if self.consolidation.average == "world":  # every block's weight gradient computed, averaged over all ranks
            for p in s.module.parameters():
                p.requires_grad_(True)  # the non-held ones stay outside the optimizer: WorldSync frees their gradients
            s.sync.close()
            s.sync = WorldSync(rank=s.ctx.rank, pieces=s.pieces, layout=s.layout, groups=s.groups, comm=s.ctx.comm,
                               bucket_cap_mb=float(s.cfg.bucket_cap_mb), overlap=bool(s.cfg.overlap))
        s.optimizer.param_groups[0]["params"] = s._trainable()

    def _forward_backward(self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any, timer: Any) -> torch.Tensor:
        """:meth:`_step_loss`; during consolidation with ``consolidate_survival`` q < 1, with each block run with
        probability q on this rank (:func:`~sdp.parallel.ddp_drop.draw_active`: a skipped block is the identity, its
        held weights get a zero gradient here, so their holder average counts it as zero, as DDP's LayerDrop does),
        every block active again after."""
        c, s = self.consolidation, self
        if c is None or not self.consolidated or c.survival >= 1:
            return self._step_loss(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer)
        blocks = list(s.module.blocks)  # type: ignore[attr-defined]
        kept = draw_active(blocks, probs=[c.survival] * len(blocks), generator=self.drops)
        self.blocks_run, self.drawn = self.blocks_run + sum(kept), self.drawn + len(kept)
        try:
            loss = self._step_loss(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer)
        finally:
            for block in blocks:
                block.active = True
        for p in s.optimizer.param_groups[0]["params"]:  # a skipped held block's gradient is zero, not absent:
            if p.grad is None:  # the optimizer steps it as DDP's LayerDrop does (find_unused_parameters), whether or
                p.grad = torch.zeros_like(p)  # not it has co-holders, and whatever the previous step left in .grad
        return loss

    def _step_loss(self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Any, timer: Any) -> torch.Tensor:
        """The base step's; with a teacher (consolidation with ``distill_alpha`` > 0) the distilled loss's backward
        (:func:`~sdp.parallel.sdp_distill.distilled_loss`), the teacher run without gradients on the same batch. The step reports the
        cross-entropy either way (what every run's loss curve shows)."""
        s: Any = self
        if self.teacher is None:
            return super()._forward_backward(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer)  # type: ignore[misc]
        assert self.consolidation is not None
        with timer.phase("forward"), s.autocast():
            out = s.module(inputs)
            ce = loss_fn(out, targets)
            with torch.no_grad():
                teacher = self.teacher(inputs)
            loss = distilled_loss(ce=ce, student=out, teacher=teacher, targets=targets, alpha=self.consolidation.alpha)
        with timer.phase("backward"):
            loss.backward()
        s._note_grads()
        return ce

    def _consolidation_state(self) -> dict[str, Any]:
        """What a checkpoint's ``"local"`` part keeps of consolidation: whether the switch happened, the teacher, and
        under ``consolidate_survival`` < 1 this rank's draw generator and its count of blocks run."""
        c = self.consolidation
        drops = {"drops": self.drops.get_state(), "blocks_run": [self.blocks_run, self.drawn]} if c and c.survival < 1 else {}
        return {"consolidation": {"done": self.consolidated, **drops,
                                  **({"teacher": self.teacher.state_dict()} if self.teacher is not None else {})}}

    def _load_consolidated(self, local: dict[str, Any]) -> None:
        """A checkpoint written after the switch: the consolidated structure (and teacher) built, values to load."""
        saved = local.get("consolidation") or {}
        if "drops" in saved:  # consolidate_survival < 1 only: without, no draw is made
            self.drops.set_state(saved["drops"])
            self.blocks_run, self.drawn = (int(v) for v in saved["blocks_run"])
        if saved.get("done"):
            self._consolidate(resumed=True)
            if self.teacher is not None:
                self.teacher.load_state_dict(saved["teacher"])

    def _consolidation_summary(self) -> dict[str, Any] | None:
        """summary.json ``strategy_info.consolidate``: where it started, its weight, whether it ran."""
        c = self.consolidation
        return None if c is None else {"start_step": c.start, "distill_alpha": c.alpha, "switched": self.consolidated,
                                       "survival": c.survival, "average": c.average,  # and the share of blocks this rank ran (rank 0's in summary.json)
                                       "blocks_run_fraction": self.blocks_run / self.drawn if self.drawn else None}


def later_phase(cls: type, *, cfg: DictConfig, shares: dict[str, Any] | None, prepared: Any = None) -> LaterPhase | None:
    """``SDPSpec.later_phase``: consolidation's share of the budget and FLOP fraction per step
    (:func:`later_phase_fraction`) for the driver's plan ``prepared`` (None without ``parallelism.consolidate``)."""
    f = cfg.get("consolidate")
    if f is None:
        return None
    require(shares is not None, "parallelism.consolidate", f, "a model whose FLOPs can be counted (the budget splits by them)")
    block = shares["block"]  # type: ignore[index]
    forward = forward_fraction(shares=block, computed=prepared.block_coverage())
    world = average_of(cfg) == "world"  # every block's weight gradients on every rank
    return LaterPhase(name=PHASE, share=float(f),
                      fraction=later_phase_fraction(shares=block, forward=forward, alpha=float(cfg.get("distill_alpha") or 0),
                                                    survival=float(cfg.get("consolidate_survival", 1.0)),
                                                    weights=1.0 if world else None))
