"""What the driver asks a strategy, before any rank starts: the registered half of a strategy.

A strategy is two classes in its own module: a :class:`StrategySpec` (registered by name with
:func:`register`, class-level, no process group, no device, no rank state) and the runtime class it
names in :attr:`StrategySpec.runtime` (:class:`sdp.parallel.base.Strategy`, what each rank runs). The
split follows torchtitan's ``TrainSpec`` (``torchtitan/protocols/train_spec.py``): the driver looks the
spec up and asks it; only the ranks instantiate the runtime.

The spec answers what the modules outside ``sdp/parallel/`` would otherwise have to guess from config
keys: whether the config can work (:meth:`StrategySpec.validate`), what the driver builds once from the
meta model for every rank (:meth:`StrategySpec.prepare`: SDP's plan), its name in reports
(:meth:`StrategySpec.method_label`), the share of the model's units a worker computes
(:meth:`StrategySpec.coverage`, a :class:`Coverage`) and of DDP's FLOPs (:meth:`StrategySpec.flops_fraction`;
the budget and the report use both), and its ``sdp-plan`` prediction (:meth:`StrategySpec.predict`,
:meth:`StrategySpec.predict_peaks`). The planner, :mod:`sdp.driver.budget`, :mod:`sdp.report` and
:mod:`sdp.metrics.flops` ask the spec and name no strategy. A question only one strategy answers (SDP's
plan frontier) is that strategy's own method, not the base's.

Every method receives the strategy's own ``parallelism`` node (``cfg``) and, where it needs more of the job,
the :class:`JobFacts` facts the driver reads from the composed config once (:meth:`JobFacts.of`), never the whole
config: what a strategy may depend on besides its own keys is the short list of :class:`JobFacts`'s fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from omegaconf import DictConfig

from sdp.metrics.flops import BlockShare
from sdp.models.base import SDPModel
from sdp.parallel.job import JobFacts
from sdp.parallel.plan_entries import Entry, EvalTraffic, Record
from sdp.registry import Registry

if TYPE_CHECKING:
    import torch

    from sdp.parallel.base import Strategy


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


@dataclass(frozen=True)
class PostTraining:
    """A phase a strategy runs after its last training step (:meth:`StrategySpec.post_training`; SDP's assembly
    calibration): its name (comm and memory phase), its steps (one global batch each) and one step's FLOPs per
    sample as a fraction of the full model's training FLOPs per sample, which ``train.budget=flops`` charges."""

    name: str
    steps: int
    step_fraction: float


WINDOWS = ("none", "backward", "step")  # the compute a strategy's collectives can hide behind (:class:`Overlap`)


@dataclass(frozen=True)
class Overlap:
    """Which of a step's collectives run behind its compute, for ``sdp-plan``'s step time
    (:mod:`sdp.planning.throughput`): the strategy states it (:attr:`StrategySpec.overlap`), the planner
    applies one rule to every strategy. Collectives of ``kinds`` overlap ``window`` (``backward``: the backward
    pass, two thirds of the step's FLOPs; ``step``: forward and backward; ``none``: nothing), except ``tail``
    of them that cannot (DDP's last bucket, launched when backward ends); every other kind is exposed. ``switch``:
    a boolean key of the strategy's node that turns the overlap off when false (SDP's ``parallelism.overlap``)."""

    kinds: tuple[str, ...] = ()
    window: str = "none"
    tail: int = 0
    switch: str | None = None

    def __post_init__(self) -> None:
        assert self.window in WINDOWS and self.tail >= 0, f"Overlap window={self.window!r} not in {WINDOWS} or tail={self.tail} < 0"

    def summary(self) -> dict[str, Any]:
        return {"kinds": list(self.kinds), "window": self.window, "tail": self.tail}


@dataclass(frozen=True)
class LaterPhase:
    """A strategy's second training phase (:meth:`StrategySpec.later_phase`): its ``name`` (summary.json
    ``budget.phases``), the ``share`` of the run's FLOP budget it spends, and ``fraction``, its training FLOPs per
    step as a fraction of DDP's (recomputation and any extra forward included)."""

    name: str
    share: float
    fraction: float


class StrategySpec:
    """The classmethods a strategy answers in the driver (defaults: a strategy that runs the whole model on
    every worker, needs nothing built for its ranks and makes no ``sdp-plan`` prediction)."""

    name: str = ""  # set by :func:`register`: the ``parallelism.name`` that selects it
    label: str = ""  # the report's name of the method (default: ``name``); see :meth:`method_label`
    label_keys: tuple[str, ...] = ()  # parallelism keys the label already says (no table column of their own)
    plan_note: str = ""  # a caveat of this strategy's ``sdp-plan`` prediction, listed in the plan's notes
    runtime: type[Strategy]  # what each rank instantiates: ``runtime(cfg=..., job=..., ctx=..., prepared=...)``
    # Its ``parallelism`` node's dataclass (sdp.core.fields: one field per key, its type, choices, range), declared
    # beside the spec; the driver holds the node to it before :meth:`validate`, and :func:`schemas` stores it for
    # the YAML's defaults list (``- /schema/parallelism/<name>@_here_``). A subclass inherits it; None: untyped.
    schema: type | None = None
    # Why the ranks cannot exchange CUDA tensors over gloo (``cluster.device=cuda cluster.backend=gloo``, several
    # ranks sharing a GPU), "" (default) where they can: the driver refuses that combination naming this reason,
    # and does not recommend gloo to share a GPU (:func:`sdp.driver.config.validate`).
    gloo_cuda_refusal: str = ""
    overlap: Overlap | None = Overlap()  # what its collectives overlap (:class:`Overlap`; default: none, every one
    #                                       exposed); None: its step is not a forward + backward + collectives
    #                                       (a pipeline schedule), so ``sdp-plan`` predicts no step time for it

    # ---- validation and what the driver builds once -----------------------------------------------
    @classmethod
    def validate(cls, *, cfg: DictConfig, job: JobFacts) -> None:
        """Raise ``ValueError`` naming key, value and what is allowed for impossible settings of the keys.

        ``cfg`` is the ``parallelism`` node, ``job`` the job's facts (world size, batch size, ...), both
        passed by :func:`sdp.driver.config.validate` before any rank starts, after :attr:`schema` has
        checked each key's type, choices and range; what needs the model is :meth:`prepare`'s."""

    @classmethod
    def prepare(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel) -> Any:
        """What the driver builds once from the ``parallelism`` node ``cfg``, the ``job`` and the model built
        on the meta device, checked (a :class:`~sdp.errors.ConfigError` naming the key otherwise), and hands to every
        rank (``Strategy.prepared``), to :meth:`coverage` and to the ``sdp-plan`` prediction: SDP's plan, so
        that k and the holders are decided in one place. Picklable (it travels to spawned ranks).
        None (default): the ranks need nothing from the driver."""
        return None

    # ---- what the driver, the budget and the report ask ------------------------------------------------
    @classmethod
    def method_label(cls, *, cfg: DictConfig) -> str:
        """The report's name of the method ``cfg`` (the ``parallelism`` node) configures."""
        return cls.label or cls.name

    @classmethod
    def coverage(cls, *, cfg: DictConfig, world_size: int, n_units: int | None, prepared: Any = None) -> Coverage | None:
        """The share of the model's units one worker computes per step (``n_units``: the model's unit
        count, None when it could not be counted; ``prepared``: :meth:`prepare`'s result, None when the
        question comes from the config alone). None (default): every worker runs the whole model."""
        return None

    @classmethod
    def flops_fraction(cls, *, cfg: DictConfig, coverage: Coverage, shares: dict[str, dict[int, BlockShare]],
                       prepared: Any = None) -> float:
        """Fraction of the full model's training FLOPs one worker computes per step on average, for a
        strategy with a :meth:`coverage`; ``shares`` maps each unit level (``"block"``, ``"neuron"``) to each
        block's shares of the forward FLOPs (:func:`sdp.metrics.flops.unit_shares`), which the strategy weighs
        by what its workers run of each block (:func:`sdp.metrics.flops.forward_fraction`), from ``prepared``
        (:meth:`prepare`'s result: SDP's plan says which blocks are units and who holds them). Default 1: the
        whole model."""
        return 1.0

    @classmethod
    def post_training(cls, *, cfg: DictConfig) -> PostTraining | None:
        """The phase it runs after the last training step, whose FLOPs the budget charges (:mod:`sdp.driver.budget`:
        fewer training steps under ``train.budget=flops``); None (default): none."""
        return None

    @classmethod
    def later_phase(cls, *, cfg: DictConfig, shares: dict[str, dict[int, BlockShare]],
                    prepared: Any = None) -> LaterPhase | None:
        """A second training phase that spends the last share of the budget at another fraction of DDP's FLOPs per
        step (SDP's consolidation), or None (default: one phase). The budget (:mod:`sdp.driver.budget`) turns it
        into each phase's step count; the ranks switch at the first phase's end (:attr:`JobFacts.phase_steps`)."""
        return None

    @classmethod
    def report_facts(cls, *, cfg: DictConfig, world_size: int, n_units: int | None = None,
                     prepared: Any = None, ac: str = "none") -> dict[str, Any]:
        """``label`` and ``coverage`` as summary.json records them (``cfg``: the ``parallelism`` node; ``ac``:
        ``train.ac``, a training option of every strategy, so a checkpointed run's label says "+AC" whatever its
        strategy: FSDP with ``train.ac=full`` is the report's FSDP+AC, not FSDP)."""
        cov = cls.coverage(cfg=cfg, world_size=world_size, n_units=n_units, prepared=prepared)
        label = cls.method_label(cfg=cfg)
        if ac != "none" and not label.endswith(("+AC", "+SAC")):
            label += "+SAC" if ac == "op" else "+AC"  # op: selective (torchtitan's op policy)
        return {"label": label, "coverage": cov.summary() if cov else None}

    @classmethod
    def predict(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any],
                prepared: Any = None) -> list[Entry]:
        """``sdp-plan``: each rank's (memory, comm) entry (:mod:`sdp.parallel.plan_entries`) for the ``parallelism``
        node ``cfg`` of ``job`` and ``model`` built on the meta device; strategy facts for the plan's JSON go into
        ``facts``."""
        raise ValueError(f"parallelism.name={cls.name!r}: this strategy makes no sdp-plan prediction (StrategySpec.predict)")

    @classmethod
    def predict_peaks(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, eval_batch: int, steps: int,
                      eval_steps: frozenset[int], state: list[dict[str, Any]], prepared: Any = None) -> list[dict[str, int]] | None:
        """``sdp-plan``'s set-up, train and eval peaks per rank (the strategy's own rehearsal, next to it in
        ``sdp/parallel/``, on :mod:`sdp.parallel.plan_peaks`'s generic one); ``eval_batch``: a rank's evaluation
        batch; ``steps``: the steps the run makes and ``eval_steps`` the 1-based steps it evaluates after (its budget
        resolved, :class:`sdp.rank.schedule.Cadence`): a strategy whose state changes over the run, SDP's
        re-draws, predicts the largest over it; ``state``: the memory entries of :meth:`predict`. None
        (default): no peak rehearsal."""
        return None

    @classmethod
    def eval_traffic(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, step: int,
                     prepared: Any = None) -> EvalTraffic | None:
        """``sdp-plan``: what building this strategy's evaluated models moves in the evaluation after 1-based step
        ``step`` (its ``eval_module`` and ``subnetwork_module``; the protocol's own traffic is
        :mod:`sdp.planning.plan_traffic`'s). None (default): not predicted, and ``sdp-plan`` says so."""
        return None

    @classmethod
    def phase_traffic(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, steps: int,
                      prepared: Any = None) -> dict[str, list[list[Record]]]:
        """``sdp-plan``: per comm phase other than "train" and "eval" that a run of ``steps`` steps makes (SDP's
        "resample"), every rank's records over the whole run. Default: none."""
        return {}

    @classmethod
    def checkpoint_tensors(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, step: int,
                           prepared: Any = None) -> list[dict[str, list[torch.Tensor]]] | None:
        """``sdp-plan``: per rank, the tensors of the checkpoint after 1-based ``step`` by part, as the runtime's
        ``checkpoint_state`` lays them out (``"shared"``: rank 0's ``shared.pt``; ``"local"``: each rank's own file;
        on the meta device; :mod:`sdp.planning.plan_checkpoint` adds the RNG streams and counts the bytes). None
        (default): not predicted, and ``sdp-plan`` says so."""
        return None

    @classmethod
    def comm_overlap(cls, *, cfg: DictConfig) -> Overlap | None:
        """:attr:`overlap` as the ``parallelism`` node ``cfg`` configures it: no overlap where its ``switch`` key
        is false."""
        if cls.overlap is not None and cls.overlap.switch is not None and not bool(cfg.get(cls.overlap.switch, True)):
            return Overlap()
        return cls.overlap


STRATEGIES: Registry[type[StrategySpec]] = Registry(kind="strategy", key="parallelism.name")


def schemas() -> dict[str, type]:
    """Every registered strategy's :attr:`StrategySpec.schema`, under the name of the strategy that brings it: the
    registered spec highest in its class tree with that same schema (a subclass that inherits the schema, a plugin
    under ``SDPSpec``, is of that family: ``sdp``). Stored by the driver as ``schema/parallelism/<name>`` (what the
    YAML extends) and used to type a recorded, untyped ``config.yaml`` by its ``parallelism.name``. Read when
    asked, so a plugin imported later is found."""
    out: dict[str, type] = {}
    for name in STRATEGIES.names():
        spec = STRATEGIES.get(name)
        if spec.schema is not None:
            top = [c for c in spec.__mro__ if vars(c).get("name") and getattr(c, "schema", None) is spec.schema][-1]
            out[top.name] = spec.schema
    return out


def register(name: str) -> Callable[[type[StrategySpec]], type[StrategySpec]]:
    """Class decorator on a spec: ``@register("ddp")`` makes ``parallelism.name=ddp`` look this spec up
    (and its ``runtime`` run on the ranks)."""

    def deco(cls: type[StrategySpec]) -> type[StrategySpec]:
        assert isinstance(cls, type) and issubclass(cls, StrategySpec), \
            f"@register({name!r}) decorates a StrategySpec subclass (its runtime named in .runtime), got {cls!r}"
        assert getattr(cls, "runtime", None) is not None, f"strategy spec {cls.__name__} ({name!r}) names no runtime class"
        cls.name = name
        return STRATEGIES.register(name)(cls)

    return deco
