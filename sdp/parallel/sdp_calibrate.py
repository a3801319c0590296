"""SDP's assembly calibration (``parallelism.calibrate_steps``): after the last training step, fit one scalar gate
per residual branch of the assembled model, everything else frozen, then fold the gates into the weights.

Why: forward-masked SDP evaluates a model no worker ever ran (blocks chained as they were never trained together)
and corrects every branch by one fixed factor (``rescale=eval``: k/n). Calibration fits that factor per branch on
training tokens instead (:mod:`sdp.models.gates`: the gates and their folding), and the evaluated model stays a plain
model: the gates are folded into each branch's last linear layer or closing norm when the model is assembled for
evaluation (:class:`~sdp.subnet.assemble.PartwiseAssembly`), so inference costs what it cost.

What a rank holds while it runs (the memory phase ``calibrate``, ``summary.json`` ``calibrate_peak_bytes``): its own
training state (held parameters and optimizer state; the gradients are dropped first, no step follows), the
blocks it does not hold (received from their lowest holder, comm phase ``calibrate``; the held blocks, the stem and
the head are its own tensors, not copies), the gate vector with its Adam state, and the activations of one step
with every block checkpointed (each block's input kept, one block's activations recomputed at a time in backward).
No parameter of the model has a gradient: only the gates are trainable.

Cost (:func:`step_fraction`, charged by ``train.budget=flops`` in :mod:`sdp.driver.budget`): per sample, one
forward, its recomputation in backward, and a backward that computes the activations' gradients only (frozen
weights: no weight gradient), three forwards of the full model, as a training step of the full model counts
(:meth:`~sdp.models.base.SDPModel.flops_per_sample`). Traffic per step: one all-reduce over the world of the
gates' gradients and the loss (a few floats, comm phase ``calibrate``).

Checkpoints: calibration runs between the last step and its evaluation and checkpoint, so that checkpoint holds the
fitted gates (``extra``) and a run resumed from it evaluates the same folded model; a run killed during calibration
resumes from an earlier checkpoint, trains to the end again and re-runs calibration on the same batches, which is
deterministic (``tests/test_calibrate.py``).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from sdp.core.distctx import DistContext
from sdp.metrics.memory import measured_phase
from sdp.models import gates as G
from sdp.models.base import SDPModel
from sdp.parallel.ac import checkpoint_call, restored_buffers
from sdp.parallel.sdp_final import eval_scale
from sdp.parallel.spec import PostTraining
from sdp.subnet.assemble import fill, split_blocks, tensor_map
from sdp.subnet.holder_groups import GroupSet
from sdp.subnet.masking import Local, Piece
from sdp.subnet.plan import Plan

PHASE = "calibrate"  # the comm and memory phase
FORWARDS_PER_STEP = 3  # forward + recomputation (every block checkpointed) + backward to the activations only
TRAIN_FORWARDS = 3  # a full training step (forward + backward with weight gradients): SDPModel.flops_per_sample


def step_fraction() -> float:
    """FLOPs of one calibration step per sample as a fraction of the full model's training FLOPs per sample."""
    return FORWARDS_PER_STEP / TRAIN_FORWARDS


def post_training(cls: Any, *, cfg: DictConfig) -> PostTraining | None:
    """:meth:`SDPSpec.post_training <sdp.parallel.spec.StrategySpec.post_training>`: ``parallelism.calibrate_steps``
    steps of :func:`step_fraction` each, or None when off (0, or a config from before the key)."""
    steps = int(cfg.get("calibrate_steps") or 0)
    return PostTraining(name=PHASE, steps=steps, step_fraction=step_fraction()) if steps else None


@dataclass
class Calibration:
    """What a calibration fitted and measured (``summary.json`` ``strategy_info.calibrate``, checkpoint ``extra``)."""

    steps: int
    lr: float
    init: float
    gates: G.Gates = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    """The world-mean training loss of each step, with the gates before that step's update (the first: the
    assembled model as evaluation would have run it)."""
    peak_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "lr": self.lr, "init": self.init, "losses": list(self.losses), "peak_bytes": self.peak_bytes,
                "gates": {str(b): dict(v) for b, v in sorted(self.gates.items())}, "evaluated": "gates folded, no rescale"}

    @classmethod
    def of(cls, state: dict[str, Any]) -> Calibration:
        """Inverse of :meth:`to_json` (a checkpoint's ``extra``)."""
        return cls(steps=int(state["steps"]), lr=float(state["lr"]), init=float(state["init"]), losses=list(state["losses"]),
                   peak_bytes=state.get("peak_bytes"), gates={int(b): dict(v) for b, v in state["gates"].items()})


@contextmanager
def assembled(*, module: SDPModel, skeleton: SDPModel, pieces: list[Piece], layout: dict[str, Local], plan: Plan,
              groups: GroupSet, ctx: DistContext) -> Iterator[SDPModel]:
    """The assembled model for the block, sharing this rank's own tensors: the stem, the head, shared blocks and the
    held units are ``module``'s own modules (no copy), each unit it does not hold a fresh block filled from its lowest
    holder (:func:`sdp.subnet.assemble.fill`, in place: the holder broadcasts its own tensor). Every parameter is
    frozen and ``module``'s buffers (statistics averaged by ``fill``) are put back after. Collective."""
    full = copy.deepcopy(skeleton)  # the structure (meta); its parts are replaced below
    full.stem, full.head = module.stem, module.head
    units = split_blocks(plan)
    for b in range(len(skeleton.blocks)):
        name = f"blocks.{b}"
        own = b not in units or ctx.rank in plan.block_holders(b)
        block = module.get_submodule(name) if own else copy.deepcopy(skeleton.get_submodule(name)).to_empty(device=ctx.device)
        if b in units:
            state = {f"{name}.{k}": t for k, t in tensor_map(block).items()}
            mine = [p for p in pieces if p.name in state]
            assert {p.name for p in mine} == set(state), f"{name}: tensors without a piece {sorted(set(state) - {p.name for p in mine})[:5]}"
            fill(state=state, pieces=mine, layout=layout, masking="forward", groups=groups, ctx=ctx, in_place=True)
        full.blocks[b] = block
    trainable = [(p, p.requires_grad) for p in full.parameters()]
    with restored_buffers(module):
        for p, _ in trainable:
            p.requires_grad_(False)
        try:
            yield full
        finally:
            for p, was in trainable:
                p.requires_grad_(was)
            del full


def forward(model: SDPModel, x: torch.Tensor) -> torch.Tensor:
    """``head(blocks(stem(x)))`` with every block checkpointed: only block inputs stay for backward."""
    h = model.stem(x)
    for block in model.blocks:
        h = checkpoint_call(block, h)
    return model.head(h)


def fit(*, model: SDPModel, blocks: list[int], init: float, lr: float, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], autocast: Callable[[], Any],
        ctx: DistContext) -> tuple[G.Gates, list[float]]:
    """Fit gates on ``blocks`` of ``model`` (frozen) with Adam at ``lr``, one step per batch of ``batches`` (this rank's
    shard): the gates' gradients and the loss in one all-reduce over the world, averaged, so every rank takes the same
    step and ends with the same gates. The model runs in train mode (BatchNorm on batch statistics, as the evaluation's
    re-estimation describes the assembled model; its statistics are restored by :func:`assembled`). Returns the gates
    and each step's world-mean loss; the gates are taken off the model."""
    vector, where = G.attach(model, blocks=blocks, init=init, device=ctx.device)
    optimizer = torch.optim.Adam([vector], lr=lr)
    losses: list[float] = []
    model.train()
    try:
        for x, y in batches:
            with autocast():
                loss = loss_fn(forward(model, x), y)
            loss.backward()
            assert vector.grad is not None, "no gradient reached the gates"
            flat = torch.cat([vector.grad.detach().float(), loss.detach().float().reshape(1)])
            ctx.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=ctx.world_size)
            if ctx.world_size > 1:
                dist.all_reduce(flat)
            flat /= ctx.world_size
            vector.grad.copy_(flat[:-1])
            losses.append(float(flat[-1]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        G.remove(model, blocks=blocks)
    return G.values(vector, where), losses


def calibrate(*, module: SDPModel, skeleton: SDPModel, pieces: list[Piece], layout: dict[str, Local], plan: Plan,
              groups: GroupSet, ctx: DistContext, rescale: str, steps: int, lr: float,
              batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              autocast: Callable[[], Any]) -> Calibration:
    """The whole phase on one rank (collective): drop the training gradients, assemble (:func:`assembled`), fit
    (:func:`fit`) on the ``steps`` batches, measured as memory phase ``calibrate`` with traffic in comm phase
    ``calibrate``. ``module`` is left as it was trained; the gates are returned, to be folded where the model is
    assembled for evaluation."""
    for p in module.parameters():
        p.grad = None  # the last update is done and no step follows: gradients are not part of the model
    out = Calibration(steps=steps, lr=lr, init=eval_scale(plan=plan, rescale=rescale))  # evaluation's factor: 0 steps change nothing
    with ctx.comm.phase_as(PHASE), measured_phase(PHASE) as measured:
        with assembled(module=module, skeleton=skeleton, pieces=pieces, layout=layout, plan=plan, groups=groups,
                       ctx=ctx) as full:
            out.gates, out.losses = fit(model=full, blocks=sorted(split_blocks(plan)), init=out.init, lr=lr,
                                        batches=batches, loss_fn=loss_fn, autocast=autocast, ctx=ctx)
    out.peak_bytes = measured["peak_bytes"]
    assert len(out.losses) == steps, f"calibration ran {len(out.losses)} steps, {steps} asked (too few batches)"
    return out


class Calibrated:
    """:class:`~sdp.parallel.sdp.SDPStrategy`'s side of calibration: the trainer's post-training hooks
    (:meth:`~sdp.parallel.base.Strategy.post_training`), what evaluation applies (the gates folded, no factor), and
    what the summary and checkpoints keep. Reads the strategy's plan, pieces, layout, groups and skeleton."""

    calibration: Calibration | None = None

    def post_training_steps(self) -> int:
        """``parallelism.calibrate_steps`` until the gates are fitted (0 after, e.g. resumed from the last checkpoint)."""
        steps = int(self.cfg.get("calibrate_steps") or 0)  # type: ignore[attr-defined]
        return steps if self.calibration is None else 0

    def post_training(self, *, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
        """Calibrate (:func:`calibrate`); one metrics row per step with its world-mean loss."""
        s: Any = self
        self.calibration = calibrate(module=s.module, skeleton=s.skeleton, pieces=s.pieces, layout=s.layout, plan=s.plan,
                                     groups=s.groups, ctx=s.ctx, rescale=s.rescale, steps=self.post_training_steps(),
                                     lr=float(s.cfg.calibrate_lr), batches=batches, loss_fn=loss_fn, autocast=s.autocast)
        return [{"calibrate_step": i + 1, "calibrate_loss": loss} for i, loss in enumerate(self.calibration.losses)]

    def eval_factor(self) -> tuple[float, G.Gates | None]:
        """(scale, gates) of the evaluated model's units: before calibration the ``rescale`` factor and no gates,
        after it 1 and the gates, folded into the assembled parts (the gates replaced the factor)."""
        s: Any = self
        if self.calibration is not None:
            return 1.0, self.calibration.gates
        return eval_scale(plan=s.plan, rescale=s.rescale), None

    def calibration_extra(self) -> dict[str, Any]:
        """``{"calibrate": ...}`` once calibrated (summary's ``strategy_info``, checkpoint ``extra``), else {}."""
        return {"calibrate": self.calibration.to_json()} if self.calibration is not None else {}

    def load_calibration(self, extra: dict[str, Any]) -> None:
        """Adopt a checkpoint's calibration (``extra`` of :meth:`calibration_extra`; none: not calibrated yet)."""
        self.calibration = Calibration.of(extra["calibrate"]) if extra.get("calibrate") else None
