"""A model that raises on one rank at a chosen step: drives the fail-fast test through the real
launcher without any debug hook in the library."""

from __future__ import annotations

import os

import torch

from sdp.models.mlp import MLP


class FaultyMLP(MLP):
    """An MLP whose forward raises ``RuntimeError`` on rank ``fail_rank`` at training step ``fail_step``."""

    def __init__(self, *, fail_rank: int, fail_step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_rank, self.fail_step, self.calls = fail_rank, fail_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.fail_step + 1 and int(os.environ.get("RANK", -1)) == self.fail_rank:
                raise RuntimeError(f"injected failure on rank {self.fail_rank} at step {self.fail_step}")
        return super().forward(x)
