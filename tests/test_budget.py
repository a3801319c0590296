"""Budget arithmetic (iterations / flops / tokens), the FLOP count it rests on, and the experiment,
variant and scale configs composing at both scales."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

import sdp.driver.train
from sdp.driver.budget import model_flops, resolve_steps
from sdp.metrics.flops import masked_fraction
from sdp.parallel.sdp_plan import compute_fraction
from sdp.errors import ConfigError
from sdp.models.base import forward_flop_counts
from sdp.models.resnet import ResNetCIFAR
from tests.hydra_cfg import compose_config, sweep_params

CONF = Path(sdp.driver.train.CONF_DIR)


compose_with = compose_config


def with_coverage(cfg, coverage: float, masking: str = "forward"):
    """Pretend the strategy declares SDP keys (the SDP presets are on another branch)."""
    with open_dict(cfg):
        cfg.parallelism.coverage = coverage
        cfg.parallelism.masking = masking
    return cfg


def test_iterations_budget_keeps_steps_and_counts_flops():
    cfg = compose_with("model=mlp", "parallelism=ddp", "train.steps=40", "train.budget=iterations")
    steps, info = resolve_steps(cfg)
    assert steps == 40 and info["step_ratio"] == 1.0
    gb = cfg.train.batch_size * cfg.cluster.world_size
    assert info["total_flops"] == pytest.approx(40 * gb * info["flops_per_sample"])


def test_mlp_flops_per_sample_matches_closed_form():
    """3 x forward FLOPs of the linear layers: 2 x MACs, stem (in->dim), depth x (dim->hidden->dim), head."""
    cfg = compose_with("model=mlp")
    m = cfg.model
    d_in = cfg.dataset.channels * cfg.dataset.image_size**2
    macs = d_in * m.dim + m.depth * 2 * m.dim * m.hidden + m.dim * cfg.dataset.num_classes
    _, info = resolve_steps(cfg)
    assert info["flops_per_sample"] == 3 * 2 * macs


@pytest.mark.parametrize("coverage,expected", [(0.25, 160), (0.5, 80), (0.75, 53), (1.0, 40)])
def test_flops_budget_coverage_rule(coverage: float, expected: int):
    """On 8 workers every C here is realised exactly (k = 2, 4, 6, 8)."""
    cfg = with_coverage(compose_with("model=mlp", "train.steps=40", "train.budget=flops", "cluster.world_size=8"), coverage)
    steps, info = resolve_steps(cfg)
    assert steps == expected == max(1, round(40 / coverage)), info


def test_flops_budget_without_coverage_is_ddp_steps():
    steps, info = resolve_steps(compose_with("parallelism=ddp", "train.steps=40", "train.budget=flops"))
    assert steps == 40 and info["step_ratio"] == 1.0


def test_measured_ratio_counts_shared_parts_in_full():
    """ResNet: stem, head and projection shortcuts are shared, so the measured ratio exceeds C, and
    the measured FLOP-matched run is shorter than 1/C times."""
    cfg = with_coverage(compose_with("model=resnet18_cifar", "train.steps=100", "train.budget=flops",
                                     "train.flops_ratio=measured"), 0.5)
    steps, info = resolve_steps(cfg)
    with torch.device("meta"):
        model = ResNetCIFAR(num_classes=10, in_channels=cfg.dataset.channels, image_size=cfg.dataset.image_size,
                            width=cfg.model.width)
    counts = forward_flop_counts(model)
    shared = counts["ResNetCIFAR.stem"] + counts["ResNetCIFAR.head"] + sum(
        v for k, v in counts.items() if k.endswith(".shortcut"))
    masked = masked_fraction(counts=counts, model=model, level="block")
    assert masked == pytest.approx(1 - shared / counts["Global"])
    assert info["fraction_computed"] == pytest.approx(1 - masked + 0.5 * masked)
    assert 0.5 < info["fraction_computed"] < 1 and steps == round(100 / info["fraction_computed"]) < 200


def test_backward_masking_fraction():
    """Backward masking runs the forward and the input gradient in full: only the weight-gradient third shrinks."""
    assert compute_fraction(forward=0.55, masking="backward") == pytest.approx((2 + 0.55) / 3)
    assert compute_fraction(forward=0.55, masking="forward") == pytest.approx(0.55)


def test_tokens_budget():
    cfg = compose_with("train.budget=tokens", "+train.tokens=1000000", "+dataset.seq_len=128")
    steps, info = resolve_steps(cfg)
    gb = cfg.train.batch_size * cfg.cluster.world_size
    assert steps == math.ceil(1_000_000 / (gb * 128)) and info["tokens_trained"] >= 1_000_000


@pytest.mark.parametrize("overrides,key", [
    (("train.budget=epochs",), "train.budget"),
    (("train.budget=flops", "train.flops_ratio=guess"), "train.flops_ratio"),
    (("train.budget=tokens",), "train.tokens"),
    (("train.budget=tokens", "train.tokens=1000"), "seq_len"),
])
def test_bad_budget_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        resolve_steps(compose_with(*overrides))


def test_bad_coverage_names_the_key():
    with pytest.raises(ConfigError, match="parallelism.coverage"):
        resolve_steps(with_coverage(compose_with("train.budget=flops"), 1.5))


# ---- configs: every experiment and variant composes at both scales -----------------------------------
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
VARIANTS = sorted(p.stem for p in (CONF / "variant").glob("*.yaml"))


@pytest.mark.parametrize("scale", ["paper", "cpu"])
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_with_each_sweep_value(experiment: str, scale: str, request: pytest.FixtureRequest):
    """Every value of every swept key (seed aside) composes and resolves at both scales, and its budget
    resolves to a step count (one value at a time: the sweeps' products would take minutes). The default tier
    resolves the budget of each key's first and last value (each costs a meta build and an SDP plan: ~2-4 s
    for ResNet-18); ``--runslow`` every value."""
    cfg = compose_with(f"experiment={experiment}", f"scale={scale}")
    OmegaConf.to_container(cfg, resolve=True)
    every = request.config.getoption("--runslow")
    for key, values in sweep_params(experiment).items():
        if key == "seed":
            continue
        for i, value in enumerate(values):
            if key == "variant":
                assert value in VARIANTS, f"experiment {experiment} sweeps variant={value!r}, not in conf/variant: {VARIANTS}"
            one = compose_with(f"experiment={experiment}", f"scale={scale}", f"{key}={value}")
            OmegaConf.to_container(one, resolve=True)
            if scale == "cpu" and (every or i in (0, len(values) - 1)):
                steps, info = resolve_steps(one)
                assert 1 <= steps <= 200, f"{experiment} {key}={value}: {steps} steps at scale=cpu ({info})"
    if scale == "cpu":
        assert cfg.cluster.world_size == 4 and cfg.cluster.device == "cpu" and cfg.dataset.name == "cpu_standin"
        assert cfg.scale.name == "cpu"


def test_llama_scale_cpu_maps_each_size_to_a_tiny_llama_on_text():
    sizes = []
    for model in ("llama_134m", "llama_500m", "llama_1b"):
        cfg = compose_with("experiment=paper_llama_fineweb", f"model={model}", "scale=cpu")
        assert cfg.dataset.kind == "text" and cfg.model.dim <= 128, (model, cfg.model)
        steps, info = resolve_steps(cfg)
        assert info["budget"] == "tokens" and info["tokens_trained"] >= cfg.train.tokens
        sizes.append(info["flops_per_sample"])
        paper = compose_with("experiment=paper_llama_fineweb", f"model={model}")
        assert paper.model.dim >= 768 and paper.train.tokens >= 10**9, (model, paper.model.dim, paper.train.tokens)
    assert sizes == sorted(sizes) and len(set(sizes)) == 3, f"CPU LLaMAs must grow with the paper's sizes: {sizes}"


@pytest.mark.parametrize("variant", ["sd_c50", "layerdrop_c50"])
def test_drop_baseline_at_p_is_flop_matched_like_sdp_at_c(variant: str):
    """p = C: the drop baselines run exactly the steps B-SDP at C = 0.5 runs, under both ratio rules."""
    for rule in ("coverage", "measured"):
        base = ("model=resnet18_cifar", "train.steps=40", "train.budget=flops", f"train.flops_ratio={rule}")
        drop_steps, drop = resolve_steps(compose_with(*base, f"variant={variant}"))
        sdp_steps, sdp = resolve_steps(compose_with(*base, "variant=b_sdp_c50"))
        assert drop["coverage_key"] == "parallelism.survival_prob" and drop["coverage"] == 0.5
        assert drop_steps == sdp_steps and drop["fraction_computed"] == pytest.approx(sdp["fraction_computed"]), (drop, sdp)


def test_linear_decay_counts_its_mean_survival():
    """Stochastic depth's linear decay (last block at p) computes more than p: the budget uses the mean."""
    cfg = compose_with("model=resnet18_cifar", "parallelism=ddp_stochastic_depth", "parallelism.survival_prob=0.5",
                       "parallelism.decay=linear", "train.steps=40", "train.budget=flops")
    steps, info = resolve_steps(cfg)
    n = 8  # ResNet-18's BasicBlocks
    mean = sum(1 - (i + 1) / n * 0.5 for i in range(n)) / n
    assert info["coverage"] == pytest.approx(mean) and steps == round(40 / mean), info


def test_bad_survival_prob_names_the_key():
    """p = 0 would leave a FLOP budget nothing to divide by: its schema's range refuses it in the driver (run before
    the budget is resolved), naming key, value and range."""
    from sdp.driver.config import validate

    with pytest.raises(ConfigError, match=r"parallelism.survival_prob=0 is invalid: must be a number in \(0, 1\]"):
        validate(compose_with("parallelism=ddp_layerdrop", "parallelism.survival_prob=0", "train.budget=flops"))


def test_scale_cpu_shrinks_resnet_and_command_line_still_wins():
    cfg = compose_with("model=resnet18_cifar", "model.width=64", "scale=cpu")
    assert cfg.model.width == 64, "a command-line override must win over scale=cpu"
    assert compose_with("model=resnet18_cifar", "scale=cpu").model.width == 8
    assert compose_with("model=resnet18_cifar", "scale=paper").model.width == 16  # the model file's value


def test_token_counts_are_not_scrubbed_as_secrets():
    from sdp.results.contract import scrub

    out = scrub({"train": {"tokens": 5, "hf_token": "x"}, "time": {"tokens_per_s": 1.0}, "token": "y"})
    assert out == {"train": {"tokens": 5, "hf_token": "<redacted>"}, "time": {"tokens_per_s": 1.0}, "token": "<redacted>"}


@pytest.mark.parametrize("world,coverage,k", [(4, 0.3, 1), (4, 0.6, 2), (8, 0.3, 2), (3, 0.5, 2)])
def test_flops_budget_uses_the_realised_k_over_n(world: int, coverage: float, k: int):
    """k = round(C x n) holders per unit is what a worker computes, so r = k / n, not the nominal C
    (C = 0.3 on 4 workers is k = 1: r = 0.25); the measured rule uses k / n too."""
    base = ("model=mlp", "train.steps=40", "train.budget=flops", f"cluster.world_size={world}")
    steps, info = resolve_steps(with_coverage(compose_with(*base), coverage))
    assert info["coverage"] == pytest.approx(k / world) and info["coverage_nominal"] == coverage, info
    assert steps == round(40 * world / k), info
    cfg = with_coverage(compose_with(*base, "train.flops_ratio=measured"), coverage)
    _, measured = resolve_steps(cfg)
    masked = sum(share.split for share in model_flops(cfg)[1]["block"].values())
    assert measured["fraction_computed"] == pytest.approx(1 - masked + k / world * masked), measured
    with pytest.raises(ConfigError, match=r"coverage=0.1 with world_size=4 gives k=round\(0.4\)=0"):
        resolve_steps(with_coverage(compose_with("train.budget=flops", "cluster.world_size=4"), 0.1))


# ---- train.flops_reference: FLOP matching to another model (issue 38: the depth gate, the small dense model) ----
LM = ("experiment=cpu_study_lm", "seed=0", "variant=ddp")


@pytest.mark.parametrize("n_layers", [2, 4, 8])
def test_flops_reference_runs_the_reference_models_flops(n_layers: int):
    """DDP at ``n_layers`` matched to the 8-block model runs (8-block FLOPs / its own) x the steps, each counted
    from the model itself (:func:`model_flops`), so every depth trains the 8-block DDP's total FLOPs (to a step)."""
    own = compose_with(*LM, f"model.n_layers={n_layers}")
    ref_per_sample = model_flops(compose_with(*LM, "model.n_layers=8"))[0]
    own_per_sample = model_flops(own)[0]
    steps, info = resolve_steps(compose_with(*LM, f"model.n_layers={n_layers}", "train.flops_reference={n_layers:8}"))
    base = own.train.steps
    assert steps == round(base * ref_per_sample / own_per_sample), (steps, base, ref_per_sample, own_per_sample)
    assert info["flops_reference"] == {"model": {"n_layers": 8}, "flops_per_sample": ref_per_sample}, info
    reference_total = base * info["global_batch"] * ref_per_sample
    assert abs(info["total_flops"] - reference_total) <= info["flops_per_step"] / 2, (info["total_flops"], reference_total)
    if n_layers < 8:
        assert steps > base, f"a shallower model must run more steps than the reference's {base}: {steps}"
    else:
        assert steps == base, (steps, base)


def test_small_dense_model_runs_b_sdp_c50_steps():
    """``variant=ddp_small_c50`` (4 of 8 blocks) computes what one B-SDP C = 0.5 worker computes (the shared embedding
    and head in full, half the blocks), so the measured FLOP budget gives both the same step count."""
    small, info = resolve_steps(compose_with("experiment=cpu_study_lm", "seed=0", "variant=ddp_small_c50"))
    sdp, _ = resolve_steps(compose_with("experiment=cpu_study_lm", "seed=0", "variant=b_sdp_c50"))
    assert small == sdp and small > 1000, (small, sdp, info)


@pytest.mark.parametrize("overrides,why", [
    (("train.flops_reference=8",), "node of model keys"),
    (("train.flops_reference={n_layer:8}",), "keys not in model"),
    (("train.budget=iterations", "train.flops_reference={n_layers:8}"), "needs train.budget=flops"),
])
def test_bad_flops_reference_names_the_key(overrides: tuple[str, ...], why: str):
    with pytest.raises(ConfigError, match=rf"train\.flops_reference=.*{why}"):
        resolve_steps(compose_with(*LM, *overrides))

