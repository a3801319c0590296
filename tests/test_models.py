"""Every model: parameter counts of the shipped configs, declarations that cover all parameters,
forward/backward and skip at tiny size, torchvision equivalence, FLOP counts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torchvision

from sdp.models.base import ResidualBlock, SDPModel, count_forward_flops, count_params
from sdp.models.llama import LLaMA
from sdp.models.resnet import ResNet, ResNetCIFAR
from sdp.models.swin import Swin
from sdp.models.vit import ViT
from sdp.registry import build
from tests.hydra_cfg import compose_config

CONF = Path(__file__).resolve().parent.parent / "conf"

# (model config, overrides, exact parameter count). Each count must also appear in the YAML comment.
COUNTS = [
    ("resnet18_cifar", ["dataset=cifar10"], 701_466),
    ("resnet18_cifar", ["dataset=cifar10", "model.width=64"], 11_173_962),
    ("resnet18_cifar", ["dataset=cifar100", "model.width=64"], 11_220_132),
    ("resnet18", ["dataset=imagenet"], 11_689_512),
    ("resnet50", ["dataset=imagenet"], 25_557_032),
    ("swin_t", ["dataset=imagenet"], 28_288_354),
    ("vit_tiny", ["dataset=cifar10"], 5_362_762),
    ("vit_tiny", ["dataset=cifar100"], 5_380_132),
    ("vit_small", ["dataset=cifar10"], 21_342_346),
    ("vit_small", ["dataset=cifar100"], 21_376_996),
    ("llama_tiny", ["dataset=synthetic_text"], 217_664),
    ("llama_tiny", ["dataset=fineweb"], 6_617_792),
    ("llama_134m", ["dataset=fineweb", "dataset.vocab_size=32000"], 134_105_856),
    ("llama_134m", ["dataset=fineweb"], 162_148_608),
    ("llama_134m", ["dataset=fineweb", "dataset.vocab_size=256"], 85_347_072),
    ("llama_500m", ["dataset=fineweb", "dataset.vocab_size=32000"], 501_298_520),
    ("llama_500m", ["dataset=fineweb"], 546_575_880),
    ("llama_500m", ["dataset=fineweb", "dataset.vocab_size=256"], 422_573_400),
    ("llama_1b", ["dataset=fineweb", "dataset.vocab_size=32000"], 1_339_525_120),
    ("llama_1b", ["dataset=fineweb"], 1_414_305_792),
    ("llama_1b", ["dataset=fineweb", "dataset.vocab_size=256"], 1_209_501_696),
]


def meta_model(name: str, overrides: list[str]) -> SDPModel:
    cfg = compose_config(f"model={name}", *overrides)
    with torch.device("meta"):
        return build(cfg.model)


@pytest.mark.parametrize(("name", "overrides", "expected"), COUNTS, ids=[f"{c[0]}-{'-'.join(c[1])}" for c in COUNTS])
def test_config_parameter_count(name: str, overrides: list[str], expected: int) -> None:
    assert count_params(meta_model(name, overrides)) == expected
    comment = "\n".join(l for l in (CONF / "model" / f"{name}.yaml").read_text().splitlines() if l.startswith("#"))
    assert f"{expected:,}" in comment, f"{name}.yaml's comment does not state {expected:,}"


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "swin_t"])
def test_torchvision_architectures_have_torchvision_counts(name: str) -> None:
    with torch.device("meta"):
        reference = count_params(getattr(torchvision.models, name)())
    assert count_params(meta_model(name, ["dataset=imagenet"])) == reference


def tiny_models() -> dict[str, SDPModel]:
    torch.manual_seed(0)
    return {
        "resnet18_cifar": ResNetCIFAR(num_classes=5, width=4),
        "resnet18": ResNet(num_classes=5, image_size=32, width=4),
        "resnet50": ResNet(num_classes=5, image_size=32, width=4, block="bottleneck", blocks_per_stage=[1, 2, 1, 1]),
        "swin": Swin(num_classes=5, image_size=32, embed_dim=8, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=4),
        "vit": ViT(num_classes=5, image_size=16, dim=16, depth=2, n_heads=2),
        "vit_mean": ViT(num_classes=5, image_size=16, dim=16, depth=2, n_heads=2, pool="mean"),
        "llama_gqa": LLaMA(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=48, max_seq_len=12),
        "llama_tied": LLaMA(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden=48, max_seq_len=12, tie_embeddings=True),
    }


TINY = tiny_models()


@pytest.mark.parametrize("name", list(TINY))
def test_units_and_shared_cover_every_parameter_once(name: str) -> None:
    model = TINY[name]
    owners: dict[str, int] = {n: 0 for n, _ in model.named_parameters()}
    for prefix in model.shared_modules():
        for n in owners:
            if n == prefix or n.startswith(prefix + "."):
                owners[n] += 1
    for i, block in model.sdp_units():
        for n, _ in block.branch_parameters():
            owners[f"blocks.{i}.{n}"] += 1
    wrong = {n: c for n, c in owners.items() if c != 1}
    assert not wrong, f"parameters not owned exactly once (name: owners): {wrong}"
    assert model.sdp_units(), f"{name} declares no SDP units"


@pytest.mark.parametrize("name", list(TINY))
def test_hidden_dims_name_real_tensors_of_the_declared_size(name: str) -> None:
    for _, block in TINY[name].sdp_units():
        tensors = dict(block.named_parameters()) | dict(block.named_buffers())
        shared = block.shared_submodules()
        assert block.hidden_dims(), f"{name}: block {type(block).__name__} declares no hidden dim"
        for hd in block.hidden_dims():
            for s in hd.slices:
                assert s.tensor in tensors, f"{name}: {hd.name} names missing tensor {s.tensor}"
                assert not any(s.tensor.startswith(p + ".") for p in shared), f"{s.tensor} is in a shared module"
                got = tensors[s.tensor].shape[s.dim]
                assert got == hd.size * hd.unit_width, f"{name}.{s.tensor} dim {s.dim}: {got} != {hd.size} x {hd.unit_width}"


def test_attention_heads_declared_only_without_gqa() -> None:
    names = lambda m: {hd.name for _, b in m.sdp_units() for hd in b.hidden_dims()}  # noqa: E731
    assert names(TINY["llama_tied"]) == {"mlp", "heads"} and names(TINY["vit"]) == {"mlp", "heads"}
    assert names(TINY["llama_gqa"]) == {"mlp"}
    heads = [hd for hd in TINY["vit"].blocks[0].hidden_dims() if hd.name == "heads"][0]
    assert (heads.size, heads.unit_width) == (2, 8)


@pytest.mark.parametrize("name", list(TINY))
def test_forward_backward_and_skip(name: str) -> None:
    model = TINY[name]
    model.train()
    x = model.example_input(2)
    if model.task == "lm":
        x = torch.randint(0, model.vocab_size, x.shape)
    out = model(x)
    expected = (2, x.shape[1], model.vocab_size) if model.task == "lm" else (2, 5)
    assert tuple(out.shape) == expected
    out.float().pow(2).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"{name}: no/invalid gradient for {missing}"
    model.zero_grad(set_to_none=True)
    for _, block in model.sdp_units():  # every unit skipped: the model still runs (stem/shared -> head)
        block.active = False
    try:
        with torch.no_grad():
            assert tuple(model(x).shape) == expected
        grads_needed = [n for _, b in model.sdp_units() for n, p in b.branch_parameters()]
        model(x).float().sum().backward()
        touched = {f"blocks.{i}.{n}" for i, b in model.sdp_units() for n, p in b.branch_parameters() if p.grad is not None}
        assert grads_needed and not touched, f"{name}: skipped branches received gradients: {sorted(touched)[:5]}"
    finally:
        for _, block in model.sdp_units():
            block.active = True
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("block", "layers"), [("basic", [2, 2, 2, 2]), ("bottleneck", [1, 2, 1, 1])])
def test_resnet_loads_torchvision_weights_and_matches(block: str, layers: list[int]) -> None:
    tv_block = torchvision.models.resnet.BasicBlock if block == "basic" else torchvision.models.resnet.Bottleneck
    tv = torchvision.models.resnet.ResNet(tv_block, layers, num_classes=7).eval()
    ours = ResNet(num_classes=7, image_size=32, block=block, blocks_per_stage=layers).eval()
    ours.load_torchvision_state_dict(tv.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), tv(x))


def test_swin_matches_torchvision_with_the_same_seed() -> None:
    kw = dict(patch_size=[4, 4], embed_dim=8, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=[4, 4])
    torch.manual_seed(3)
    tv = torchvision.models.swin_transformer.SwinTransformer(**kw, num_classes=5, stochastic_depth_prob=0.0).eval()
    torch.manual_seed(3)
    ours = Swin(num_classes=5, image_size=32, embed_dim=8, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=4).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), tv(x))
    assert sum(isinstance(b, ResidualBlock) for b in ours.blocks) == 8 and len(ours.blocks) == 11


@pytest.mark.parametrize("name", ["llama_134m", "llama_1b"])
def test_llama_flops_equal_the_closed_form(name: str) -> None:
    """6 N T (every matmul weight, LM head included, embedding lookup excluded) + 12 L T^2 d (QK^T, AV)."""
    model = meta_model(name, ["dataset=fineweb", "dataset.seq_len=1024"])
    t, d, layers = 1024, model.dim, len(model.blocks)
    matmul = count_params(model) - count_params(model.stem) - sum(count_params(m) for m in model.modules()
                                                                     if isinstance(m, torch.nn.RMSNorm))
    assert model.flops_per_sample() == 6 * matmul * t + 12 * layers * t * t * d


def test_vit_flops_include_attention() -> None:
    """Patch conv + per block (q, k, v, o, MLP matmuls + QK^T and AV over 17 tokens) + classifier."""
    model = TINY["vit"]
    n, d, layers = 17, 16, 2  # 16 patches + class token, width 16
    patch = 2 * 16 * (3 * 4 * 4) * d
    block = 2 * n * (4 * d * d + 2 * d * 4 * d) + 2 * 2 * n * n * d
    assert model.flops_per_sample() == 3 * (patch + layers * block + 2 * d * 5)


def test_default_flops_come_from_the_flop_counter() -> None:
    model = ResNetCIFAR(num_classes=10, width=4)
    running = model.blocks[0].bn1.running_mean.clone()
    flops = model.flops_per_sample()
    conv_stem = 2 * 32 * 32 * 3 * 4 * 9  # the 3x3 stem alone: 2 FLOPs x outputs x fan-in
    assert flops > 3 * conv_stem and flops == 3 * count_forward_flops(model, model.example_input(1))
    assert torch.equal(model.blocks[0].bn1.running_mean, running), "counting FLOPs changed BatchNorm statistics"


def test_llama_is_causal_and_tied() -> None:
    model = TINY["llama_tied"].eval()
    assert model.head.output.weight is model.stem.weight
    x = torch.randint(0, 64, (1, 12))
    y = x.clone()
    y[0, 7:] = (y[0, 7:] + 1) % 64
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :7], model(y)[:, :7])  # the future does not leak
        assert not torch.allclose(model(x)[:, 7:], model(y)[:, 7:])


def test_yaml_sources_are_cited() -> None:
    for name in ("llama_134m", "llama_500m", "llama_1b"):
        head = (CONF / "model" / f"{name}.yaml").read_text().splitlines()[0]
        assert re.search(r"github\.com/\S+", head), f"{name}.yaml does not cite its source config: {head}"
