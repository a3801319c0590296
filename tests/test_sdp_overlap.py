"""SDP's overlapped gradient sync (``parallelism.overlap=true``) gives bit-identical gradients and
parameters to the blocking path after backward, on 4 gloo ranks, and really launches during backward.

Small buckets (``bucket_cap_mb=0.01``: about one piece each) so that several buckets per holder set
are launched out of holder-set order, which is what the overlap changes."""

from __future__ import annotations

import pytest
import torch

from sdp.subnet.masking import locate, view
from sdp.core.loss import loss_fn
from tests.helpers import batch, config_dict, make_strategy, spawn

MLP = ["model=mlp", "dataset=digits", "model.hidden=64", "model.depth=4", "train.batch_size=8", "optim=sgd",
       "parallelism.assignment=cyclic", "parallelism.bucket_cap_mb=0.01", "parallelism.groups=4"]
STEPS = 3


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _run(rank: int, world: int, configs: dict) -> dict:
    out: dict = {}
    for overlap, config in configs.items():
        strategy, data, cfg = make_strategy(config, rank, world)
        assert strategy.sync.overlap is overlap
        grads: list[dict] = []
        launched_in_backward: list[int] = []
        for step in range(STEPS):
            x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
            strategy._forward_backward(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer())
            launched_in_backward.append(len(strategy.sync._inflight))
            strategy.sync.reduce_grads()
            step_grads = {}
            for p in strategy.pieces:
                spec = locate(p, strategy.layout)
                if p.is_param and spec is not None and spec[0].grad is not None:
                    t, dim, start, length = spec
                    step_grads[(p.name, p.start)] = view(t.grad, dim, start, length).clone()
            grads.append(step_grads)
            strategy.optimizer.step()
            strategy.optimizer.zero_grad(set_to_none=False)
            if strategy.mode == "backward":
                strategy.sync.refresh()
        params = {n: t.detach().clone() for n, t in strategy.module.named_parameters()}
        out[overlap] = {"grads": grads, "params": params, "launched": launched_in_backward,
                        "buckets": len(strategy.sync.grad_buckets)}
    return out


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("preset", ["sdp", "sdp_neuron_bwd", "sdp_block_bwd-global", "sdp_neuron_fwd"])  # slow tier (CI time)
def test_overlap_is_bit_identical_to_blocking_sync(preset: str) -> None:
    world = 4
    name, _, refresh = preset.partition("-")
    extra = [f"parallelism.refresh={refresh}"] if refresh else []
    configs = {overlap: config_dict(MLP + [f"parallelism={name}", f"cluster.world_size={world}",
                                           f"parallelism.overlap={str(overlap).lower()}", *extra])
               for overlap in (False, True)}
    results = spawn(_run, world=world, args=(configs,))
    for r, res in enumerate(results):
        on, off = res[True], res[False]
        assert off["launched"] == [0] * STEPS, f"rank {r}: the blocking path launched during backward: {off['launched']}"
        assert min(on["launched"]) > 0 and on["buckets"] > 1, (
            f"rank {r}: overlap launched {on['launched']} of {on['buckets']} buckets during backward")
        for step, (a, b) in enumerate(zip(on["grads"], off["grads"])):
            assert a.keys() == b.keys() and a, f"rank {r} step {step}: gradient sets differ"
            for key in a:
                assert torch.equal(a[key], b[key]), (
                    f"{preset} rank {r} step {step} {key}: max |overlap - blocking| = {(a[key] - b[key]).abs().max().item():.3e}")
        for n, t in on["params"].items():
            assert torch.equal(t, off["params"][n]), f"{preset} rank {r}: parameter {n} differs after {STEPS} steps"


def _holder_set_runs(overrides: list[str]) -> dict[tuple[int, ...], int]:
    """Runs per holder set of a plan built on the meta device (one process: the piece list alone decides)."""
    from omegaconf import OmegaConf

    from sdp.parallel.sdp_plan import plan_for
    from sdp.registry import build
    from sdp.subnet.masking import pieces
    from sdp.subnet.sync import holder_runs
    from tests.helpers import compose

    cfg = compose(overrides)
    with torch.device("meta"):
        model = build(OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True)))
    params = [p for p in pieces(model, plan_for(model=model, cfg=cfg.parallelism, world_size=4)) if p.is_param]
    return {h: len(holder_runs(params, holders=h)) for h in sorted({p.holders for p in params})}


def test_buckets_follow_blocks_not_unit_slices() -> None:
    """A run of one holder set ends only at a block (or a stretch outside the blocks) holding none of its
    pieces: at neuron level every block holds slices of every holder set, so each holder set is one run (the
    CPU study's N-SDP made 129 all-reduces a step when slices ended runs); at block level each holder set has
    one run per stretch of consecutive blocks it holds, and the embedding and head (held by all) are two."""
    llama = ["model=llama_tiny", "model.n_layers=8", "dataset=synthetic_text", "cluster.world_size=4",
             "parallelism.coverage=0.5"]
    neuron = _holder_set_runs([*llama, "parallelism=sdp_neuron_fwd"])
    assert all(n == 1 for n in neuron.values()), neuron
    block = _holder_set_runs([*llama, "parallelism=sdp"])
    assert block[(0, 1, 2, 3)] == 2, block
    assert sum(n for h, n in block.items() if len(h) < 4) <= 8 and all(n >= 1 for n in block.values()), block
