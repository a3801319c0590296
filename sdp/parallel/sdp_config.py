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

from sdp.driver.fields import conform
from sdp.driver.schema_parallel import SDP
from sdp.errors import ConfigError, require
from sdp.models.base import SDPModel
from sdp.parallel.job import JobFacts
from sdp.parallel.sdp_plan import BALANCE_KEYS, plan_for
from sdp.subnet.plan import Plan, PlanError, num_holders, warn_degenerate


RESCALES = ("auto", "none", "eval", "train")  # what resolve_rescale acts on (the schema's choices: a test keeps them equal)


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
    held to its schema (:class:`sdp.driver.schema_parallel.SDP`: every key's type, choice and range, one place;
    :func:`sdp.driver.fields.conform`), then the rules of several keys or of the world: k >= 1 holders of
    ``parallelism.coverage`` on ``world_size`` workers (:func:`holders`), the re-draw, refresh and rescale rules
    of each masking, the cap's assignment and the balance weights; the plan itself is :func:`prepare`'s."""
    conform(cfg, schema=SDP, prefix="parallelism")
    holders(cfg=cfg, world_size=world_size)
    require(cfg.get("redraw") != "rolling" or cfg.get("max_holder_sets") is None, "parallelism.max_holder_sets",
            cfg.get("max_holder_sets"), "null with parallelism.redraw=rolling (its windows fix the holder sets)")
    require(cfg.masking == "backward" or cfg.refresh == "holders", "parallelism.refresh", cfg.refresh,
            "global refresh exists only for masking=backward (forward masking keeps no non-held values)")
    require(cfg.masking == "forward" or cfg.rescale in ("none", "auto"), "parallelism.rescale", cfg.rescale,
            "backward masking runs the full model in every forward, so only none (or auto) is meaningful")
    if cfg.get("max_holder_sets") is not None:
        require(str(cfg.assignment) == "balanced", "parallelism.max_holder_sets", cfg.max_holder_sets,
                f"caps the balanced assignment only (parallelism.assignment={cfg.assignment!r}): set assignment=balanced")
    b = cfg.balance  # each weight >= 0 is its field's; a key added with `+` and all-zero weights are the node's
    require(isinstance(b, DictConfig) and set(b) == set(BALANCE_KEYS), "parallelism.balance",
            b, f"a mapping with exactly the keys {', '.join(BALANCE_KEYS)}")
    require(any(b[r] for r in BALANCE_KEYS), "parallelism.balance", b, "at least one weight > 0")


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
    warn_degenerate(plan)
    return plan


def plan_keys(cfg: DictConfig) -> str:
    """The keys that decide the plan, as ``key=value`` (what a refused resume names)."""
    return ", ".join(f"{k}={cfg[k]}" for k in ("level", "coverage", "assignment", "balance", "groups", "plan_seed", "resample_every"))
