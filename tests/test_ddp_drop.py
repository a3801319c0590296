"""Stochastic depth / LayerDrop inside DDP: p = 1 is DDP exactly, a dropped block's branch never
runs, and over many steps the executed fraction of blocks is the survival probability."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sdp.models.mlp import MLP
from sdp.errors import ConfigError
from sdp.parallel.ddp_drop import draw_blocks, exact_count, reset_blocks, survival_probs
from tests.helpers import CORE, run_job, train_losses

COMMON = ["model=mlp", "dataset=digits", "train.batch_size=8", "train.eval_every=0", "train.warmup_steps=1"]


def test_survival_probabilities() -> None:
    assert survival_probs(n=4, p=0.5, decay="uniform") == [0.5] * 4
    assert survival_probs(n=4, p=0.5, decay="linear") == [0.875, 0.75, 0.625, 0.5]


def test_dropped_branches_are_not_computed_and_kept_ones_rescaled() -> None:
    torch.manual_seed(0)
    model = MLP(num_classes=10, input_shape=(1, 4, 4), dim=8, hidden=8, depth=6)
    calls = [0] * 6
    for i, b in enumerate(model.blocks):
        b.fc1.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
    gen = torch.Generator().manual_seed(1)
    kept = draw_blocks(list(model.blocks), probs=[0.5] * 6, rescale=True, generator=gen)
    assert 0 < sum(kept) < 6, kept  # this seed drops some and keeps some
    assert [b.branch_scale for b in model.blocks] == [2.0 if k else 1.0 for k in kept]
    x = torch.randn(2, 1, 4, 4)
    out = model(x)
    assert calls == [int(k) for k in kept]
    reset_blocks(list(model.blocks))
    skipped = torch.nn.Sequential(model.stem, *[b for b, k in zip(model.blocks, kept) if k], model.head)
    for b in model.blocks:
        b.branch_scale = 2.0
    assert torch.allclose(out, skipped(x))  # a dropped block is the identity, the kept ones scaled 1/p


def test_exact_depth_keeps_exactly_p_n_blocks_each_equally_often() -> None:
    """``depth=exact``: every draw keeps p x n blocks (the random draw's depth varies), each block about p of the
    time (400 draws: a block's fraction has std 0.025; 0.1 is 4 std)."""
    model = MLP(num_classes=10, input_shape=(1, 4, 4), dim=8, hidden=8, depth=6)
    blocks, gen = list(model.blocks), torch.Generator().manual_seed(3)
    k = exact_count(n=6, p=0.5, depth="exact")
    exact = [draw_blocks(blocks, probs=[0.5] * 6, rescale=False, generator=gen, exact=k) for _ in range(400)]
    assert {sum(d) for d in exact} == {3}, sorted({sum(d) for d in exact})
    for i in range(6):
        assert abs(sum(d[i] for d in exact) / 400 - 0.5) < 0.1, [sum(d[j] for d in exact) / 400 for j in range(6)]
    random = [draw_blocks(blocks, probs=[0.5] * 6, rescale=False, generator=gen) for _ in range(50)]
    assert len({sum(d) for d in random}) > 1  # what exact removes: the depth of the random draw varies
    assert exact_count(n=6, p=0.5, depth="random") is None
    with pytest.raises(ConfigError, match="parallelism.survival_prob"):
        exact_count(n=8, p=0.3, depth="exact")


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    _, rows = run_job(["parallelism=ddp", "train.steps=5", *COMMON], world=2, run_dir=tmp_path_factory.mktemp("ddp"))
    return train_losses(rows)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [pytest.param("ddp_stochastic_depth", marks=CORE), "ddp_layerdrop"])
def test_survival_one_is_ddp(tmp_path: Path, ddp_losses: list[float], strategy: str) -> None:
    summary, rows = run_job([f"parallelism={strategy}", "parallelism.survival_prob=1.0", "train.steps=5", *COMMON],
                            world=2, run_dir=tmp_path)
    assert train_losses(rows) == ddp_losses  # bit-identical: every block runs with scale 1
    assert summary["strategy_info"]["executed_fraction"] == 1.0


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,p,decay,depth", [("ddp_stochastic_depth", 0.5, "linear", "random"),
                                                    ("ddp_layerdrop", 0.6, "uniform", "random"), ("ddp_layerdrop", 0.5, "uniform", "exact")])
def test_executed_fraction_matches_survival(tmp_path: Path, strategy: str, p: float, decay: str, depth: str) -> None:
    steps = 150
    summary, rows = run_job([f"parallelism={strategy}", f"parallelism.survival_prob={p}", f"parallelism.decay={decay}",
                             f"parallelism.depth={depth}", f"train.steps={steps}", "train.log_every=50", *COMMON],
                            world=2, run_dir=tmp_path)
    info = summary["strategy_info"]
    assert info["steps_drawn"] == steps
    if depth == "exact":  # every draw kept p x n blocks: the executed fraction is p, not about p
        assert info["executed_fraction"] == p, info
    # 4 blocks x 150 draws: std of the mean <= 0.021, of one block's fraction <= 0.041
    assert abs(info["executed_fraction"] - info["expected_fraction"]) < 0.07, info
    for got, want in zip(info["executed_fraction_per_block"], info["survival_probs"]):
        assert abs(got - want) < 0.13, info
    assert all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # finite training with skipped blocks
