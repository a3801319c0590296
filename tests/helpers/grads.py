"""Ground truth for the strategy gradient tests: a seeded tiny residual MLP, a seeded global batch,
the single-process gradient on it, and an SGD that keeps the gradients it was asked to apply."""

from __future__ import annotations

from typing import Any

import torch


class CapturingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of every gradient it is asked to apply (the synchronised ones)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.captured: list[torch.Tensor | None] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.captured = [None if p.grad is None else p.grad.detach().clone()
                         for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def reference_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the mean cross-entropy over the whole batch in one process (the ground truth)."""
    from sdp.core.loss import loss_fn

    model.zero_grad()
    loss_fn(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def small_mlp(*, depth: int) -> torch.nn.Module:
    """The tiny residual MLP the strategy gradient tests use (seeded: identical on every rank)."""
    from sdp.models.mlp import MLP

    torch.manual_seed(0)
    return MLP(num_classes=10, input_shape=(1, 4, 4), dim=16, hidden=24, depth=depth)


def global_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` seeded 1x4x4 inputs with labels: the global batch every rank slices."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 10, (n,), generator=g)
