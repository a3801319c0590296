"""Training budgets: how many steps a run takes so that methods are compared at equal cost.

``train.budget`` (resolved once in the driver, before any rank starts; ``train.steps`` is then set to
the result and recorded in ``config.yaml``, the details in ``summary.json["budget"]``):

- ``iterations``: ``train.steps`` for every method (the reviewers' same-iteration comparison);
- ``flops``: ``train.steps`` is the DDP step count; a method that computes a fraction ``r`` of the full
  model's FLOPs per step runs ``round(train.steps / r)`` steps, as the paper's FLOP matching extends
  training by 1/C. ``train.flops_ratio=coverage`` takes ``r = C`` (the paper's rule); ``measured``
  takes ``r`` from the model's FLOP count. ``train.flops_reference`` (null: the run's own model) names
  another model, as overrides of ``model`` (``{n_layers: 8}``), whose DDP step count ``train.steps`` is:
  ``r`` is then multiplied by (the run's model's FLOPs per sample / the reference's), so a 2-block DDP
  matched to an 8-block reference runs about 4x the steps (:func:`reference_flops`; why: a depth
  comparison, or a small dense model against SDP, must spend the reference model's FLOPs, not its own). Both come from the strategy
  (:meth:`sdp.parallel.spec.StrategySpec.coverage`: ``C`` is the realised fraction of the model's units a
  worker computes per step, e.g. the driver's SDP plan's k / n, a mean survival probability for a drop
  baseline; :meth:`~sdp.parallel.spec.StrategySpec.flops_fraction`: the measured ``r``). A strategy without a
  coverage computes the full model: ``r = 1`` (activation recomputation is not counted: budgets count
  model FLOPs; ``recompute_flops_per_step`` records it apart, a forward of the checkpointed blocks' share, for
  the step time). A phase a strategy runs after its last training step
  (:meth:`~sdp.parallel.spec.StrategySpec.post_training`: SDP's assembly calibration, whose every forward,
  recomputation included, it declares) is charged: the training steps shrink by its FLOPs over one training
  step's (:func:`post_training_steps`), recorded in ``summary.json["budget"]["post_training"]``;
- ``tokens``: ``ceil(train.tokens / (global batch x sequence length))`` steps for every method.

A strategy with a second training phase (:meth:`sdp.parallel.spec.StrategySpec.later_phase`: SDP's consolidation,
``parallelism.consolidate=f``) spends the last share ``f`` of the budget at that phase's own FLOP fraction per step
(recomputation and any extra forward included): each phase's step count comes from the model's FLOP count
(:func:`split_phases`), ``train.steps`` is their sum, ``summary.json["budget"]["phases"]`` records each (name, steps,
the step it starts at, FLOP fraction, share) and the ranks switch at the first phase's end
(:attr:`sdp.parallel.job.JobFacts.phase_steps`); ``flops_per_step`` is then the run's mean.

The schedule keeps its shape (:func:`apply`): every step-denominated schedule key (:data:`SCALED_KEYS`:
the LR warm-up, the evaluation and checkpoint cadences) is scaled by the same factor ``1 / r`` as the
steps, so DDP and a method running twice its steps reach the peak LR, evaluate and checkpoint at the same
fractions of their runs, up to whole steps (the LR decay already spans the resolved ``train.steps``). The
factor is computed here once; the scaled values are what ``config.yaml`` records and every rank reads, the
values asked for are in ``summary.json["budget"]["schedule"]``. Not scaled: ``train.warmup_steps``
(start-up steps left out of the time medians: a cost in steps, not a share of the run),
``train.log_every`` (a row stands for the steps since the last one wherever it is read),
``train.eval_points`` (already a share of the run).

What we count as training FLOPs: ``steps x global batch x flops_per_sample x r_measured``, where
``flops_per_sample`` is the full model's forward + backward FLOPs of one sample
(:meth:`SDPModel.flops_per_sample`) and ``r_measured`` the strategy's fraction of it, given the share
of each block's forward FLOPs its workers run, per unit level (block: the unit branches; neuron: the split
sub-branches, :func:`sdp.metrics.flops.block_shares`), weighed by what the strategy's plan runs of each block
(:func:`sdp.metrics.flops.forward_fraction`: SDP's units and their holders, so a block the plan keeps whole,
``drop_downsample=false``, counts in full). Only
what ``torch.utils.flop_counter`` counts enters (matmuls, convolutions, attention; not norms or
elementwise ops). This module names no strategy.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from sdp.core.fields import choices_of
from sdp.driver.schema import Train
from sdp.errors import ConfigError, one_of, positive_int, require
from sdp.metrics.flops import BlockShare, unit_shares
from sdp.models.base import forward_flop_counts
from sdp.parallel import STRATEGIES
from sdp.parallel.ac import recompute_share
from sdp.parallel.job import JobFacts, ac_every, ac_mode
from sdp.registry import build

SEQ_LEN_KEYS = ("dataset.seq_len", "model.seq_len", "model.max_seq_len")
# Step-denominated schedule keys, scaled with the step count (0, "never" or "only at the end", stays 0).
SCALED_KEYS = ("optim.warmup_steps", "train.eval_every", "train.checkpoint_every")


def _get(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return node


def model_flops(cfg: DictConfig, *, model: Any = None) -> tuple[int | None, dict[str, dict[int, BlockShare]] | None, int | None, str | None]:
    """(training FLOPs per sample of the full model, each block's shares of the forward FLOPs per unit level,
    number of units, why not) from ``model``, the driver's meta-device build (:class:`sdp.driver.preflight.Preflight`),
    or, asked outside the driver (None), a meta build of ``cfg.model`` of its own."""
    try:
        with torch.device("meta"):
            model = model if model is not None else build(cfg.model)
            per_sample = int(model.flops_per_sample())
            shares = unit_shares(counts=forward_flop_counts(model), model=model)
            n_units = len(model.sdp_units())
    except Exception as exc:  # noqa: BLE001 - FLOPs are a record, not a reason to fail a run
        return None, None, None, f"{type(exc).__name__}: {exc}"
    return per_sample, shares, n_units, None


def reference_flops(cfg: DictConfig, *, own: int | None) -> tuple[float, dict[str, Any] | None]:
    """(the run's model's FLOPs per sample / the reference model's, what ``summary.json["budget"]`` records of it)
    for ``train.flops_reference`` (:mod:`this module's docstring <sdp.driver.budget>`): (1.0, None) when it is null.
    The reference is ``cfg.model`` with the node's keys replaced, built on the meta device and counted as the run's
    own model is (:func:`model_flops`); a key ``cfg.model`` does not have, or a reference that cannot be counted, is
    refused naming the key."""
    ref = OmegaConf.select(cfg, "train.flops_reference")
    if ref is None:
        return 1.0, None
    overrides = OmegaConf.to_container(ref, resolve=True) if isinstance(ref, DictConfig) else ref
    require(isinstance(overrides, dict) and bool(overrides), "train.flops_reference", overrides,
            "a non-empty node of model keys to change, e.g. {n_layers: 8} (null: the run's own model)")
    require(str(cfg.train.budget) == "flops", "train.flops_reference", overrides, "needs train.budget=flops")
    unknown = sorted(k for k in overrides if k not in cfg.model)
    require(not unknown, "train.flops_reference", overrides, f"keys not in model ({unknown}); allowed: {sorted(cfg.model)}")
    ref_cfg = OmegaConf.merge(cfg, {"model": overrides})
    ref_per_sample, _, _, why = model_flops(ref_cfg)
    require(ref_per_sample is not None and own is not None, "train.flops_reference", overrides,
            f"the FLOPs of the run's model ({own}) and of the reference ({ref_per_sample}) must be countable ({why})")
    return own / ref_per_sample, {"model": overrides, "flops_per_sample": ref_per_sample}


def _prepared(cfg: DictConfig, *, spec: Any, preflight: Any) -> tuple[Any, Any]:
    """(model, what the strategy builds once for its ranks): the driver's (``preflight``), or asked outside the
    driver, a meta build of ``cfg.model`` and the strategy's own :meth:`~sdp.parallel.spec.StrategySpec.prepare`
    of it (SDP: the plan the driver would draw), so the FLOP fraction is the plan's there too; (None, None) when
    the model cannot be built (the FLOPs then say why)."""
    if preflight is not None:
        return preflight.model, preflight.prepared
    try:
        with torch.device("meta"):
            model = build(cfg.model)
    except Exception:  # noqa: BLE001 - model_flops records why
        return None, None
    return model, spec.prepare(cfg=cfg.parallelism, job=JobFacts.of(cfg), model=model)


def resolve_steps(cfg: DictConfig, *, preflight: Any = None) -> tuple[int, dict[str, Any]]:
    """The number of optimizer steps ``cfg`` asks for under its budget, and what was counted.

    Pure in the config and ``preflight`` (:class:`sdp.driver.preflight.Preflight`, what validation built: its
    meta-device model counts FLOPs, the strategy's prepared plan gives SDP's k and its FLOP fraction; None
    outside the driver: a meta build and the strategy's prepare of its own, :func:`_prepared`); raises
    :class:`ConfigError` naming the key for an impossible budget.
    """
    tc = cfg.train
    budget = str(tc.budget)
    one_of("train.budget", budget, choices_of(Train, "budget"))
    base = int(tc.steps)
    spec = STRATEGIES.get(str(cfg.parallelism.name))
    model, ready = _prepared(cfg, spec=spec, preflight=preflight)  # SDP: the plan (k, units, holders), shared with the ranks
    per_sample, shares, n_units, flops_error = model_flops(cfg, model=model)
    cov = spec.coverage(cfg=cfg.parallelism, world_size=int(cfg.cluster.world_size), n_units=n_units, prepared=ready)
    if cov is not None:
        require(cov.fraction is not None, cov.key, cov.value,
                f"needs the model's unit count to give the fraction computed, which could not be counted ({flops_error})")
    coverage = cov.fraction if cov is not None else None
    global_batch = int(tc.batch_size) * int(cfg.cluster.world_size)
    fraction: float | None = 1.0
    post = spec.post_training(cfg=cfg.parallelism)  # e.g. SDP's assembly calibration (post_training_steps)
    if cov is not None:
        fraction = (spec.flops_fraction(cfg=cfg.parallelism, coverage=cov, shares=shares, prepared=ready)
                    if shares is not None else None)
    info: dict[str, Any] = {"budget": budget, "base_steps": base, "global_batch": global_batch,
                            "coverage": coverage, "coverage_key": cov.key if cov else None,
                            "coverage_nominal": cov.value if cov else None,
                            "flops_per_sample": per_sample, "fraction_computed": fraction}
    to_reference, charged = 1.0, 0.0
    if budget != "flops":
        reference_flops(cfg, own=per_sample)  # refuses a reference under another budget
    if budget == "iterations":
        steps, ratio = base, 1.0
    elif budget == "flops":
        mode = str(tc.flops_ratio)
        one_of("train.flops_ratio", mode, choices_of(Train, "flops_ratio"))
        if coverage is None:
            ratio = 1.0
        elif mode == "coverage":
            ratio = float(coverage)
        else:
            require(fraction is not None, "train.flops_ratio", mode,
                    f"the model's FLOPs could not be counted ({flops_error}); use train.flops_ratio=coverage")
            ratio = float(fraction)
        to_reference, info["flops_reference"] = reference_flops(cfg, own=per_sample)
        charged = post_training_steps(post, step_ratio=ratio)  # a phase after training: its FLOPs come off the steps
        ratio *= to_reference
        steps = max(1, round(base / ratio - charged))
        info["flops_ratio"] = mode
    else:
        tokens = tc.tokens
        positive_int("train.tokens", tokens)
        seq_key = next((k for k in SEQ_LEN_KEYS if _get(cfg, k) is not None), None)
        if seq_key is None:
            raise ConfigError(f"train.budget='tokens' needs a sequence length; none of {SEQ_LEN_KEYS} is set")
        seq_len = int(_get(cfg, seq_key))
        steps, ratio = math.ceil(int(tokens) / (global_batch * seq_len)), 1.0
        info.update(tokens=int(tokens), seq_len=seq_len, tokens_trained=steps * global_batch * seq_len)
    later = spec.later_phase(cfg=cfg.parallelism, shares=shares, prepared=ready)
    if later is not None:  # two phases: each its step count, the schedule scaled to the whole run
        require(fraction is not None, "parallelism", str(cfg.parallelism.name),
                f"a second phase ({later.name}) needs the model's FLOPs per phase, which could not be counted ({flops_error})")
        info["phases"] = phases = split_phases(budget=budget, base=base, steps=steps, ratio=ratio, first=float(fraction),
                                               later=later, to_reference=to_reference, charged=charged)
        steps = sum(p["steps"] for p in phases)
        ratio = base / steps if budget == "flops" else ratio
    info.update(steps=steps, step_ratio=ratio)
    if post is not None:
        info["post_training"] = {"phase": post.name, "steps": post.steps, "step_fraction": post.step_fraction,
                                 "flops": post.steps * global_batch * per_sample * post.step_fraction if per_sample else None}
    if per_sample is not None and fraction is not None:
        run_fraction = (sum(p["steps"] * p["fraction_computed"] for p in info["phases"]) / steps
                        if later is not None else fraction)  # a two-phase run: the mean of its steps
        info["flops_per_step"] = global_batch * per_sample * run_fraction
        info["total_flops"] = steps * info["flops_per_step"] + (info["post_training"]["flops"] if post is not None else 0)
        # train.ac's recomputation, outside the budget (model FLOPs) but part of a step's time (sdp.bench.frontier)
        info["recompute_flops_per_step"] = info["flops_per_step"] * recompute_share(model=model, every=ac_every(cfg),
                                                                                  mode=ac_mode(cfg)) / 3.0
    else:
        info["flops_per_step"] = info["total_flops"] = info["recompute_flops_per_step"] = None
        info["flops_note"] = flops_error or "fraction unknown"
    return steps, info


def post_training_steps(post: Any, *, step_ratio: float) -> float:
    """The training steps a phase after training (``post``: :class:`sdp.parallel.spec.PostTraining` or None) costs
    under ``train.budget=flops``: its steps x its FLOPs per sample (a fraction of the full model's training FLOPs)
    over a training step's fraction ``step_ratio`` (r, before ``train.flops_reference``: both are of the run's own
    model), so training and the phase together spend what the budget's training alone would have."""
    return post.steps * post.step_fraction / step_ratio if post is not None else 0.0


def split_phases(*, budget: str, base: int, steps: int, ratio: float, first: float, later: Any,
                 to_reference: float, charged: float = 0.0) -> list[dict[str, Any]]:
    """The step count of each phase of a run with a second phase (``later``: :class:`sdp.parallel.spec.LaterPhase`,
    spending the last ``later.share`` of the FLOPs at ``later.fraction`` of DDP's per step; the first phase runs at
    ``first``). Under ``train.budget=flops`` each phase takes its share of DDP's ``base`` steps at its own rate: the
    first ``round((1 - share) base / ratio)`` (``ratio``: the one-phase run's step ratio, ``train.flops_ratio`` and
    ``train.flops_reference`` included), the second ``round(share base / (later.fraction x to_reference))`` (``to_reference``:
    :func:`reference_flops`'s ratio; a second phase has no coverage rule, ``train.flops_ratio=coverage`` leaves it
    measured). Under
    another budget the run's ``steps`` stay and the switch falls where the second phase has spent ``share`` of the
    run's FLOPs: ``s1 first = (1 - share)(s1 first + s2 later.fraction)``. ``charged``: the first phase's steps a
    phase after training costs (:func:`post_training_steps`), taken off the first phase. Each phase: name, steps,
    the 0-based step it starts at, its FLOP fraction and share."""
    share, rate = float(later.share), float(later.fraction)
    if budget == "flops":
        s1 = 0 if share >= 1 else max(1, round((1 - share) * base / ratio - charged))  # share 1: from the first step
        s2 = max(1, round(share * base / (rate * to_reference)))
    else:
        s1 = round(steps * (1 - share) * rate / ((1 - share) * rate + share * first))
        s2 = steps - s1
    require(s2 >= 1, "parallelism", f"{later.name} share {share}", f"a share that gives the phase a step ({steps} steps)")
    return [{"name": "train", "steps": s1, "start": 0, "fraction_computed": first, "flops_share": 1 - share},
            {"name": later.name, "steps": s2, "start": s1, "fraction_computed": rate, "flops_share": share}]


def scaled_schedule(cfg: DictConfig, *, step_ratio: float) -> dict[str, dict[str, int]]:
    """``{key: {"base": value asked for, "scaled": value run}}`` for every key of :data:`SCALED_KEYS`.

    ``scaled = ceil(base / step_ratio)`` (``step_ratio``: :func:`resolve_steps`'s ``info["step_ratio"]``, 1
    for DDP and for the iterations and tokens budgets, so their values are unchanged). Rounded up, not to
    the nearest step as ``train.steps`` is: a cadence rounded down can fit one evaluation more than DDP's
    run has, just before the last step; rounded up, never more (one fewer where no whole cadence fits
    DDP's count into the run, e.g. 10 in 72 steps: ``train.eval_points`` places exact fractions). 0 ("never" for
    checkpoints, "only at the end" for evaluations, no warm-up) stays 0."""
    out = {}
    for key in SCALED_KEYS:
        base = int(OmegaConf.select(cfg, key))
        # rounded to 1e-9 first: 3 / 0.3 is 10.000000000000002 in floating point, whose ceiling would be 11
        out[key] = {"base": base, "scaled": math.ceil(round(base / step_ratio, 9)) if base > 0 else 0}
    return out


def apply(cfg: DictConfig, *, preflight: Any = None) -> dict[str, Any]:
    """Resolve the budget into ``cfg`` (driver side, before ``config.yaml`` is written and the ranks start):
    ``train.steps`` and every key of :data:`SCALED_KEYS` take their resolved values; returns
    :func:`resolve_steps`'s info with ``schedule`` (:func:`scaled_schedule`) added, for ``summary.json``
    (``preflight``: what validation built, :func:`resolve_steps`)."""
    steps, info = resolve_steps(cfg, preflight=preflight)
    schedule = scaled_schedule(cfg, step_ratio=float(info["step_ratio"]))
    cfg.train.steps = steps
    for key, values in schedule.items():
        OmegaConf.update(cfg, key, values["scaled"], merge=False)
    info["schedule"] = schedule
    return info
