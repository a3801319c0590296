"""Issue 26, item 1: at neuron level SDP rescales and counts as narrowed exactly what is split.

A unit's hidden dims name the sub-branch their units run (``HiddenDim.branch``); only the output of
those split units is rescaled (k/n at evaluation, groups / held groups under ``rescale=train``) and
only that sub-branch's FLOPs shrink with the coverage. What every holder computes in full (attention
under grouped-query attention, Swin's attention, an output bias) is neither rescaled nor counted as
narrowed. Block level keeps scaling the whole branch. The expected outputs below are written per
family from the plain (unscaled) sub-modules, not read from the declarations under test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from sdp.driver.budget import resolve_steps
from sdp.core.distctx import DistContext
from sdp.models.base import ResidualBlock
from sdp.models.llama import LLaMA
from sdp.models.mlp import MLP
from sdp.models.resnet import ResNetCIFAR
from sdp.models.swin import Swin
from sdp.models.vit import ViT
from sdp.registry import build
from sdp.subnet import masking as M
from sdp.subnet.assemble import PartwiseAssembly, set_branch_scales
from sdp.subnet.plan import build_plan
from tests.helpers import batch, config_dict, make_strategy, spawn
from tests.helpers.flops import direct_forward_fraction
from tests.hydra_cfg import compose_config

S = 0.5


def _biased(model: nn.Module) -> nn.Module:
    """Every bias non-zero (the models initialise them at zero, which would hide a scaled bias)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.5)
    return model.eval()


def _scaled(out: torch.Tensor, layer: nn.Linear, s: float) -> torch.Tensor:
    """``s * W h + b`` from the plain ``out = W h + b``."""
    b = layer.bias if layer.bias is not None else torch.zeros(())
    return s * (out - b) + b


def _ref_transformer(blk: ResidualBlock, x: torch.Tensor, *, s_att: float, s_mlp: float) -> torch.Tensor:
    h = x + _scaled(blk.attention(blk.attention_norm(x)), blk.attention.wo, s_att)
    ff = blk.feed_forward
    out = ff.w2 if hasattr(ff, "w2") else ff.fc2
    return h + _scaled(ff(blk.ffn_norm(h)), out, s_mlp)


def _ref_swin(blk: ResidualBlock, x: torch.Tensor, *, s_mlp: float) -> torch.Tensor:
    h = x + blk.attn(blk.norm1(x))  # attention: never split, never scaled
    return h + _scaled(blk.mlp(blk.norm2(h)), blk.mlp[3], s_mlp)


def _ref_mlp(blk: ResidualBlock, x: torch.Tensor, *, s_mlp: float) -> torch.Tensor:
    return x + _scaled(blk.fc2(torch.nn.functional.gelu(blk.fc1(blk.norm(x)))), blk.fc2, s_mlp)


# family -> (tiny model, the block's reference at neuron level with split scale s)
CASES: dict[str, tuple[Any, Any]] = {
    # GQA: only the MLP is split; LLaMA has no biases
    "llama_gqa": (lambda: LLaMA(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=48, max_seq_len=12),
                  lambda blk, x, s: _ref_transformer(blk, x, s_att=1.0, s_mlp=s)),
    # torchvision's fused qkv: only the MLP is split; mlp.3's bias is added once
    "swin": (lambda: Swin(num_classes=5, image_size=32, embed_dim=8, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4],
                          window_size=4), lambda blk, x, s: _ref_swin(blk, x, s_mlp=s)),
    # heads and MLP split, but wo's and fc2's biases are not the heads' / units' output
    "vit": (lambda: ViT(num_classes=5, image_size=16, dim=16, depth=2, n_heads=2),
            lambda blk, x, s: _ref_transformer(blk, x, s_att=s, s_mlp=s)),
    "mlp": (lambda: MLP(num_classes=5, input_shape=[6], dim=8, hidden=12, depth=2),
            lambda blk, x, s: _ref_mlp(blk, x, s_mlp=s)),
}


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return _biased(CASES[name][0]())


def _whole(name: str, blk: ResidualBlock, x: torch.Tensor, s: float) -> torch.Tensor:
    """Block level: the whole branch scaled, attention and biases included (a dropped block adds nothing)."""
    if name == "mlp":
        return x + s * blk.fc2(torch.nn.functional.gelu(blk.fc1(blk.norm(x))))
    if name == "swin":
        h = x + s * blk.attn(blk.norm1(x))
        return h + s * blk.mlp(blk.norm2(h))
    h = x + s * blk.attention(blk.attention_norm(x))
    return h + s * blk.feed_forward(blk.ffn_norm(h))


def _block_input(model: nn.Module, b: int) -> torch.Tensor:
    """The residual stream entering ``blocks[b]`` on a random input of the model's example shape."""
    x = model.example_input(2)
    gen = torch.Generator().manual_seed(0)
    if getattr(model, "task", "") == "lm":
        x = torch.randint(0, model.vocab_size, x.shape, generator=gen)
    else:
        x = torch.randn(x.shape, generator=gen)
    x = model.stem(x)
    for blk in list(model.blocks)[:b]:
        x = blk(x)
    return x


@torch.no_grad()
@pytest.mark.parametrize("name", list(CASES))
def test_neuron_scale_reaches_only_the_split_units_output(name: str) -> None:
    """A split unit (neuron level) scales what its split units produce; a whole unit (block level) its
    whole branch. The references call the sub-modules directly, so the block's scales do not reach them."""
    model, reference = _make(name), CASES[name][1]
    for b, blk in model.sdp_units():
        x = _block_input(model, b)
        blk.set_scale(S, split=True)
        got, want = blk(x), reference(blk, x, S)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{name} blocks.{b}: max |diff| {(got - want).abs().max():.3g}"
        blk.set_scale(S, split=False)
        got, want = blk(x), _whole(name, blk, x, S)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{name} blocks.{b} block level: {(got - want).abs().max():.3g}"


@torch.no_grad()
def test_resnet_neuron_scale_is_its_block_scale() -> None:
    """ResNet's whole branch is the split computation (conv2's output is the sum over the split channels,
    bn2 normalises that sum): its neuron-level scale is the block-level one, as before."""
    torch.manual_seed(0)
    model = _biased(ResNetCIFAR(num_classes=5, width=4))
    for b, blk in model.sdp_units():
        x = _block_input(model, b)
        blk.set_scale(S, split=True)
        neuron = blk(x)
        blk.set_scale(S, split=False)
        assert torch.equal(neuron, blk(x)), f"blocks.{b}"
        blk.set_scale(1.0, split=False)


def _one_rank_ctx() -> DistContext:
    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@torch.no_grad()
@pytest.mark.parametrize("name", ["llama_gqa", "swin"])
def test_assembled_model_scales_only_the_split_units(name: str) -> None:
    """The assembled model at C = 0.5 (k/n = 0.5), whole (``set_branch_scales``) and part by part
    (:class:`PartwiseAssembly`, built here from one rank holding every value): each block computes the
    neuron-level reference (attention and output biases unscaled)."""
    model, reference = _make(name), CASES[name][1]
    plan = build_plan(model=model, world_size=4, coverage=0.5, level="neuron", groups=4, assignment="cyclic",
                      block_costs={b: (1.0, 1.0) for b, _ in model.sdp_units()})  # costs unused by cyclic
    assert plan.k / plan.world_size == S
    whole = _make(name)
    set_branch_scales(whole, plan, scale=S)
    pieces = M.pieces(model, plan)
    layout = M.apply(model, plan, rank=0, masking="global", all_pieces=pieces)
    parts = PartwiseAssembly(skeleton=_make(name).to("meta"), pieces=pieces, layout=layout, plan=plan,
                             masking="global", groups=None, ctx=_one_rank_ctx(), scale=S)  # type: ignore[arg-type]
    for b, blk in whole.sdp_units():
        part = parts.part(parts.names.index(f"blocks.{b}"))
        assert (part.branch_scale, blk.branch_scale) == (1.0, 1.0)
        x = _block_input(model, b)
        want = reference(blk, x, S)
        for got in (part(x), blk(x)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{name} blocks.{b}: max |diff| {(got - want).abs().max():.3g}"


# ---- the FLOP fraction ------------------------------------------------------------------------------
FLOPS = {
    "llama_gqa": ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16"],
    "swin": ["model=swin_t", "dataset=synthetic_image", "model.embed_dim=16", "model.depths=[2,2,2,2]",
             "model.num_heads=[1,2,2,4]", "model.window_size=4"],
}


@pytest.mark.parametrize("name", list(FLOPS))
def test_neuron_flop_fraction_is_the_narrowed_models_direct_count(name: str) -> None:
    """``train.flops_ratio=measured`` at neuron level, C = 0.5 on 4 workers: the fraction the budget
    counts equals the mean over ranks of each rank's narrowed subnetwork's forward FLOPs (counted by
    ``torch.utils.flop_counter`` on the masked model itself) over the full model's."""
    cfg = compose_config(*FLOPS[name], "parallelism=sdp_neuron_fwd", "parallelism.coverage=0.5", "cluster.world_size=4",
                         "train.steps=100", "train.budget=flops", "train.flops_ratio=measured")
    steps, info = resolve_steps(cfg)
    direct = direct_forward_fraction(cfg)
    assert direct < 1.0, f"{name}: the masked subnetworks should compute less than the full model: {direct}"
    assert info["fraction_computed"] == pytest.approx(direct, rel=1e-9), (info["fraction_computed"], direct)
    assert steps == round(100 / direct), (steps, direct)


WHOLE_BRANCH_SPLIT = {
    "resnet18_cifar": ["model=resnet18_cifar", "dataset=cifar10"],
    "mlp": ["model=mlp", "dataset=digits"],
    "vit_tiny": ["model=vit_tiny", "dataset=cifar10"],
    "llama_mha": ["model=llama_tiny", "dataset=synthetic_text", "model.n_kv_heads=null"],
}


@pytest.mark.parametrize("name", list(WHOLE_BRANCH_SPLIT))
def test_models_whose_whole_branch_is_split_count_as_before(name: str) -> None:
    """Where neuron level splits everything a block computes (ResNet's convs, the MLP, ViT's and plain
    multi-head LLaMA's heads and MLP), the neuron-level masked share is the block-level one, as before."""
    from sdp.metrics.flops import masked_fraction
    from sdp.models.base import forward_flop_counts

    with torch.device("meta"):
        model = build(compose_config(*WHOLE_BRANCH_SPLIT[name]).model)
    counts = forward_flop_counts(model)
    shares = {level: masked_fraction(counts=counts, model=model, level=level) for level in ("block", "neuron")}
    assert shares["neuron"] == pytest.approx(shares["block"], rel=1e-12) and 0.5 < shares["block"] < 1, shares


# ---- training (rescale=train) and evaluation (rescale=eval) of real N-SDP ranks ------------------------
TRAINED = {
    "llama_gqa": ["model=llama_tiny", "dataset=synthetic_text", "dataset.seq_len=16", "optim=adamw",
                  "train.batch_size=2"],
    "swin": ["model=swin_t", "dataset=synthetic_image", "model.embed_dim=16", "model.depths=[1,1,1,1]",
             "model.num_heads=[1,2,2,4]", "model.window_size=4", "optim=adamw", "train.batch_size=2"],
}
BRANCH = {"llama_gqa": "feed_forward", "swin": "mlp"}


def _n_sdp(name: str) -> dict[str, Any]:
    return config_dict(TRAINED[name] + ["parallelism=sdp_neuron_fwd", "parallelism.coverage=0.5",
                                        "parallelism.rescale=train", "parallelism.groups=4", "cluster.world_size=2"])


@torch.no_grad()
@pytest.mark.parametrize("name", list(TRAINED))
def test_training_scales_only_the_split_sub_branch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rescale=train``, N-SDP at C = 0.5 on 2 ranks (each rank's strategy built here, without a process group:
    the set-up's one collective, the ranks' agreement on the plan, is tests/test_plan_agreement.py's): every held
    block scales what its held MLP units produce by groups / held groups and computes attention (and the whole
    branch) unscaled, on the narrowed module it trains."""
    monkeypatch.setattr("sdp.parallel.sdp.check_same_plan", lambda **_: None)
    config = _n_sdp(name)
    for rank in range(2):
        strategy, _, _ = make_strategy(config, rank, 2)
        module = strategy.module.eval()
        held = [(b, blk) for b, blk in module.sdp_units() if blk.active]
        assert held, f"rank {rank} holds no block"
        for b, blk in held:
            narrowed, full = blk.hidden_dims()[0].size, strategy.skeleton.blocks[b].hidden_dims()[0].size
            assert narrowed < full, f"rank {rank} blocks.{b}: not narrowed ({narrowed} of {full})"
            x = _block_input(module, b)
            got, want = blk(x), CASES[name][1](blk, x, full / narrowed)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"rank {rank} blocks.{b}: {(got - want).abs().max():.3g}"
            assert (blk.branch_scale, blk.hidden_scales) == (1.0, {BRANCH[name]: full / narrowed}), \
                f"rank {rank} blocks.{b}: {blk.branch_scale} {blk.hidden_scales}"


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _scales(rank: int, world: int, config: dict[str, Any]) -> list[tuple[str, float, dict[str, float], float]]:
    from sdp.core.loss import loss_fn

    strategy, data, cfg = make_strategy(config, rank, world)
    x, y = batch(data, cfg, step=0, rank=rank, world_size=world)
    strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=0)
    strategy.rescale = "eval"  # the same trained state, assembled as rescale=eval does
    seen = []
    with strategy.eval_module() as parts:
        for i, name in enumerate(parts.names):
            m = parts.part(i)
            if isinstance(m, ResidualBlock):
                seen.append((name, m.branch_scale, dict(m.hidden_scales), strategy.plan.k / world))
    return seen


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(TRAINED))
def test_assembled_ranks_scale_only_the_split_sub_branch(name: str) -> None:
    """The same N-SDP ranks, spawned, after a training step: the model ``eval_module`` assembles from
    them (collectives included) scales the MLP by k/n and leaves attention and the branch at 1."""
    for r, seen in enumerate(spawn(_scales, world=2, args=(_n_sdp(name),))):
        assert seen, f"rank {r}: no unit part"
        for where, branch_scale, hidden, want in seen:
            assert (branch_scale, hidden) == (1.0, {BRANCH[name]: want}), f"rank {r} {where}: {branch_scale} {hidden}"
