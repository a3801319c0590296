"""What a strategy answers from the config alone, in the driver, before any rank starts.

A strategy answers (classmethods, run in the driver on the meta device) what the modules outside
``sdp/parallel/`` would otherwise have to guess from config keys: its name in reports
(:meth:`StrategyFacts.method_label`), the share of the model's units a worker computes
(:meth:`StrategyFacts.coverage`, a :class:`Coverage`) and of DDP's FLOPs
(:meth:`StrategyFacts.flops_fraction`; the budget and the report use both), and its ``sdp-plan``
prediction (:meth:`StrategyFacts.predict`, :meth:`StrategyFacts.predict_peaks`). The planner,
:mod:`sdp.budget`, :mod:`sdp.report` and :mod:`sdp.metrics.flops` ask the strategy and name none.

Why a module of its own: these are called on the strategy *class*, with no process group, no device
and no model state, by code that never runs a step; :class:`sdp.parallel.base.Strategy` inherits them
and adds what runs on the ranks (set-up, the step, evaluation, checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from sdp.models.base import SDPModel
from sdp.plan_entries import Entry


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


class StrategyFacts:
    """The classmethods a strategy answers from the config alone (defaults: a strategy that runs the whole
    model on every worker and makes no ``sdp-plan`` prediction); the base of :class:`sdp.parallel.base.Strategy`."""

    name: str = ""
    label: str = ""  # the report's name of the method (default: ``name``); see :meth:`method_label`
    label_keys: tuple[str, ...] = ()  # parallelism keys the label already says (no table column of their own)
    plan_note: str = ""  # a caveat of this strategy's ``sdp-plan`` prediction, listed in the plan's notes

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
