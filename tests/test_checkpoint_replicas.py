"""The default checkpoint of a strategy whose replicas differ (issue 35, item 2).

``Strategy.checkpoint_state`` used to write rank 0's parameters and optimizer state once ("shared") for
every strategy that did not override it, so a strategy whose ranks hold different weights between
synchronisations (local SGD, DiLoCo, gossip) resumed every other rank from rank 0's copy, silently. Now a
strategy declares ``replicas_identical`` (the DDP family does); one that does not gets each rank's own copy.

``LocalSGD`` below is such a strategy, on 2 spawned gloo ranks: each rank steps on its own data and the
replicas are averaged every ``SYNC`` steps, so at the checkpoint (between averages) they differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sdp.errors import ConfigError
from sdp.metrics.timing import PhaseTimer
from sdp.models.mlp import MLP
from sdp.parallel import STRATEGIES
from sdp.parallel.base import StepResult, Strategy
from sdp.parallel.job import JobFacts
from sdp.rank import checkpoint
from sdp.core.distctx import DistContext
from sdp.core.loss import loss_fn
from tests.helpers import CORE, spawn

KEY = {"seed": 0, "global_batch": 8, "num_samples": 64}
SYNC, SAVE_AT, STEPS = 4, 3, 6  # averages after steps 4 and 8 (1-based); the checkpoint after step 3: replicas differ


class LocalSGD(Strategy):
    """Local SGD (a stand-in): every rank updates its own replica; the replicas are averaged every
    ``SYNC`` steps. Declares nothing, so its replicas are not taken to be identical."""

    def setup(self, *, model, optimizer_factory) -> None:  # type: ignore[no-untyped-def]
        self.module = model
        self.optimizer = optimizer_factory(model.parameters())

    def train_step(self, *, inputs, targets, loss_fn, timer, step) -> StepResult:  # type: ignore[no-untyped-def]
        loss = loss_fn(self.module(inputs), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if (step + 1) % SYNC == 0:
            with torch.no_grad():
                for p in self.module.parameters():
                    dist.all_reduce(p)
                    p.div_(self.ctx.world_size)
        return StepResult(loss_sum=loss.detach() * inputs.shape[0], count=inputs.shape[0])


def _make(rank: int, world: int, init_seed: int) -> tuple[Strategy, Any]:
    torch.manual_seed(init_seed)  # the same on every rank: the replicas start equal, as local SGD's do
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    s = LocalSGD(cfg=None, job=JobFacts(world_size=world), ctx=ctx)
    s.setup(model=MLP(num_classes=3, input_shape=(4,), dim=8, hidden=16, depth=2),
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    return s, torch.optim.lr_scheduler.LambdaLR(s.optimizer, lambda k: 1.0 / (k + 1))


def _steps(s: Strategy, sched: Any, *, first: int, last: int) -> None:
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + s.ctx.rank)  # each rank its own data
        x, y = torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
        s.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=PhaseTimer(device=torch.device("cpu")), step=step)
        sched.step()


def _state(s: Strategy) -> dict[str, torch.Tensor]:
    out = {f"param.{k}": v.clone() for k, v in s.unwrapped().state_dict().items()}
    for i, st in s.optimizer.state_dict()["state"].items():
        out[f"momentum.{i}"] = st["momentum_buffer"].clone()
    return out


def _run(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    a, sa = _make(rank, world, init_seed=0)
    _steps(a, sa, first=0, last=SAVE_AT)
    at_save = _state(a)
    checkpoint.save(run_dir=Path(run_dir), step=SAVE_AT, strategy=a, scheduler=sa, train_state={"step": SAVE_AT},
                    data_key=KEY, keep=0)
    _steps(a, sa, first=SAVE_AT, last=STEPS)  # the uninterrupted run
    b, sb = _make(rank, world, init_seed=123)  # a different init: everything must come from the checkpoint
    checkpoint.load(path=checkpoint.step_dir(Path(run_dir), SAVE_AT), strategy=b, scheduler=sb, data_key=KEY)
    restored = _state(b)
    _steps(b, sb, first=SAVE_AT, last=STEPS)
    return {"at_save": at_save, "restored": restored, "uninterrupted": _state(a), "resumed": _state(b)}


def _differing(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in x if not torch.equal(x[k], y[k])]


@pytest.mark.dist
@CORE
@pytest.mark.timeout(120)
def test_replicas_that_differ_resume_each_its_own(tmp_path: Path) -> None:
    got = spawn(_run, world=2, args=(str(tmp_path),), timeout_s=100)
    assert _differing(got[0]["at_save"], got[1]["at_save"]), "the replicas are equal at the checkpoint: nothing tested"
    for r, g in enumerate(got):
        assert not _differing(g["at_save"], g["restored"]), \
            f"rank {r} restored other values than it saved: {_differing(g['at_save'], g['restored'])}"
        assert not _differing(g["uninterrupted"], g["resumed"]), \
            f"rank {r}'s resumed run left the uninterrupted one at {_differing(g['uninterrupted'], g['resumed'])}"
    files = sorted(p.name for p in checkpoint.step_dir(tmp_path, SAVE_AT).iterdir())
    assert files == ["meta.json", "rank00000.pt", "rank00001.pt", "shared.pt"], files
    shared = torch.load(checkpoint.step_dir(tmp_path, SAVE_AT) / "shared.pt", weights_only=True)["shared"]
    assert shared == {}, f"a replica's parameters went into shared.pt: {sorted(shared)}"


def test_identical_replicas_keep_the_shared_layout() -> None:
    """The DDP family declares identical replicas, so its checkpoints keep the layout they always had
    (parameters and optimizer state once, under "shared"; buffers per rank): old checkpoints load."""
    family = {name for name in STRATEGIES.names() if STRATEGIES.get(name).runtime.replicas_identical}
    assert family == {"ddp", "ddp_ac", "ddp_stochastic_depth", "ddp_layerdrop", "powersgd"}, family
    assert not Strategy.replicas_identical and not LocalSGD.replicas_identical

    class Replicated(LocalSGD):
        replicas_identical = True

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    written: dict[type, dict[str, Any]] = {}
    for cls, layout in ((Replicated, {"shared": ["model", "optimizer"], "local": ["buffers"]}),
                        (LocalSGD, {"local": ["buffers", "model", "optimizer"]})):
        s = cls(cfg=None, job=JobFacts(), ctx=ctx)
        s.setup(model=MLP(num_classes=3, input_shape=(4,), dim=8, hidden=16, depth=2),
                optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
        state = s.checkpoint_state()
        assert {k: sorted(v) for k, v in state.items()} == layout, (cls.__name__, {k: sorted(v) for k, v in state.items()})
        s.load_checkpoint_state(state)
        written[cls] = state
    # a checkpoint of the other layout is refused by name, not loaded as rank 0's copy or failed with a KeyError
    with pytest.raises(ConfigError, match=r"^parallelism.name='LocalSGD' \(replicas_identical=False\) reads its parameters "
                                          r"from the checkpoint's 'local' part, which holds none"):
        s.load_checkpoint_state(written[Replicated])
