"""Issue 29, item 1: SDP's layout follows the model when it moves to its device.

``masking.apply`` builds the layout where the model is pruned (the CPU); ``Module.to(cuda)`` then keeps
the Parameter objects but puts a new tensor in every buffer slot, so a layout taken before the move made
assembly read the initial BatchNorm statistics (mean 0, var 1) and every re-draw reset them. A CPU run
cannot see it (``.to("cpu")`` keeps the objects), so the move is stood in for by ``Module._apply`` with a
copying function, which replaces buffers exactly as a device move does.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from sdp.models.resnet import ResNetCIFAR
from sdp.core.loss import loss_fn
from sdp.subnet import masking as M
from sdp.subnet.plan import build_plan
from tests.helpers import batch, config_dict, make_strategy

RESNET = ["model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=8", "train.batch_size=4",
          "train.eval_batch_size=4", "optim=sgd"]


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _move(model: nn.Module) -> nn.Module:
    """What ``model.to(cuda)`` does to the module's slots, on the CPU: parameters keep their objects
    (new data), every buffer is a new tensor."""
    return model._apply(lambda t: t.clone())


def _live(model: nn.Module, name: str, key: str) -> torch.Tensor:
    mod, _, _ = name.rpartition(".")
    owner = model.get_submodule(mod) if mod else model
    return owner._parameters[key] if key in owner._parameters else owner._buffers[key]  # type: ignore[return-value]


@pytest.mark.parametrize("masking", ["forward", "backward", "global"])
def test_rebind_points_the_layout_at_the_moved_tensors(masking: str) -> None:
    """Neuron level, C = 0.5 on 4 workers, rank 0: narrowed (forward), split and frozen (backward) and
    whole tensors all end up the module's live ones after the move; before rebind the buffers are stale."""
    torch.manual_seed(0)
    model = ResNetCIFAR(num_classes=5, width=4)
    plan = build_plan(model=model, world_size=4, coverage=0.5, level="neuron", groups=2, assignment="cyclic",
                      block_costs={b: (1.0, 1.0) for b, _ in model.sdp_units()})
    pieces = M.pieces(model, plan)
    layout = M.apply(model, plan, rank=0, masking=masking, all_pieces=pieces)
    _move(model)
    stale = [n for n, loc in layout.items()
             if n.endswith("running_mean") and loc.held is not _live(model, n, n.rpartition(".")[2])]
    assert stale, "the stand-in move should replace the buffers (else this test proves nothing)"
    bound = M.rebind(model, layout)
    assert bound.keys() == layout.keys()
    for name, loc in bound.items():
        leaf = name.rpartition(".")[2]
        if loc.held is not None and loc.rest is not None:
            assert loc.held is _live(model, name, leaf + "_held") and loc.rest is _live(model, name, leaf + "_rest"), name
        else:
            assert (loc.held if loc.held is not None else loc.rest) is _live(model, name, leaf), name
        old = layout[name]
        assert (loc.dim, loc.held_groups, loc.rest_groups, loc.width) == (old.dim, old.held_groups, old.rest_groups, old.width)


def _bn_stats(named: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named if n.endswith(("running_mean", "running_var"))}


def test_assembled_and_redrawn_models_keep_the_trained_batchnorm_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """One SDP rank (C = 1, ``eval.bn=average``) whose model move replaces its buffers as a CUDA move
    does: after training, the assembled model's BatchNorm statistics are the trained ones, a re-draw
    carries them into the new subnetwork, and a checkpoint loaded into it is what assembly reads."""
    real_to = nn.Module.to

    def moving_to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return _move(real_to(self, *args, **kwargs))

    monkeypatch.setattr(nn.Module, "to", moving_to)
    config = config_dict(RESNET + ["parallelism=sdp", "parallelism.coverage=1.0", "cluster.world_size=1", "eval.bn=average"])
    strategy, data, cfg = make_strategy(config, 0, 1)
    initial = _bn_stats(strategy.module.named_buffers())
    for step in range(2):
        x, y = batch(data, cfg, step=step, rank=0, world_size=1)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
    trained = _bn_stats(strategy.module.named_buffers())
    assert any(not torch.equal(trained[n], initial[n]) for n in trained), "training should move the statistics"

    def assembled() -> dict[str, torch.Tensor]:
        with strategy.eval_module() as parts:
            return {f"{name}.{n}": t for i, name in enumerate(parts.names)
                    for n, t in _bn_stats(parts.part(i).named_buffers()).items()}

    def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
        assert got.keys() == want.keys(), what
        wrong = [n for n in want if not torch.equal(got[n], want[n])]
        assert not wrong, f"{what}: {len(wrong)} statistics differ from the trained ones, e.g. {wrong[:3]}"

    same(assembled(), trained, "assembled")
    strategy._redraw(draw=1)
    same(_bn_stats(strategy.module.named_buffers()), trained, "after a re-draw")
    same(assembled(), trained, "assembled after a re-draw")
    saved = copy.deepcopy(strategy.checkpoint_state())
    with torch.no_grad():
        for n, t in strategy.module.named_buffers():
            if n.endswith("running_mean"):
                t.add_(1.0)
    strategy.load_checkpoint_state(saved)
    same(assembled(), trained, "assembled after loading a checkpoint")
