"""The strategy interface and registry: how the trainer talks to DDP, FSDP, pipeline and SDP alike.

A strategy owns everything that differs between parallelisms: how the model is wrapped or cut, how
one training step runs forward, backward, gradient synchronisation and the optimizer update, which
part of the global batch this rank consumes, and what evaluation runs on. The trainer only calls
these methods, so it never names a strategy.

A strategy also answers, from the config alone and before any rank starts, what the modules outside
``sdp/parallel/`` would otherwise have to guess from config keys (its name in reports, coverage, share
of DDP's FLOPs, ``sdp-plan`` prediction): those classmethods are :class:`sdp.parallel.facts.StrategyFacts`,
which :class:`Strategy` inherits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from sdp.metrics import memory
from sdp.distctx import DistContext, average_buffers, average_tensors  # noqa: F401 (re-exported)
from sdp.metrics.timing import PhaseTimer
from sdp.models.base import SDPModel
from sdp.parallel.facts import StrategyFacts
from sdp.precision import autocast
from sdp.registry import Registry

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


class Strategy(StrategyFacts, ABC):
    """Base class: subclasses implement ``setup``; ``train_step`` is one template with hooks (a strategy
    whose step is another shape overrides it); the rest has defaults."""

    # True: ``setup`` receives the model on the meta device and materialises what this rank holds
    # itself (sdp.models.init); False: the fully materialised model.
    materialises_held: bool = False

    def __init__(self, *, cfg: DictConfig, full_cfg: DictConfig, ctx: DistContext) -> None:
        self.cfg = cfg
        self.full_cfg = full_cfg
        self.ctx = ctx
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._grad_bytes_peak = 0
        train = full_cfg.get("train") if hasattr(full_cfg, "get") else None
        self.precision = str(train.get("precision", "fp32")) if train is not None else "fp32"

    # ---- set-up and one step --------------------------------------------------------------------
    @abstractmethod
    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        """Wrap/cut ``model`` (built identically on every rank) and build ``self.optimizer``."""

    def train_step(
        self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer, step: int
    ) -> StepResult:
        """Forward, backward, gradient sync and optimizer update for this rank's batch slice.

        The one step of every data-parallel strategy, written once; what differs comes from the hooks
        :meth:`step_context` (FSDP: intercept its collectives), :meth:`before_step` (SDP: re-draw the
        plan), :meth:`sync_grads` (SDP: holder-set all-reduces; DDP's happen inside backward) and
        :meth:`after_step` (SDP backward masking: refresh). A strategy whose step is another shape
        (pipeline: one schedule for forward and backward) overrides this method."""
        assert self.optimizer is not None, f"strategy {self.name!r} used before setup()"
        with self.step_context():
            self.before_step(step=step, timer=timer)
            loss = self.forward_backward(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer)
            self.sync_grads(timer=timer)
            with timer.phase("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
            self.after_step(timer=timer)
        return StepResult(loss_sum=loss.detach() * inputs.shape[0], count=int(inputs.shape[0]))

    def forward_backward(self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer) -> torch.Tensor:
        """:meth:`forward_loss`, then backward timed as the ``backward`` phase and the gradient bytes noted."""
        loss = self.forward_loss(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer)
        with timer.phase("backward"):
            loss.backward()
        self.note_grads()
        return loss

    # ---- hooks of the template step (defaults: nothing) -------------------------------------------
    def step_context(self) -> Any:
        """A context around the whole step (default: none)."""
        return nullcontext()

    def before_step(self, *, step: int, timer: PhaseTimer) -> None:
        """Runs before the forward (0-based ``step``)."""

    def sync_grads(self, *, timer: PhaseTimer) -> None:
        """Gradient synchronisation between backward and the optimizer step, where not inside backward."""

    def after_step(self, *, timer: PhaseTimer) -> None:
        """Runs after the optimizer step."""

    # ---- the forward, in the run's precision ------------------------------------------------------
    def autocast(self) -> Any:
        """``train.precision``'s context (:func:`sdp.precision.autocast`); every forward runs inside it."""
        return autocast(precision=self.precision, device=self.ctx.device)

    def forward_loss(self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer) -> torch.Tensor:
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
        trainer then applies the one evaluation protocol of every strategy (:mod:`sdp.evaluation`)."""
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
        the assembly gap; ``eval.ensemble``: their mean probability), else None. Default None: every
        worker trains the full model, so there is nothing to compare or ensemble."""
        yield None

    def unwrapped(self) -> nn.Module:
        assert self.module is not None, f"strategy {self.name!r} used before setup()"
        return getattr(self.module, "module", self.module)

    # ---- measurement -----------------------------------------------------------------------------
    def note_grads(self) -> None:
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

    def save_artifacts(self, *, run_dir: Path) -> None:
        """Write strategy-specific files into the run directory (SDP's plan.json); rank 0 only."""
    # ---- checkpoint / resume (written and read by sdp.checkpoint) --------------------------------
    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """This rank's model and optimizer state, keyed by how it is laid out over the ranks.

        - ``"shared"``: identical on every rank; rank 0 writes it once, every rank reads it.
        - ``"local"``: this rank's own state; every rank writes and reads its own file.
        - ``"sharded"``: a state dict of DTensors, saved and loaded collectively with
          ``torch.distributed.checkpoint`` (FSDP2: ``get_state_dict(self.module, self.optimizer)``).

        Values are tensors, numbers, strings and containers only (loaded with ``weights_only=True``);
        put strategy facts that must survive a restart (SDP's plan) under ``"extra"`` in either part.
        Default, right for the DDP family: parameters and optimizer state are replicated (shared);
        buffers are rank-local (BatchNorm statistics with ``broadcast_buffers=false``), so they are
        local. Disjoint strategies (SDP: each rank's held subnetwork and its optimizer state; pipeline:
        each rank's stages) return everything under ``"local"``.
        """
        assert self.optimizer is not None, f"strategy {self.name!r} has no optimizer to checkpoint"
        model = self.unwrapped()
        buffers = {name for name, _ in model.named_buffers()}
        full = model.state_dict()
        return {
            "shared": {"model": {k: v for k, v in full.items() if k not in buffers},
                       "optimizer": self.optimizer.state_dict()},
            "local": {"buffers": {k: v for k, v in full.items() if k in buffers}},
        }

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Inverse of :meth:`checkpoint_state`: ``state`` has the same keys, read back (``"sharded"``
        already loaded in place into a fresh :meth:`checkpoint_state` template; FSDP2 then calls
        ``set_state_dict``). Called after ``setup``; must leave the rank exactly as it was saved."""
        assert self.optimizer is not None, f"strategy {self.name!r} has no optimizer to restore"
        self.unwrapped().load_state_dict({**state["shared"]["model"], **state["local"]["buffers"]})
        self.optimizer.load_state_dict(state["shared"]["optimizer"])


STRATEGIES: Registry[type[Strategy]] = Registry(kind="strategy", key="parallelism.name")


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator: ``@register("ddp")`` makes ``parallelism.name=ddp`` build this class."""

    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        return STRATEGIES.register(name)(cls)

    return deco
