"""SDP's keys under ``parallelism``: what is checked before any rank starts, the plan drawn once in the
driver, and ``rescale=auto`` resolved.

Apart from :mod:`sdp.parallel.sdp` (the strategy that runs on the ranks) because they run on the config
and the driver's meta model: :meth:`SDPSpec.validate <sdp.parallel.sdp.SDPSpec.validate>` runs
:func:`validate` on the keys, :meth:`SDPSpec.prepare <sdp.parallel.sdp.SDPSpec.prepare>` runs :func:`prepare`
(the plan, from the model built once on the meta device, so an impossible plan is refused before any rank
starts and every rank trains the very plan the driver checked and predicted), and :func:`resolve_rescale`
turns ``parallelism.rescale=auto`` into the rule the ranks apply. Its schema, :class:`SDPConfig`, is here too:
each key's type, choices and range, the choices SDP's plans act on (``sdp/subnet``, below this package) named
from the tuples there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from sdp.core.fields import Number, flag, key
from sdp.errors import ConfigError, require
from sdp.models.base import SDPModel
from sdp.parallel.job import JobFacts
from sdp.parallel.sdp_plan import BALANCE_KEYS, MASKINGS, plan_for
from sdp.subnet.assemble import partwise_names
from sdp.subnet.assign import ASSIGNMENTS
from sdp.subnet.plan import Plan, PlanError, num_holders, warn_degenerate
from sdp.subnet.rolling import REDRAWS
from sdp.subnet.units import LEVELS
from sdp.subnet.world_sync import AVERAGES, average_of


@dataclass
class Balance:
    """``parallelism.balance``: weights of each resource in the balanced assignment's minimax objective."""

    params: Number = key(at_least=0)
    """Weight of the per-worker parameter load."""
    flops: Number = key(at_least=0)
    """Weight of the per-worker FLOP load."""
    activations: Number = key(at_least=0)
    """Weight of the per-worker activation bytes."""


@dataclass
class SDPConfig:
    """``parallelism=sdp`` and its variants: each worker trains a subnetwork; a unit's gradients are averaged
    over its holders only (conf/parallelism/sdp.yaml says what every value does)."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    level: str = key(choices=LEVELS)
    """block: each residual block is a unit | neuron: (block, group) units."""
    masking: str = key(choices=MASKINGS)
    """forward: a worker runs only its subnetwork | backward: full forward, grads only for held parameters."""
    coverage: Number = key(above=0, at_most=1)
    """C in (0, 1]: each unit is held by round(C x world_size) workers."""
    assignment: str = key(choices=ASSIGNMENTS)
    """How units are placed on workers."""
    balance: Balance = field(default_factory=Balance)
    """assignment=balanced: resource weights."""
    groups: int = key(at_least=1)
    """Neuron level: every hidden width is split into this many groups."""
    resample_every: Optional[int] = key(at_least=1)
    """null: fixed plan | R: re-draw the plan every R steps."""
    redraw: str = key(choices=REDRAWS)
    """How a re-draw chooses the new plan."""
    refresh: str = key(choices=("holders", "global"))
    """Backward masking: broadcast from a holder | all-reduce over the world."""
    rescale: str = key(choices=("auto", "none", "eval", "train"))
    """How the branch magnitude of partly trained units is corrected (auto: resolved per model and protocol)."""
    drop_downsample: bool = flag()
    """A downsampling block is a unit (false: stays whole and shared)."""
    bucket_cap_mb: Number = key(above=0)
    """Gradient bucket size in MiB."""
    overlap: bool = flag()
    """All-reduce each holder-set bucket during backward (false: after backward)."""
    max_holder_sets: Optional[int] = key(at_least=1)
    """null: no cap | M: at most M process groups for holder sets (balanced assignment only)."""
    plan_seed: int = key(at_least=0)
    """Seed of random assignment and of plan re-draws."""
    calibrate_steps: int = key(at_least=0)
    """0: off | S: after training, fit one scalar gate per residual branch of the assembled model for S steps."""
    calibrate_lr: Number = key(at_least=0)
    """Adam's learning rate on the gates (0: gates stay at their initial value, the rescale factor)."""
    consolidate: Optional[float] = key(above=0, at_most=1)
    """null: off | f in (0, 1]: the last f of the FLOP budget trains the assembled model with backward masking and
    activation checkpointing (:mod:`sdp.parallel.sdp_consolidate`); 1: from the first step."""
    distill_alpha: Number = key(at_least=0, at_most=1)
    """During consolidation: loss = (1 - alpha) CE + alpha KL(own subnetwork frozen at the switch || model)."""
    consolidate_survival: Number = key(above=0, at_most=1)
    """During consolidation: each rank runs each block with this probability per step, unscaled (LayerDrop); 1: all."""
    consolidate_average: str = key(choices=AVERAGES)
    """During consolidation: a block's gradient averaged over its holders | over all ranks (held blocks keep it)."""


def resolve_rescale(*, cfg: DictConfig, eval_bn: str, model: SDPModel) -> str:
    """``parallelism.rescale`` with ``auto`` resolved (see conf/parallelism/sdp.yaml): ``none`` under
    backward masking; ``none`` at neuron level when every unit's branch ends in a normalisation layer
    and the protocol re-estimates it on the assembled model (the norm then restores the widened
    branch's trained magnitude, so k/n would shrink it: measured, benchmarks/eval_protocols.py);
    ``eval`` otherwise (block level: a dropped branch contributes nothing, stochastic-depth rule)."""
    if cfg.rescale != "auto":
        return str(cfg.rescale)
    if cfg.masking == "backward":
        return "none"
    units = [block for _, block in model.sdp_units()]
    if cfg.level == "neuron" and eval_bn == "reestimate" and units and all(b.normalised_branch for b in units):
        return "none"
    return "eval"


def validate(*, cfg: DictConfig, world_size: int) -> None:
    """The body of :meth:`SDPSpec.validate <sdp.parallel.sdp.SDPSpec.validate>`: the ``parallelism`` node ``cfg``
    (each key's own type, choice and range: :class:`SDPConfig`'s, checked before), the rules of several keys or
    of the world: k >= 1 holders of
    ``parallelism.coverage`` on ``world_size`` workers (:func:`holders`), the re-draw, refresh and rescale rules
    of each masking, the cap's assignment and the balance weights; the plan itself is :func:`prepare`'s."""
    holders(cfg=cfg, world_size=world_size)
    require(cfg.get("redraw") != "rolling" or cfg.get("max_holder_sets") is None, "parallelism.max_holder_sets",
            cfg.get("max_holder_sets"), "null with parallelism.redraw=rolling (its windows fix the holder sets)")
    require(cfg.masking == "backward" or cfg.refresh == "holders", "parallelism.refresh", cfg.refresh,
            "global refresh exists only for masking=backward (forward masking keeps no non-held values)")
    require(cfg.masking == "forward" or cfg.rescale in ("none", "auto"), "parallelism.rescale", cfg.rescale,
            "backward masking runs the full model in every forward, so only none (or auto) is meaningful")
    consolidation_rules(cfg=cfg)
    if cfg.get("max_holder_sets") is not None:
        require(str(cfg.assignment) == "balanced", "parallelism.max_holder_sets", cfg.max_holder_sets,
                f"caps the balanced assignment only (parallelism.assignment={cfg.assignment!r}): set assignment=balanced")
    b = cfg.balance  # each weight >= 0 is its field's; a key added with `+` and all-zero weights are the node's
    require(isinstance(b, DictConfig) and set(b) == set(BALANCE_KEYS), "parallelism.balance",
            b, f"a mapping with exactly the keys {', '.join(BALANCE_KEYS)}")
    require(any(b[r] for r in BALANCE_KEYS), "parallelism.balance", b, "at least one weight > 0")
    if int(cfg.get("calibrate_steps") or 0):  # assembly calibration (sdp/parallel/sdp_calibrate.py)
        for name, value, allowed in (("level", cfg.level, "block"), ("masking", cfg.masking, "forward")):
            require(value == allowed, f"parallelism.{name}", value, f"{allowed} with parallelism.calibrate_steps="
                    f"{cfg.calibrate_steps} (calibration gates the assembled model's blocks, which only "
                    "block-level forward masking assembles; 0 turns it off)")


def consolidation_rules(*, cfg: DictConfig) -> None:
    """``parallelism.consolidate``, ``distill_alpha``, ``consolidate_survival`` and ``consolidate_average`` (each key's
    range is :class:`SDPConfig`'s): consolidation switches a forward-masked block-level run to backward masking, so it
    needs forward masking (backward masking already trains the assembled model) and block level (a neuron-level switch
    would re-split every narrowed tensor into held and frozen parts: not built), no re-draws (the switch fixes the
    plan's holders for the rest of the run), and a distillation weight, a survival below 1 or world averaging needs a
    consolidation phase to act in. ``cfg.get``: configs recorded before the keys existed read as off."""
    f, alpha = cfg.get("consolidate"), float(cfg.get("distill_alpha") or 0)
    require(f is None or 0 < float(f) <= 1, "parallelism.consolidate", f, "null or a number in (0, 1]")
    require(0 <= alpha <= 1, "parallelism.distill_alpha", alpha, "a number in [0, 1]")
    require(f is not None or alpha == 0, "parallelism.distill_alpha", alpha,
            "0 without parallelism.consolidate (the teacher is frozen at the consolidation switch): set consolidate")
    q = float(cfg.get("consolidate_survival", 1.0))
    require(f is not None or q == 1, "parallelism.consolidate_survival", q,
            "1 without parallelism.consolidate (blocks are dropped during consolidation only): set consolidate")
    average = average_of(cfg)
    require(f is not None or average == "holders", "parallelism.consolidate_average", average,
            "holders without parallelism.consolidate (it says how consolidation averages): set consolidate")
    if f is None:
        return
    require(str(cfg.masking) == "forward", "parallelism.consolidate", f,
            f"null with parallelism.masking={cfg.masking} (backward masking already trains the assembled model)")
    require(str(cfg.level) == "block", "parallelism.consolidate", f,
            f"null at parallelism.level={cfg.level} (consolidation is built for block level only)")
    require(not cfg.get("resample_every"), "parallelism.consolidate", f,
            f"null with parallelism.resample_every={cfg.get('resample_every')} (re-draws and consolidation do not mix)")
    require(not int(cfg.get("calibrate_steps") or 0), "parallelism.consolidate", f,
            f"null with parallelism.calibrate_steps={cfg.get('calibrate_steps')} (calibration gates the assembled "
            "subnetworks of a forward-masked run; after consolidation every rank trains the full model: not built)")


def holders(*, cfg: DictConfig, world_size: int) -> int:
    """k = round(C n) from the ``parallelism`` node alone (:func:`sdp.subnet.plan.num_holders`, the rule the
    plan is built with, which also refuses a C outside (0, 1] where no schema checked it: a budget or report
    asked outside the driver), a ConfigError naming ``parallelism.coverage`` when it gives no holder; where the
    driver's plan exists, its ``k`` is read instead."""
    try:
        return num_holders(coverage=float(cfg.coverage), world_size=world_size)
    except PlanError as exc:
        raise ConfigError(str(exc)) from None


def prepare(*, cfg: DictConfig, job: JobFacts, model: SDPModel) -> Plan:
    """The body of :meth:`SDPSpec.prepare <sdp.parallel.sdp.SDPSpec.prepare>`: the plan of the ``parallelism``
    node ``cfg`` on ``job``'s workers for ``model`` (built on the meta device), drawn once in the driver; an
    impossible plan is a ConfigError in the plan's own words with the job's model name, and a degenerate one
    (k = 1, disconnected workers) is warned about once, before any rank starts."""
    try:
        plan = plan_for(model=model, cfg=cfg, world_size=job.world_size)
    except PlanError as exc:
        raise ConfigError(f"{exc} (model={job.model_name or type(model).__name__})") from None
    if int(cfg.get("calibrate_steps") or 0):
        require(bool(calibratable(model)), "parallelism.calibrate_steps", cfg.calibrate_steps,
                f"0 for model={job.model_name or type(model).__name__}: calibration needs a model evaluated part by part "
                "(no tied weights) whose every unit declares its gated residual branches")
    warn_degenerate(plan)
    return plan


def calibratable(model: SDPModel) -> bool:
    """Whether assembly calibration can run on ``model``: its forward is ``head(blocks(stem(x)))`` with no tensor
    tied across parts (:func:`sdp.subnet.assemble.partwise_names`) and every unit declares the branches a gate
    folds into (:meth:`sdp.models.base.ResidualBlock.gated_branches`)."""
    units = model.sdp_units()
    return bool(partwise_names(model)) and bool(units) and all(b.gated_branches() for _, b in units)


def plan_keys(cfg: DictConfig) -> str:
    """The keys that decide the plan, as ``key=value`` (what a refused resume names)."""
    return ", ".join(f"{k}={cfg[k]}" for k in ("level", "coverage", "assignment", "balance", "groups", "plan_seed", "resample_every"))
