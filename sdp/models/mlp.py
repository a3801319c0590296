"""A small residual MLP: the cheapest model that still has SDP units at block and neuron level."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from sdp.models.base import HiddenDim, HiddenSlice, ResidualBlock, SDPModel, split_output


class MLPBlock(ResidualBlock):
    """Pre-norm residual MLP block: x + scale * fc2(gelu(fc1(norm(x)))); at neuron level the scale is on
    what the hidden units produce, not on fc2's bias (added once by every holder)."""

    def __init__(self, *, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain("") * split_output(self.fc2, F.gelu(self.fc1(self.norm(x))), scale=self.scale_of(""))

    def gated_branches(self) -> dict[str, tuple[str, ...]]:
        """The branch ends in ``fc2``: its weight and bias."""
        return {"": ("fc2.weight", "fc2.bias")}

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        slices = (HiddenSlice("fc1.weight", 0), HiddenSlice("fc1.bias", 0), HiddenSlice("fc2.weight", 1))
        return (HiddenDim(name="mlp", size=self.fc1.out_features, slices=slices, branch=""),)


class MLP(SDPModel):
    """Flatten -> Linear(in, dim) -> depth x MLPBlock -> LayerNorm -> Linear(dim, classes)."""

    def __init__(
        self, *, num_classes: int, input_shape: tuple[int, ...] | list[int], dim: int = 128, hidden: int = 256, depth: int = 4
    ) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        in_features = 1
        for s in self.input_shape:
            in_features *= s
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(in_features, dim))
        self.blocks = nn.ModuleList(MLPBlock(dim=dim, hidden=hidden) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, *self.input_shape)
