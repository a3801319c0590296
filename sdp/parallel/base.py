"""What a rank runs: the runtime half of a strategy, the interface the trainer talks to DDP, FSDP,
pipeline and SDP alike through.

A strategy owns everything that differs between parallelisms: how the model is wrapped or cut, how
one training step runs forward, backward, gradient synchronisation and the optimizer update, which
part of the global batch this rank consumes, and what evaluation runs on. The trainer, the worker,
evaluation and checkpoints only call the public methods of :class:`Strategy`, so they never name a
strategy; what a subclass changes inside the one step are the protected ``_hooks``.

What the driver asks before any rank starts (validation, report label, coverage, FLOP fraction,
``sdp-plan`` prediction, what it builds once for the ranks) is the other half, the registered
:class:`sdp.parallel.spec.StrategySpec`, which names its runtime class (torchtitan's ``TrainSpec``
plays that part there): driver code never instantiates a rank's state, rank code never asks a
driver question.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from sdp.errors import ConfigError
from sdp.metrics import memory
from sdp.core.distctx import DistContext, average_buffers
from sdp.metrics.timing import PhaseTimer
from sdp.models.base import SDPModel
from sdp.parallel.ac import apply_checkpointing
from sdp.core.precision import autocast

if TYPE_CHECKING:
    from sdp.parallel.job import JobFacts

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepResult:
    """Sum of per-sample losses over the samples this rank computed a loss for, and their count.

    The trainer all-reduces (loss_sum, count) over the world for the logged mean, so a pipeline
    stage without the loss reports (0, 0) and every strategy logs the same global-batch mean.
    """

    loss_sum: torch.Tensor
    count: int


class Strategy(ABC):
    """Base class of what a rank runs: subclasses implement ``setup``; ``train_step`` is one template with
    protected hooks (a strategy whose step is another shape overrides it); the rest has defaults.

    ``cfg``: the strategy's ``parallelism`` node; ``job``: the job's facts (:class:`sdp.parallel.spec.JobFacts`: seed,
    batch size, precision, ...), the only other part of the job a strategy reads; ``prepared``: what the driver
    built once for the ranks (:meth:`sdp.parallel.spec.StrategySpec.prepare`, SDP's plan), None for strategies
    that need nothing or when constructed outside the driver (tests)."""

    # True: ``setup`` receives the model on the meta device and materialises what this rank holds
    # itself (sdp.models.init); False: the fully materialised model.
    materialises_held: bool = False
    # True: every rank holds the same parameters and optimizer state after every step (the DDP family:
    # gradients averaged over the world before each update), so the default checkpoint writes rank 0's copy
    # once. False, what a strategy that declares nothing gets: replicas may differ between synchronisations
    # (local SGD, DiLoCo, gossip), so every rank writes and reads its own copy (n times the bytes, never wrong).
    replicas_identical: bool = False

    def __init__(self, *, cfg: DictConfig, job: JobFacts, ctx: DistContext, prepared: Any = None) -> None:
        self.name = str(cfg.get("name") or type(self).__name__) if hasattr(cfg, "get") else type(self).__name__
        self.prepared = prepared
        self.cfg = cfg
        self.job = job
        self.ctx = ctx
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._grad_bytes_peak = 0
        self.precision = job.precision
        self.checkpointed: list[int] = []  # activation-checkpointed blocks (checkpoint_blocks)

    # ---- set-up and one step --------------------------------------------------------------------
    def checkpoint_blocks(self, *, model: SDPModel) -> list[int]:
        """Apply the job's activation checkpointing (``train.ac``, :mod:`sdp.parallel.ac`) to ``model``; called by
        whoever builds the rank's model, before :meth:`setup` wraps, masks or shards it, so every strategy gets the
        same blocks checkpointed (FSDP2: before ``fully_shard``, as torchtitan). Returns (and keeps, for the
        summary's ``strategy_info.checkpointed_blocks``) the checkpointed blocks' indices."""
        self.checkpointed = apply_checkpointing(model, every=self.job.ac_every, mode=self.job.ac_mode)
        return self.checkpointed

    @abstractmethod
    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        """Wrap/cut ``model`` (built identically on every rank) and build ``self.optimizer``."""

    def train_step(
        self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer, step: int
    ) -> StepResult:
        """Forward, backward, gradient sync and optimizer update for this rank's batch slice.

        The one step of every data-parallel strategy, written once; what differs comes from the hooks
        :meth:`_step_context` (FSDP: intercept its collectives), :meth:`_before_step` (SDP: re-draw the
        plan), :meth:`_sync_grads` (SDP: holder-set all-reduces; DDP's happen inside backward) and
        :meth:`_after_step` (SDP backward masking: refresh). A strategy whose step is another shape
        (pipeline: one schedule for forward and backward) overrides this method."""
        assert self.optimizer is not None, f"strategy {self.name!r} used before setup()"
        with self._step_context():
            self._before_step(step=step, timer=timer)
            loss = self._forward_backward(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer)
            self._sync_grads(timer=timer)
            with timer.phase("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
            self._after_step(timer=timer)
        return StepResult(loss_sum=loss.detach() * inputs.shape[0], count=int(inputs.shape[0]))

    def _forward_backward(self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer) -> torch.Tensor:
        """:meth:`_forward_loss`, then backward timed as the ``backward`` phase and the gradient bytes noted."""
        loss = self._forward_loss(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer)
        with timer.phase("backward"):
            loss.backward()
        self._note_grads()
        return loss

    # ---- hooks of the template step (defaults: nothing) -------------------------------------------
    def _step_context(self) -> Any:
        """A context around the whole step (default: none)."""
        return nullcontext()

    def _before_step(self, *, step: int, timer: PhaseTimer) -> None:
        """Runs before the forward (0-based ``step``)."""

    def _sync_grads(self, *, timer: PhaseTimer) -> None:
        """Gradient synchronisation between backward and the optimizer step, where not inside backward."""

    def _after_step(self, *, timer: PhaseTimer) -> None:
        """Runs after the optimizer step."""

    # ---- the forward, in the run's precision ------------------------------------------------------
    def autocast(self) -> Any:
        """``train.precision``'s context (:func:`sdp.core.precision.autocast`); every forward runs inside it."""
        return autocast(precision=self.precision, device=self.ctx.device)

    def _forward_loss(self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer) -> torch.Tensor:
        """The one forward every strategy's ``train_step`` runs: the wrapped module and the loss under
        :meth:`autocast`, timed as the ``forward`` phase. Backward and the optimizer run outside it
        (fp32 master weights and gradients)."""
        assert self.module is not None, f"strategy {self.name!r} used before setup()"
        with timer.phase("forward"), self.autocast():
            return loss_fn(self.module(inputs), targets)

    # ---- data ------------------------------------------------------------------------------------
    def data_parallel(self) -> tuple[int, int]:
        """(index, count) of the data-parallel replica this rank belongs to; the global batch is
        split into ``count`` equal slices. Strategies whose ranks share a batch (pipeline) override."""
        return self.ctx.rank, self.ctx.world_size

    # ---- evaluation ------------------------------------------------------------------------------
    @contextmanager
    def eval_module(self) -> Iterator[nn.Module]:
        """The full model to evaluate, identical on every rank (default: the wrapped model with its
        buffers averaged over the world, so BatchNorm statistics agree). A strategy yields its model
        with the statistics training accumulated, averaged over the ranks that ran each layer; the
        trainer then applies the one evaluation protocol of every strategy (:mod:`sdp.rank.evaluation`)."""
        model = self.unwrapped()
        with self.ctx.comm.phase_as("eval"):
            average_buffers(model, ctx=self.ctx)
        model.eval()
        try:
            yield model
        finally:
            model.train()

    @contextmanager
    def subnetwork_module(self) -> Iterator[nn.Module | None]:
        """This worker's own trained model when workers train different models (``eval.subnetworks``:
        the assembly gap; ``eval.ensemble``: their mean probability), else None; under ``eval.bn=average``
        with each layer's statistics averaged over the ranks that ran it, as :meth:`eval_module`'s. Default
        None: every worker trains the full model, so there is nothing to compare or ensemble."""
        yield None

    # ---- a phase after the last training step ----------------------------------------------------
    def post_training_steps(self) -> int:
        """Batches the strategy's phase after its last training step reads (SDP's assembly calibration); 0: none
        (default) or already done (a run resumed after it). The trainer runs it before the last evaluation and
        checkpoint, so both see what it did."""
        return 0

    def post_training(self, *, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn) -> list[dict[str, Any]]:
        """Run that phase on ``batches`` (this rank's shards of the global batches of the steps after the run's last);
        returns the metrics rows it logs."""
        return []

    def unwrapped(self) -> nn.Module:
        """The model under any wrapper (DDP's ``.module``): what state dicts and the parameter digest read."""
        assert self.module is not None, f"strategy {self.name!r} used before setup()"
        return getattr(self.module, "module", self.module)

    # ---- measurement -----------------------------------------------------------------------------
    def _note_grads(self) -> None:
        """Call after backward, before grads are freed: records the gradient bytes held."""
        assert self.module is not None
        self._grad_bytes_peak = max(self._grad_bytes_peak, memory.grad_bytes(self.module))

    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank holds: parameters, gradients (peak), optimizer state."""
        assert self.module is not None
        return {
            "param_bytes": memory.param_bytes(self.module),
            "grad_bytes": self._grad_bytes_peak,
            "optim_bytes": memory.optim_bytes(self.optimizer),
        }

    def summary_extra(self) -> dict[str, Any]:
        """Strategy-specific facts for summary.json (plans, stage cuts, ...)."""
        return {}

    def info(self) -> dict[str, Any]:
        """summary.json's ``strategy_info`` as of now: :meth:`summary_extra` and the checkpointed blocks. Rank 0's
        summary writes it and every checkpoint's meta.json keeps it, so a summary rebuilt from the final checkpoint
        (:mod:`sdp.driver.finished`) carries what the ranks recorded, not a reconstruction."""
        return {**self.summary_extra(), **({"checkpointed_blocks": self.checkpointed} if self.checkpointed else {})}

    def save_artifacts(self, *, run_dir: Path) -> None:
        """Write strategy-specific files into the run directory (SDP's plan.json); rank 0 only."""

    def final_state(self) -> dict[str, Any] | None:
        """This rank's share of the run's final weights (``train.save_final``, :mod:`sdp.rank.final_weights`):
        ``{"tensors": {full-model name: tensor}, "facts": {...}}``, every tensor of the model written by exactly
        one rank (so the files hold one model, not n copies) and ``facts`` what a reader needs to use them (plain
        types, the same on every rank). None (the default): the strategy keeps no final weights, and the driver
        refuses ``train.save_final`` for it before any rank starts. Why a hook: only the strategy knows which rank
        holds which tensor (SDP: a unit's lowest holder)."""
        return None
    # ---- checkpoint / resume (written and read by sdp.rank.checkpoint) --------------------------------
    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """This rank's model and optimizer state, keyed by how it is laid out over the ranks.

        - ``"shared"``: identical on every rank; rank 0 writes it once, every rank reads it.
        - ``"local"``: this rank's own state; every rank writes and reads its own file.
        - ``"sharded"``: a state dict of DTensors, saved and loaded collectively with
          ``torch.distributed.checkpoint`` (FSDP2: ``get_state_dict(self.module, self.optimizer)``).

        Values are tensors, numbers, strings and containers only (loaded with ``weights_only=True``);
        put strategy facts that must survive a restart (SDP's plan) under ``"extra"`` in either part.
        Default: buffers are rank-local (BatchNorm statistics with ``broadcast_buffers=false``), so they are
        local; parameters and optimizer state are shared where the strategy declares
        :attr:`replicas_identical` (the DDP family), else local, each rank's own copy (rank 0's would resume
        every other replica silently wrong). Disjoint strategies (SDP: each rank's held subnetwork and its
        optimizer state; pipeline: each rank's stages) override this and return everything under ``"local"``.
        """
        assert self.optimizer is not None, f"strategy {self.name!r} has no optimizer to checkpoint"
        model = self.unwrapped()
        buffers = {name for name, _ in model.named_buffers()}
        full = model.state_dict()
        replica = {"model": {k: v for k, v in full.items() if k not in buffers}, "optimizer": self.optimizer.state_dict()}
        local = {"buffers": {k: v for k, v in full.items() if k in buffers}}
        return {"shared": replica, "local": local} if self.replicas_identical else {"local": {**replica, **local}}

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Inverse of :meth:`checkpoint_state`: ``state`` has the same keys, read back (``"sharded"``
        already loaded in place into a fresh :meth:`checkpoint_state` template; FSDP2 then calls
        ``set_state_dict``). Called after ``setup``; must leave the rank exactly as it was saved."""
        assert self.optimizer is not None, f"strategy {self.name!r} has no optimizer to restore"
        part = "shared" if self.replicas_identical else "local"
        if "model" not in state.get(part, {}):
            raise ConfigError(f"parallelism.name={self.name!r} (replicas_identical={self.replicas_identical}) reads its "
                              f"parameters from the checkpoint's {part!r} part, which holds none: the checkpoint was written "
                              f"with replicas_identical={not self.replicas_identical}; resume with the declaration it was written with")
        self.unwrapped().load_state_dict({**state[part]["model"], **state["local"]["buffers"]})
        self.optimizer.load_state_dict(state[part]["optimizer"])
