"""Per-module seeded materialisation (sdp.models.init): a rank that materialises only its held units
gets exactly the values of the full build, so forward-masking SDP never holds the full model."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sdp.models import init
from sdp.parallel import STRATEGIES, DistContext, JobFacts
from sdp.subnet import masking as M
from sdp.rank.worker import build_model
from sdp.registry import build
from tests.helpers import config_dict

MODELS = {
    "llama": ["model=llama_tiny", "dataset=synthetic_text", "model.n_layers=4"],
    "resnet": ["model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=32"],
    "mlp": ["model=mlp", "dataset=digits", "model.hidden=16", "model.depth=4"],
    "vit": ["model=vit_tiny", "dataset=synthetic", "dataset.image_size=32"],
}


def _cfg(model: str, extra: list[str] = ()):  # noqa: ANN202
    return OmegaConf.create(config_dict(MODELS[model] + list(extra)))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}


@pytest.mark.parametrize("model", list(MODELS))
def test_materialised_unit_equals_full_build(model: str) -> None:
    cfg = _cfg(model)
    full = _state(build_model(cfg, None))
    again = _state(build_model(cfg, None))
    for n, t in full.items():
        assert torch.equal(t, again[n]), f"{model}: {n} differs between two full builds"
    meta = build_model(cfg, None, meta=True)
    assert init.meta_tensors(meta), "meta=True materialised something"
    unit = "blocks.1"
    init.materialise(meta, names=[n for n, _ in meta.named_modules() if n == unit or n.startswith(unit + ".")])
    got = _state(meta)
    checked = 0
    for n, t in got.items():
        if n.startswith(unit + "."):
            assert not t.is_meta and torch.equal(t, full[n]), f"{model}: {n} materialised alone differs from the full build"
            checked += 1
        else:
            assert t.is_meta, f"{model}: {n} was materialised although only {unit} was asked for"
    assert checked > 0
    other = _cfg(model, ["seed=1"])
    assert not all(torch.equal(t, _state(build_model(other, None))[n]) for n, t in full.items() if t.is_floating_point()
                   and t.numel() > 1), "seed does not change the initialisation"


def test_tied_embeddings_stay_tied() -> None:
    cfg = _cfg("llama", ["model.tie_embeddings=true"])
    model = build_model(cfg, None)
    assert model.head.output.weight is model.stem.weight


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_forward_masking_materialises_only_held(level: str) -> None:
    """Rank 0 of 4 at C = 0.5: the tensors it holds equal the full build's held pieces, and the live
    bytes during set-up stay below the full model's (no full copy ever exists)."""
    from sdp.metrics.live import LiveTensorTracker

    cfg = _cfg("llama", ["parallelism=sdp", f"parallelism.level={level}", "parallelism.coverage=0.5", "cluster.world_size=4",
                         "parallelism.groups=2"])
    full = build_model(cfg, None)
    full_bytes = sum(t.numel() * t.element_size() for t in _state(full).values())
    ctx = DistContext(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), backend="gloo")
    strategy = STRATEGIES.get("sdp").runtime(cfg=cfg.parallelism, job=JobFacts.of(cfg), ctx=ctx)
    assert strategy.materialises_held
    strategy.mode = "forward"
    model = build_model(cfg, None, meta=True)
    from sdp.parallel.sdp_plan import plan_for

    plan = plan_for(model=model, cfg=cfg.parallelism, world_size=4)
    pieces = M.pieces(model, plan)
    with LiveTensorTracker() as tracker:
        layout = M.apply(model, plan, rank=0, masking="forward", all_pieces=pieces,
                         materialise=lambda name: init.materialise_module(model, name))
    assert not init.meta_tensors(model)
    ref = _state(full)
    for p in pieces:
        if 0 in p.holders:
            spec = M.locate(p, layout)
            assert spec is not None, p
            t, dim, start, length = spec
            expect = ref[p.name] if p.dim is None else ref[p.name].narrow(p.dim, p.start, p.length)
            assert torch.equal(M.view(t, dim, start, length), expect), f"{p.name}@{p.start} differs from the full build"
    held = sum(t.numel() * t.element_size() for t in _state(model).values())
    assert held < 0.8 * full_bytes, (held, full_bytes)
    assert tracker.peak < full_bytes, f"set-up peak {tracker.peak} reached the full model's {full_bytes} bytes"
    _ = build
