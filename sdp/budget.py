"""Training budgets: how many steps a run takes so that methods are compared at equal cost.

``train.budget`` (resolved once in the driver, before any rank starts; ``train.steps`` is then set to
the result and recorded in ``config.yaml``, the details in ``summary.json["budget"]``):

- ``iterations``: ``train.steps`` for every method (the reviewers' same-iteration comparison);
- ``flops``: ``train.steps`` is the DDP step count; a method that computes a fraction ``r`` of the full
  model's FLOPs per step runs ``round(train.steps / r)`` steps, as the paper's FLOP matching extends
  training by 1/C. ``train.flops_ratio=coverage`` takes ``r = C`` (the paper's rule); ``measured``
  takes ``r`` from the model's FLOP count (see :func:`compute_fraction`). ``C`` is the fraction of the
  model's units a worker computes per step (:func:`unit_fraction`): for SDP the realised ``k / n``
  (k = round(``parallelism.coverage`` x n) holders per unit, so C = 0.3 on 4 workers is k = 1, C = 0.25),
  the mean survival probability (``parallelism.survival_prob``, ``decay``) for stochastic depth and
  LayerDrop, which skip a dropped block's forward and backward like forward masking -- so a drop
  baseline at ``survival_prob = p`` with ``decay = uniform`` is FLOP-matched exactly like SDP at
  ``C = p``. A strategy with neither key (DDP, DDP+AC, FSDP, pipeline) computes the full model:
  ``r = 1`` (activation checkpointing's recomputation is not counted: budgets count model FLOPs);
- ``tokens``: ``ceil(train.tokens / (global batch x sequence length))`` steps for every method.

What we count as training FLOPs: ``steps x global batch x flops_per_sample x r_measured``, where
``flops_per_sample`` is the full model's forward + backward FLOPs of one sample
(:meth:`SDPModel.flops_per_sample`) and ``r_measured`` the fraction of it the workers compute on
average (1 without coverage). Under forward masking a worker runs the shared parts (stem, head,
projection shortcuts) in full and holds a fraction C of every masked unit (block level: C of the
blocks, each held by k = C·n workers; neuron level: C of each block's hidden width, which scales both
of a block's layers by C), so ``r = (F_shared + C·F_masked) / F_total``. Under backward masking the
forward and the input-gradient half of backward are full and only the weight-gradient third is
masked: ``r = (2 + r_forward) / 3``. Only what ``torch.utils.flop_counter`` counts enters
(matmuls, convolutions, attention; not norms or elementwise ops).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig

from sdp.errors import ConfigError, one_of, positive_int, require
from sdp.registry import build

BUDGETS = ("iterations", "flops", "tokens")
FLOPS_RATIOS = ("coverage", "measured")
MASKINGS = ("forward", "backward")
SEQ_LEN_KEYS = ("dataset.seq_len", "model.seq_len", "model.max_seq_len")


def masked_fraction(*, counts: dict[str, int], model: Any) -> float:
    """Share of the forward FLOPs spent in the residual branches of SDP units (the masked part)."""
    prefix = type(model).__name__
    total = counts["Global"]
    if total <= 0:
        return 0.0
    masked = 0
    for i, block in model.sdp_units():
        name = f"{prefix}.blocks.{i}"
        shared = sum(counts.get(f"{name}.{s}", 0) for s in block.shared_submodules())
        masked += counts.get(name, 0) - shared
    assert 0 <= masked <= total, f"masked FLOPs {masked} outside [0, total {total}]"
    return masked / total


def compute_fraction(*, masked: float, coverage: float, masking: str) -> float:
    """Fraction of the full model's training FLOPs computed on average by one worker (see module doc)."""
    forward = (1.0 - masked) + coverage * masked
    if masking == "forward":
        return forward
    if masking == "backward":
        return (2.0 + forward) / 3.0
    raise ValueError(f"parallelism.masking={masking!r} not in {MASKINGS}")


def unit_fraction(cfg: DictConfig, *, n_units: int | None) -> tuple[float | None, str | None]:
    """(fraction of the model's units one worker computes per step on average, the key it comes from).

    SDP declares it (``parallelism.coverage``), realised as k / n with k = round(C x n) holders per
    unit (:func:`sdp.subnet.plan.num_holders`, the rule the plan is built with); stochastic depth / LayerDrop draw each block with its
    survival probability, so the expected fraction is the mean of
    :func:`sdp.parallel.ddp_drop.survival_probs` (``p`` itself under ``decay=uniform``; the linear decay's
    mean needs the number of blocks ``n_units``). ``(None, None)``: the strategy runs the whole model.
    """
    coverage = _get(cfg, "parallelism.coverage")
    if coverage is not None:
        from sdp.subnet.plan import PlanError, num_holders

        require(isinstance(coverage, (int, float)) and not isinstance(coverage, bool), "parallelism.coverage",
                coverage, "must be a number in (0, 1]")
        world = int(cfg.cluster.world_size)
        try:
            return num_holders(coverage=float(coverage), world_size=world) / world, "parallelism.coverage"
        except PlanError as exc:
            raise ConfigError(str(exc)) from None
    p = _get(cfg, "parallelism.survival_prob")
    if p is None:
        return None, None
    from sdp.parallel.ddp_drop import survival_probs  # lazy: the strategy package imports torch.distributed

    require(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1, "parallelism.survival_prob", p,
            "must be a number in (0, 1]")
    decay = str(_get(cfg, "parallelism.decay") or "uniform")
    if decay == "uniform":
        return float(p), "parallelism.survival_prob"
    require(n_units is not None and n_units > 0, "parallelism.decay", decay,
            "needs the model's block count, which could not be counted; use decay=uniform")
    probs = survival_probs(n=int(n_units), p=float(p), decay=decay)
    return sum(probs) / len(probs), "parallelism.survival_prob"


def _get(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return node


def model_flops(cfg: DictConfig) -> tuple[int | None, float | None, int | None, str | None]:
    """(training FLOPs per sample of the full model, masked share, number of units, why not) from a
    meta-device build."""
    from sdp.models.base import forward_flop_counts

    try:
        with torch.device("meta"):
            model = build(cfg.model)
            per_sample = int(model.flops_per_sample())
            masked = masked_fraction(counts=forward_flop_counts(model), model=model)
            n_units = len(model.sdp_units())
    except Exception as exc:  # noqa: BLE001 - FLOPs are a record, not a reason to fail a run
        return None, None, None, f"{type(exc).__name__}: {exc}"
    return per_sample, masked, n_units, None


def resolve_steps(cfg: DictConfig) -> tuple[int, dict[str, Any]]:
    """The number of optimizer steps ``cfg`` asks for under its budget, and what was counted.

    Pure in the config (the model is built on the meta device only to count FLOPs); raises
    :class:`ConfigError` naming the key for an impossible budget.
    """
    tc = cfg.train
    budget = str(tc.get("budget", "iterations"))
    one_of("train.budget", budget, BUDGETS)
    base = int(tc.steps)
    per_sample, masked, n_units, flops_error = model_flops(cfg)
    coverage, coverage_key = unit_fraction(cfg, n_units=n_units)
    masking = str(_get(cfg, "parallelism.masking") or "forward")  # drop baselines skip like forward masking
    if coverage is not None:
        require(isinstance(coverage, (int, float)) and 0 < coverage <= 1, coverage_key, coverage,
                "must be a number in (0, 1]")
        one_of("parallelism.masking", masking, MASKINGS)
    global_batch = int(tc.batch_size) * int(cfg.cluster.world_size)
    fraction = 1.0
    if coverage is not None:
        fraction = compute_fraction(masked=masked, coverage=float(coverage), masking=masking) if masked is not None else None
    info: dict[str, Any] = {"budget": budget, "base_steps": base, "global_batch": global_batch,
                            "coverage": coverage, "coverage_key": coverage_key,
                            "coverage_nominal": _get(cfg, coverage_key) if coverage_key else None,
                            "masking": masking if coverage is not None else None,
                            "flops_per_sample": per_sample, "fraction_computed": fraction}
    if budget == "iterations":
        steps, ratio = base, 1.0
    elif budget == "flops":
        mode = str(tc.get("flops_ratio", "coverage"))
        one_of("train.flops_ratio", mode, FLOPS_RATIOS)
        if coverage is None:
            ratio = 1.0
        elif mode == "coverage":
            ratio = float(coverage)
        else:
            require(fraction is not None, "train.flops_ratio", mode,
                    f"the model's FLOPs could not be counted ({flops_error}); use train.flops_ratio=coverage")
            ratio = float(fraction)
        steps = max(1, round(base / ratio))
        info["flops_ratio"] = mode
    else:
        tokens = tc.get("tokens")
        positive_int("train.tokens", tokens)
        seq_key = next((k for k in SEQ_LEN_KEYS if _get(cfg, k) is not None), None)
        if seq_key is None:
            raise ConfigError(f"train.budget='tokens' needs a sequence length; none of {SEQ_LEN_KEYS} is set")
        seq_len = int(_get(cfg, seq_key))
        steps, ratio = math.ceil(int(tokens) / (global_batch * seq_len)), 1.0
        info.update(tokens=int(tokens), seq_len=seq_len, tokens_trained=steps * global_batch * seq_len)
    info.update(steps=steps, step_ratio=ratio)
    if per_sample is not None and fraction is not None:
        info["flops_per_step"] = global_batch * per_sample * fraction
        info["total_flops"] = steps * info["flops_per_step"]
    else:
        info["flops_per_step"] = info["total_flops"] = None
        info["flops_note"] = flops_error or "fraction unknown"
    return steps, info
