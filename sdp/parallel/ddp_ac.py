"""DDP with activation checkpointing: every ``ac_every``-th block runs under non-reentrant
``torch.utils.checkpoint``, so only its input is kept and its activations are recomputed in backward.

Why patch the blocks' ``forward`` instead of wrapping them in a module: parameter and buffer names
stay those of the plain model (checkpoints and the gradient tests compare by name). Why restore
buffers after the recomputation: recomputing a BatchNorm forward in training mode would update its
running statistics a second time, so DDP+AC would evaluate differently from DDP; the recomputation
must repeat the forward's values and leave no other trace. Activation bytes are measured by the
trainer for every strategy (``memory.per_rank[*].activation_bytes``); checkpointed inputs are
reported to that meter with :func:`sdp.metrics.activations.note_retained`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from sdp.driver.fields import conform
from sdp.driver.schema_parallel import DDPAC
from sdp.metrics.activations import note_retained
from sdp.models.base import SDPModel
from sdp.parallel.base import OptimizerFactory
from sdp.parallel.ddp import DDPSpec, DDPStrategy
from sdp.parallel.job import Job
from sdp.parallel.spec import register


@contextmanager
def restored_buffers(module: nn.Module) -> Iterator[None]:
    """Run the block, then put every buffer back as it was (no double BatchNorm statistics update)."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def checkpointed_forward(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``block``'s forward under non-reentrant checkpointing, recomputation without side effects."""
    inner = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls = 0

        def run(inp: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:
                return inner(inp)
            with restored_buffers(block):  # the recomputation in backward
                return inner(inp)

        note_retained(x)  # the checkpoint keeps its input alive for the recomputation
        return checkpoint(run, x, use_reentrant=False)

    return forward


def apply_checkpointing(model: SDPModel, *, every: int) -> list[int]:
    """Checkpoint blocks 0, every, 2*every, ...; returns their indices."""
    chosen = list(range(0, len(model.blocks), every))
    for i in chosen:
        model.blocks[i].forward = checkpointed_forward(model.blocks[i])  # instance attribute shadows the method
    return chosen


class DDPActivationCheckpointStrategy(DDPStrategy):
    """DDP whose blocks trade recomputation for activation memory."""

    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        self.checkpointed = apply_checkpointing(model, every=int(self.cfg.ac_every))
        super().setup(model=model, optimizer_factory=optimizer_factory)

    def summary_extra(self) -> dict[str, Any]:
        return {"checkpointed_blocks": self.checkpointed}


@register("ddp_ac")
class DDPActivationCheckpointSpec(DDPSpec):
    """DDP+AC in the driver: DDP's prediction with the checkpointed blocks applied to the meta model."""

    label = "DDP+AC"
    runtime = DDPActivationCheckpointStrategy

    @classmethod
    def validate(cls, *, cfg: DictConfig, job: Job) -> None:
        """Each key's own rule (``ac_every`` >= 1, DDP's keys) is its schema's:
        :class:`sdp.driver.schema_parallel.DDPAC`; no rule here involves several keys."""
        conform(cfg, schema=DDPAC, prefix="parallelism")

    @classmethod
    def prepare_for_plan(cls, *, model: SDPModel, cfg: DictConfig) -> None:
        apply_checkpointing(model, every=int(cfg.ac_every))
