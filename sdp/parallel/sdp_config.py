"""SDP's keys under ``parallelism``: what is checked before any rank starts, the plan drawn once in the
driver, and ``rescale=auto`` resolved.

Apart from :mod:`sdp.parallel.sdp` (the strategy that runs on the ranks) because they run on the config
and the driver's meta model: :meth:`SDPSpec.validate <sdp.parallel.sdp.SDPSpec.validate>` runs
:func:`validate` on the keys, :meth:`SDPSpec.prepare <sdp.parallel.sdp.SDPSpec.prepare>` runs :func:`prepare`
(the plan, from the model built once on the meta device, so an impossible plan is refused before any rank
starts and every rank trains the very plan the driver checked and predicted), and :func:`resolve_rescale`
turns ``parallelism.rescale=auto`` into the rule the ranks apply.
"""

from __future__ import annotations

from omegaconf import DictConfig

from sdp.errors import ConfigError, boolean, one_of, positive_float, positive_int, require, unit_interval
from sdp.models.base import SDPModel
from sdp.parallel.job import Job
from sdp.parallel import sdp_plan
from sdp.parallel.sdp_plan import BALANCE_KEYS, plan_for
from sdp.subnet.plan import ASSIGNMENTS, LEVELS, REDRAWS, Plan, PlanError, num_holders, warn_degenerate


RESCALES = ("auto", "none", "eval", "train")


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
    """The body of :meth:`SDPSpec.validate <sdp.parallel.sdp.SDPSpec.validate>`: every key of the ``parallelism``
    node ``cfg`` (``parallelism.coverage``: k >= 1 holders on ``world_size`` workers, :func:`holders`); the
    plan itself is :func:`prepare`'s."""
    one_of("parallelism.level", cfg.level, LEVELS)
    one_of("parallelism.masking", cfg.masking, sdp_plan.MASKINGS)
    holders(cfg=cfg, world_size=world_size)
    one_of("parallelism.assignment", cfg.assignment, ASSIGNMENTS)
    positive_int("parallelism.groups", cfg.groups)
    require(cfg.resample_every is None or (isinstance(cfg.resample_every, int) and cfg.resample_every >= 1),
            "parallelism.resample_every", cfg.resample_every, "null (fixed plan) or an integer >= 1")
    one_of("parallelism.redraw", cfg.get("redraw", "relabel"), REDRAWS)  # absent from configs written before it
    require(cfg.get("redraw") != "rolling" or cfg.get("max_holder_sets") is None, "parallelism.max_holder_sets",
            cfg.get("max_holder_sets"), "null with parallelism.redraw=rolling (its windows fix the holder sets)")
    one_of("parallelism.refresh", cfg.refresh, ("holders", "global"))
    require(cfg.masking == "backward" or cfg.refresh == "holders", "parallelism.refresh", cfg.refresh,
            "global refresh exists only for masking=backward (forward masking keeps no non-held values)")
    one_of("parallelism.rescale", cfg.rescale, RESCALES)
    require(cfg.masking == "forward" or cfg.rescale in ("none", "auto"), "parallelism.rescale", cfg.rescale,
            "backward masking runs the full model in every forward, so only none (or auto) is meaningful")
    require(isinstance(cfg.drop_downsample, bool), "parallelism.drop_downsample", cfg.drop_downsample, "true or false")
    positive_float("parallelism.bucket_cap_mb", cfg.bucket_cap_mb)
    boolean("parallelism.overlap", cfg.overlap)
    positive_int("parallelism.plan_seed", cfg.plan_seed, minimum=0)
    if cfg.get("max_holder_sets") is not None:
        positive_int("parallelism.max_holder_sets", cfg.max_holder_sets)
        require(str(cfg.assignment) == "balanced", "parallelism.max_holder_sets", cfg.max_holder_sets,
                f"caps the balanced assignment only (parallelism.assignment={cfg.assignment!r}): set assignment=balanced")
    b = cfg.balance
    require(isinstance(b, DictConfig) and set(b) == set(BALANCE_KEYS), "parallelism.balance",
            b, f"a mapping with exactly the keys {', '.join(BALANCE_KEYS)}")
    for r in BALANCE_KEYS:
        positive_float(f"parallelism.balance.{r}", b[r], allow_zero=True)
    require(any(b[r] for r in BALANCE_KEYS), "parallelism.balance", b, "at least one weight > 0")


def holders(*, cfg: DictConfig, world_size: int) -> int:
    """k = round(C n) from the ``parallelism`` node alone (:func:`sdp.subnet.plan.num_holders`, the rule the
    plan is built with), a ConfigError naming ``parallelism.coverage`` when it gives no holder; where the
    driver's plan exists, its ``k`` is read instead."""
    unit_interval("parallelism.coverage", cfg.coverage)
    try:
        return num_holders(coverage=float(cfg.coverage), world_size=world_size)
    except PlanError as exc:
        raise ConfigError(str(exc)) from None


def prepare(*, cfg: DictConfig, job: Job, model: SDPModel) -> Plan:
    """The body of :meth:`SDPSpec.prepare <sdp.parallel.sdp.SDPSpec.prepare>`: the plan of the ``parallelism``
    node ``cfg`` on ``job``'s workers for ``model`` (built on the meta device), drawn once in the driver; an
    impossible plan is a ConfigError in the plan's own words with the job's model name, and a degenerate one
    (k = 1, disconnected workers) is warned about once, before any rank starts."""
    try:
        plan = plan_for(model=model, cfg=cfg, world_size=job.world_size)
    except PlanError as exc:
        raise ConfigError(f"{exc} (model={job.model_name or type(model).__name__})") from None
    warn_degenerate(plan)
    return plan


def plan_keys(cfg: DictConfig) -> str:
    """The keys that decide the plan, as ``key=value`` (what a refused resume names)."""
    return ", ".join(f"{k}={cfg[k]}" for k in ("level", "coverage", "assignment", "balance", "groups", "plan_seed", "resample_every"))
