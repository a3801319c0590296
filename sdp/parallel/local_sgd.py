"""``parallelism=local_sgd`` (and its preset ``diloco``): local SGD and DiLoCo, the communication baseline.

Why it is here: the reviewers asked what an honest communication baseline is, and local SGD / DiLoCo
(Douillard et al. 2023, arXiv 2311.08105) is one of the field's answers: every worker holds the whole model
and its own inner optimizer (the job's ``optim`` node), takes ``inner_steps`` = H optimizer steps on its own
data without any collective, then the workers average their parameter change since the last
synchronisation (one all-reduce over the world of the flattened change, float BatchNorm buffers appended)
and apply an outer step to the global parameters: SGD with (Nesterov) momentum on that averaged change as
the outer gradient, state in float32 on every rank. ``outer_lr = 1`` and ``outer_momentum = 0`` is plain
local SGD (the replicas are averaged); H = 1 with inner SGD is then DDP with SGD (an average of the updated
replicas is the update of the averaged gradient, the optimizer being linear), which the tests hold it to.

- The run's last step always synchronises (``JobFacts.steps``), so the final model is one model.
- Evaluation right after a synchronisation evaluates the replica (every rank holds the same one); an
  evaluation between synchronisations evaluates the last synchronised global parameters (DiLoCo's practice)
  with the ranks' current buffers averaged, and puts every rank's own replica and buffers back after, so
  evaluating does not change training.
- Communication is recorded in the training step where it happens, every H steps: ``summary.json``'s
  ``comm.bytes_per_step``, the mean over the measured steps, is then the change's bytes / H (plus the one
  extra synchronisation of a last step that is not a multiple of H).
- Replicas differ between synchronisations, so ``replicas_identical`` is False: each rank checkpoints its own
  replica and inner optimizer state, with the outer state (global parameters, outer momentum, the inner-step
  phase) under ``"local"``, and a run resumed mid-period continues bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from sdp.core.fields import Number, flag, key
from sdp.metrics import memory
from sdp.metrics.timing import PhaseTimer
from sdp.models.base import SDPModel
from sdp.parallel.base import OptimizerFactory, Strategy
from sdp.parallel.job import JobFacts
from sdp.parallel.local_sgd_plan import local_sgd_entries, local_sgd_peaks
from sdp.parallel.spec import Overlap, StrategySpec, register
from sdp.parallel.plan_entries import Entry


def synced_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers averaged at a synchronisation: the float ones of the state (BatchNorm statistics). Integer
    ones (counters) are equal on every rank; non-persistent ones (a rotary table) are constants, which a mean
    over more than two ranks could change in the last bit."""
    state = model.state_dict(keep_vars=True)
    return [b for name, b in model.named_buffers() if b.is_floating_point() and name in state]


class LocalSGDStrategy(Strategy):
    """Every rank its own replica and inner optimizer; every ``inner_steps`` steps one outer step on the
    world's mean parameter change (module docstring)."""

    replicas_identical = False  # replicas differ between synchronisations: each rank checkpoints its own

    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        """The model as built (identically on every rank from ``seed``: the replicas start equal, no broadcast),
        its inner optimizer, and the outer state: the global parameters (the anchor every change is measured
        from) and, with ``outer_momentum`` > 0, the outer momentum, both float32."""
        model.to(self.ctx.device)
        self.module = model
        self.optimizer = optimizer_factory(model.parameters())
        self.inner_steps, self.outer_lr = int(self.cfg.inner_steps), float(self.cfg.outer_lr)
        self.outer_momentum, self.nesterov = float(self.cfg.outer_momentum), bool(self.cfg.nesterov)
        self.anchor = [p.detach().float().clone() for p in model.parameters()]
        self.velocity = [torch.zeros_like(a) for a in self.anchor] if self.outer_momentum > 0 else []
        self.phase = 0  # inner steps since the last synchronisation (0: the replicas are the global model)
        self.syncs = 0
        self._step = -1

    # ---- the step: the base template, a synchronisation after the optimizer every H steps ---------------
    def _before_step(self, *, step: int, timer: PhaseTimer) -> None:
        self._step = step

    def _after_step(self, *, timer: PhaseTimer) -> None:
        self.phase += 1
        if self.phase == self.inner_steps or self._step + 1 == self.job.steps:
            with timer.phase("comm"):
                self.synchronise()

    @torch.no_grad()
    def synchronise(self) -> None:
        """One outer step: the mean over the world of (anchor - replica) is the outer gradient; the outer
        SGD (momentum, Nesterov) updates the anchor, which every replica then copies. The change and the float
        buffers travel in one flat float32 all-reduce, counted under the training step's phase."""
        model = self.unwrapped()
        params, buffers = list(model.parameters()), synced_buffers(model)
        n = sum(p.numel() for p in params)
        flat = torch.empty(n + sum(b.numel() for b in buffers), dtype=torch.float32, device=self.ctx.device)
        grads, offset = [], 0
        for a, p in zip(self.anchor, params):
            g = flat[offset : offset + a.numel()].view_as(a)
            torch.sub(a, p.detach(), out=g)
            grads.append(g)
            offset += a.numel()
        for b in buffers:
            flat[offset : offset + b.numel()].copy_(b.reshape(-1))
            offset += b.numel()
        if self.ctx.world_size > 1:
            self.ctx.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=self.ctx.world_size)
            dist.all_reduce(flat)
            flat /= self.ctx.world_size
        mu = self.outer_momentum
        for i, (a, g, p) in enumerate(zip(self.anchor, grads, params)):
            if mu > 0:
                v = self.velocity[i]
                v.mul_(mu).add_(g)
                if self.nesterov:
                    g.add_(v, alpha=mu)
                else:
                    g.copy_(v)
            a.add_(g, alpha=-self.outer_lr)
            p.copy_(a)
        offset = n
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        self.phase, self.syncs = 0, self.syncs + 1

    # ---- evaluation: the synchronised model ---------------------------------------------------------
    @contextmanager
    def eval_module(self) -> Iterator[nn.Module]:
        """Right after a synchronisation (``phase`` 0) the replica, equal on every rank, as it is; between two,
        the last synchronised global parameters with the ranks' buffers averaged (counted as ``eval`` traffic),
        each rank's own replica and buffers put back afterwards."""
        model = self.unwrapped()
        if self.phase == 0:
            model.eval()
            try:
                yield model
            finally:
                model.train()
            return
        params, buffers = list(model.parameters()), list(model.buffers())
        own = [p.detach().clone() for p in params]
        own_buffers = [b.clone() for b in buffers]
        with torch.no_grad():
            for p, a in zip(params, self.anchor):
                p.copy_(a)
        try:
            with super().eval_module() as evaluated:  # the base's: buffers averaged (as eval traffic), eval mode
                yield evaluated
        finally:
            with torch.no_grad():
                for t, saved in zip(params + buffers, own + own_buffers):
                    t.copy_(saved)

    # ---- measurement and checkpoints ------------------------------------------------------------------
    def outer_bytes(self) -> int:
        """The outer state's bytes: the float32 global parameters and outer momentum."""
        return sum(t.numel() * t.element_size() for t in self.anchor + self.velocity)

    def state_bytes(self) -> dict[str, int]:
        """The base's bytes, the outer state counted as optimizer state (it is the outer optimizer's)."""
        out = super().state_bytes()
        return {**out, "optim_bytes": memory.optim_bytes(self.optimizer) + self.outer_bytes()}

    def summary_extra(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "nesterov": self.nesterov, "syncs": self.syncs, "outer_state_bytes": self.outer_bytes()}

    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """The base's per-rank replica, inner optimizer state and buffers (``"local"``), and the outer state."""
        state = super().checkpoint_state()
        state["local"]["outer"] = {"anchor": self.anchor, "velocity": self.velocity, "phase": self.phase, "syncs": self.syncs}
        return state

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        super().load_checkpoint_state(state)
        outer = state["local"]["outer"]
        assert len(outer["anchor"]) == len(self.anchor) and len(outer["velocity"]) == len(self.velocity), \
            f"checkpoint outer state of {len(outer['anchor'])} anchors / {len(outer['velocity'])} momenta, this run " \
            f"{len(self.anchor)} / {len(self.velocity)} (parallelism.outer_momentum changed?)"
        with torch.no_grad():
            for mine, saved in zip(self.anchor + self.velocity, list(outer["anchor"]) + list(outer["velocity"])):
                mine.copy_(saved)
        self.phase, self.syncs = int(outer["phase"]), int(outer["syncs"])


@dataclass
class LocalSGDConfig:
    """``parallelism=local_sgd`` (and ``diloco``): every rank trains its own replica for ``inner_steps`` steps, then
    one outer step on the averaged parameter change (sdp/parallel/local_sgd.py)."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    inner_steps: int = key(at_least=1)
    """H >= 1: inner optimizer steps between two synchronisations (1: every step)."""
    outer_lr: Number = key(above=0)
    """Outer learning rate > 0 on the averaged parameter change (1 with outer_momentum 0: plain local SGD)."""
    outer_momentum: Number = key(at_least=0, below=1)
    """Outer SGD momentum in [0, 1) (0: none)."""
    nesterov: bool = flag()
    """Nesterov outer momentum (DiLoCo) | heavy-ball; no effect at outer_momentum 0."""


@register("local_sgd")
class LocalSGDSpec(StrategySpec):
    """Local SGD / DiLoCo in the driver: the whole model on every worker (FLOP fraction 1), one exposed
    all-reduce of the parameter change every ``inner_steps`` steps."""

    runtime = LocalSGDStrategy
    schema: type = LocalSGDConfig  # every key's own rule (H >= 1, outer_lr > 0, outer_momentum in [0, 1)): no validate
    label_keys = ("inner_steps",)  # the label says H: "LocalSGD H=8", "DiLoCo H=8"
    overlap = Overlap()  # the synchronisation runs after the optimizer step: behind no compute
    plan_note = "local SGD / DiLoCo: comm per step is the synchronisation's bytes / inner_steps"

    @classmethod
    def method_label(cls, *, cfg: DictConfig) -> str:
        """``LocalSGD H=<H>`` for the plain average (outer_lr 1, no outer momentum), else ``DiLoCo H=<H>``."""
        plain = float(cfg.outer_lr) == 1.0 and float(cfg.outer_momentum) == 0.0
        return f"{'LocalSGD' if plain else 'DiLoCo'} H={int(cfg.inner_steps)}"

    @classmethod
    def predict(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, facts: dict[str, Any],
                prepared: Any = None) -> list[Entry]:
        return local_sgd_entries(cfg=cfg, job=job, model=model, facts=facts)

    @classmethod
    def predict_peaks(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, eval_batch: int, steps: int,
                      eval_steps: frozenset[int], state: list[dict[str, Any]], prepared: Any = None) -> list[dict[str, int]] | None:
        return local_sgd_peaks(cfg=cfg, job=job, model=model, eval_batch=eval_batch, steps=steps, eval_steps=eval_steps)
