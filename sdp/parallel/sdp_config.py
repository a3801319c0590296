"""SDP's keys under ``parallelism``: what is checked before any rank starts, and ``rescale=auto`` resolved.

Apart from :mod:`sdp.parallel.sdp` (the strategy that runs on the ranks) because both run on the
config alone: :meth:`SDPStrategy.validate <sdp.parallel.sdp.SDPStrategy.validate>` runs :func:`validate`
in the driver (building the model on the meta device to draw its plan once, so an impossible plan is
refused before any rank starts), and :func:`resolve_rescale` turns ``parallelism.rescale=auto`` into the
rule the ranks apply, from the model's declarations and the evaluation protocol.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from sdp.errors import ConfigError, boolean, one_of, positive_float, positive_int, require
from sdp.models.base import SDPModel
from sdp.parallel import sdp_plan
from sdp.parallel.base import Strategy
from sdp.parallel.sdp_plan import BALANCE_KEYS, plan_for
from sdp.registry import build
from sdp.subnet.plan import ASSIGNMENTS, LEVELS, REDRAWS, PlanError


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


def validate(*, strategy: type[Strategy], cfg: DictConfig, full_cfg: DictConfig, world_size: int) -> None:
    """The body of :meth:`SDPStrategy.validate <sdp.parallel.sdp.SDPStrategy.validate>` (``strategy``: the class
    it was called on, whose :meth:`~sdp.parallel.base.Strategy.coverage` checks ``parallelism.coverage``)."""
    one_of("parallelism.level", cfg.level, LEVELS)
    one_of("parallelism.masking", cfg.masking, sdp_plan.MASKINGS)
    strategy.coverage(cfg=cfg, world_size=world_size, n_units=None)
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
    root = full_cfg  # the plan needs the model declarations
    if "model" in root:
        node = OmegaConf.create(OmegaConf.to_container(root.model, resolve=True))  # resolve against the root
        with torch.device("meta"):
            model = build(node)
        try:
            from sdp.subnet.plan import warn_degenerate  # k = 1, disconnected workers: warned once, before any rank

            warn_degenerate(plan_for(model=model, cfg=cfg, world_size=world_size))
        except PlanError as exc:  # the plan's own words, with the config's model name
            raise ConfigError(f"{exc} (model={node.get('name', type(model).__name__)})") from None
