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

Distillation: with ``distill_alpha`` > 0 the worker's own subnetwork is frozen at the switch (:func:`frozen_teacher`)
and consolidation's loss is ``(1 - alpha) CE + alpha KL(teacher || model)`` on the worker's own batch
(:func:`distilled_loss`): no logit traffic; averaged over the workers' gradients it fits the workers' ensemble.

Memory in phase 2 (per rank, fp32, Adam; P the model's parameter bytes, h the held share of them): parameters of
every block P, gradients and two Adam moments of the held part 3 h P, so 2.5 P at h = 0.5 against DDP's 4 P = 0.625x
DDP's model state before any activation (forward masking: 4 h P = 0.5x); activations are one checkpointed input per
block plus one block's recomputation, and the teacher adds its own h P and its logits (the KL term is chunked:
:class:`_ChunkedKL`). So plain fp32 phase 2 does not meet a
training peak of 0.60x DDP at C = 0.5 unless activations dominate DDP's peak (they enter DDP's peak in full and
phase 2's only as checkpoints); ``sdp-plan`` predicts phase 2's peak (``consolidate_peak_bytes``,
:func:`sdp.parallel.sdp_peaks.consolidate_peaks`) and the tracker measures it (memory phase ``consolidate``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from sdp.core.distctx import DistContext
from sdp.data.base import IGNORE_INDEX
from sdp.errors import require
from sdp.metrics.flops import forward_fraction
from sdp.metrics.memory import later_phase as later_memory_phase
from sdp.models.base import SDPModel
from sdp.parallel.ac import apply_checkpointing
from sdp.parallel.ddp_drop import draw_active, draw_generator
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import LaterPhase
from sdp.subnet import masking as M
from sdp.subnet.assemble import fill, set_branch_scales, tensor_map
from sdp.subnet.holder_groups import GroupSet
from sdp.subnet.plan import Plan

PHASE = "consolidate"  # the budget's phase name, the comm phase of the switch, the memory phase of its steps


@dataclass(frozen=True)
class Consolidation:
    """When consolidation starts (0-based ``start`` step, the driver's phase boundary) and its distillation weight."""

    start: int
    alpha: float
    survival: float = 1.0  # each block's probability of running in a consolidation step, per rank (1: every block)

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
                   survival=float(cfg.get("consolidate_survival", 1.0)))


def later_phase_fraction(*, shares: dict[int, Any], forward: float, alpha: float, survival: float = 1.0) -> float:
    """Consolidation's training FLOPs per step as a fraction of DDP's (3 forwards): the full forward (1), the
    recomputation of every block under activation checkpointing (the unit blocks' branch shares, ``shares``:
    :class:`sdp.metrics.flops.BlockShare` per block; stem, head and shortcuts are not recomputed), the backward's
    input gradients in full (1) and weight gradients of the held share (``forward``: the forward fraction a worker
    holds, :func:`sdp.metrics.flops.forward_fraction`), plus, with distillation (``alpha`` > 0), the teacher's
    forward (the worker's own subnetwork: ``forward`` again). ``survival`` q < 1: each block's branch runs with
    probability q, so every branch term (forward, recomputation, both backwards) is q of its full value on average;
    the stem, head and the teacher are not dropped."""
    branches = sum(s.branch for s in shares.values())
    rest = 1.0 - branches  # stem, head, shortcuts: run whatever the draw
    full, held = rest + survival * branches, rest + survival * (forward - rest)
    return (2.0 * full + held + survival * branches + (forward if alpha > 0 else 0.0)) / 3.0


def frozen_teacher(module: nn.Module) -> nn.Module:
    """A frozen copy of the worker's own subnetwork at the switch, in eval mode (dropout off, its own BatchNorm
    statistics): the teacher distillation fits, never updated."""
    teacher = copy.deepcopy(module)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


KL_CHUNK_ROWS = 1024  # rows (positions) of the logits per chunk of the distillation term, forward and backward


class _ChunkedKL(torch.autograd.Function):
    """``sum_rows w_row KL(softmax(teacher_row) || softmax(student_row))`` and its gradient in the student's logits,
    ``w_row (softmax(student_row) - softmax(teacher_row))``, computed ``chunk`` rows at a time in float32.

    Why not autograd over the whole batch: its log-softmaxes, the teacher's probabilities and the KL's product would
    each be a float32 copy of all the vocabulary-sized logits, kept for the backward (at LLaMA 1B with GPT-2's
    vocabulary, 8 x 1024 positions, some 1.5 GiB apiece, ``sdp-bench one-model-scale``); here only the two logits
    tensors the step already holds are kept, and one chunk's float32 work is live at a time (the backward recomputes
    the softmaxes, cheap beside the model)."""

    @staticmethod
    def forward(ctx: Any, student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,  # type: ignore[override]
                chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for s, t, w in zip(student.split(chunk), teacher.split(chunk), weights.split(chunk)):
            log_s, log_t = F.log_softmax(s.float(), dim=-1), F.log_softmax(t.float(), dim=-1)
            total += ((log_t.exp() * (log_t - log_s)).sum(-1) * w).sum()
        ctx.save_for_backward(student, teacher, weights)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        student, teacher, weights = ctx.saved_tensors
        out = torch.empty_like(student)
        for start in range(0, student.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            diff = F.softmax(student[rows].float(), dim=-1) - F.softmax(teacher[rows].float(), dim=-1)
            out[rows] = (diff * (weights[rows] * grad)[:, None]).to(out.dtype)
        return out, None, None, None


def distilled_loss(*, ce: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor,
                   alpha: float, chunk: int = KL_CHUNK_ROWS) -> torch.Tensor:
    """``(1 - alpha) ce + alpha KL(teacher || student)`` over the last dimension (classes, vocabulary), averaged over
    the positions the cross-entropy averages over: the scored targets (not :data:`~sdp.data.base.IGNORE_INDEX`);
    the KL ``chunk`` positions at a time (:class:`_ChunkedKL`: no vocabulary-sized float32 copy of the batch)."""
    scored = (targets.reshape(-1) != IGNORE_INDEX).float()
    kl = _ChunkedKL.apply(student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1]).detach(),
                          scored, chunk)
    return (1 - alpha) * ce + alpha * kl / scored.sum().clamp(min=1)


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
        (:func:`distilled_loss`), the teacher run without gradients on the same batch. The step reports the
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
                                       "survival": c.survival,  # and the share of blocks this rank ran (rank 0's in summary.json)
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
    return LaterPhase(name=PHASE, share=float(f),
                      fraction=later_phase_fraction(shares=block, forward=forward, alpha=float(cfg.get("distill_alpha") or 0),
                                                    survival=float(cfg.get("consolidate_survival", 1.0))))
