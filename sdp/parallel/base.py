"""The strategy interface and registry: how the trainer talks to DDP, FSDP, pipeline and SDP alike.

A strategy owns everything that differs between parallelisms: how the model is wrapped or cut, how
one training step runs forward, backward, gradient synchronisation and the optimizer update, which
part of the global batch this rank consumes, and what evaluation runs on. The trainer only calls
these methods, so it never names a strategy.

A strategy also answers, from the config alone and before any rank starts (classmethods, run in the
driver on the meta device), what the modules outside ``sdp/parallel/`` would otherwise have to guess
from config keys: its name in reports (:meth:`Strategy.method_label`), the share of the model's units
a worker computes (:meth:`Strategy.coverage`) and of DDP's FLOPs (:meth:`Strategy.flops_fraction`;
the budget and the report use both), and its ``sdp-plan`` prediction (:meth:`Strategy.predict`,
:meth:`Strategy.predict_peaks`). The planner, :mod:`sdp.budget`, :mod:`sdp.report` and
:mod:`sdp.metrics.flops` ask the strategy and name none.
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
from sdp.plan_entries import Entry
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


@dataclass(frozen=True)
class Coverage:
    """How much of the model one worker computes per step, as the method states it (the report's C column)
    and as realised (the budget's fraction of units)."""

    key: str  # the config key that states it, e.g. "parallelism.coverage"
    symbol: str  # how tables name it: "C" (SDP's coverage) or "p" (a survival probability)
    value: float  # that key's value
    fraction: float | None  # fraction of the model's units one worker computes on average (None: not countable)

    def summary(self) -> dict[str, Any]:
        return {"key": self.key, "symbol": self.symbol, "value": self.value, "fraction": self.fraction}


class Strategy(ABC):
    """Base class: subclasses implement ``setup``; ``train_step`` is one template with hooks (a strategy
    whose step is another shape overrides it); the rest has defaults."""

    name: str = ""
    label: str = ""  # the report's name of the method (default: ``name``); see :meth:`method_label`
    label_keys: tuple[str, ...] = ()  # parallelism keys the label already says (no table column of their own)
    plan_note: str = ""  # a caveat of this strategy's ``sdp-plan`` prediction, listed in the plan's notes
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

    # ---- validation before any rank starts -----------------------------------------------------
    @classmethod
    def validate(cls, *, cfg: DictConfig, full_cfg: DictConfig, world_size: int) -> None:
        """Raise ``ValueError`` naming key, value and what is allowed for impossible settings.

        ``cfg`` is the ``parallelism`` node, ``full_cfg`` the whole job config (batch size, model, ...),
        both passed by :func:`sdp.config.validate` before any rank starts."""

    # ---- what the driver, the budget and the report ask (from the config alone) --------------------
    @classmethod
    def method_label(cls, *, cfg: DictConfig) -> str:
        """The report's name of the method ``cfg`` (the ``parallelism`` node) configures."""
        return cls.label or cls.name

    @classmethod
    def coverage(cls, *, cfg: DictConfig, world_size: int, n_units: int | None) -> Coverage | None:
        """The share of the model's units one worker computes per step (``n_units``: the model's unit
        count, None when it could not be counted). None (default): every worker runs the whole model."""
        return None

    @classmethod
    def flops_fraction(cls, *, cfg: DictConfig, coverage: Coverage, masked: dict[str, float]) -> float:
        """Fraction of the full model's training FLOPs one worker computes per step on average, for a
        strategy with a :meth:`coverage`; ``masked`` maps each unit level (``"block"``, ``"neuron"``) to the
        share of the forward FLOPs a worker computing part of each unit narrows at that level
        (:func:`sdp.metrics.flops.masked_fractions`). Default 1: the whole model."""
        return 1.0

    @classmethod
    def report_facts(cls, *, cfg: DictConfig, n_units: int | None = None) -> dict[str, Any]:
        """``label`` and ``coverage`` as summary.json records them (``cfg``: the whole job config)."""
        cov = cls.coverage(cfg=cfg.parallelism, world_size=int(cfg.cluster.world_size), n_units=n_units)
        return {"label": cls.method_label(cfg=cfg.parallelism), "coverage": cov.summary() if cov else None}

    @classmethod
    def predict(cls, *, cfg: DictConfig, model: SDPModel, world: int, facts: dict[str, Any]) -> list[Entry]:
        """``sdp-plan``: each rank's (memory, comm) entry (:mod:`sdp.plan_entries`) for the whole job config
        ``cfg`` and ``model`` built on the meta device; strategy facts for the plan's JSON go into ``facts``."""
        raise ValueError(f"parallelism.name={cls.name!r}: this strategy makes no sdp-plan prediction (Strategy.predict)")

    @classmethod
    def predict_peaks(cls, *, cfg: DictConfig, model: SDPModel, world: int, batch: int, eval_batch: int,
                      state: list[dict[str, Any]]) -> list[dict[str, int]] | None:
        """``sdp-plan``'s set-up, train and eval peaks per rank (:mod:`sdp.plan_peaks`); ``state``: the
        memory entries of :meth:`predict`. None (default): no peak rehearsal."""
        return None

    @classmethod
    def plan_frontier(cls, *, cfg: DictConfig) -> dict[str, Any]:
        """``sdp-plan plan.frontier=true``: the floor and Pareto frontier of the strategy's own plan."""
        raise ValueError(f"plan.frontier=true scores SDP with forward masking, got parallelism.name={cls.name!r}")

    @classmethod
    def format_facts(cls, facts: dict[str, Any]) -> list[str]:
        """Lines ``sdp-plan`` prints after its table, from the ``facts`` of :meth:`predict`."""
        return []

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
