"""CIFAR-style ResNet-18 (3x3 stem, no max-pool) built from SDP-declared BasicBlocks.

A ``width`` knob scales every stage (64 is the standard ResNet-18; 8 or 16 train in seconds on a
CPU). Each BasicBlock is an SDP unit; its hidden width (conv1 outputs = bn1 = conv2 inputs) is what
neuron-level SDP splits; a downsampling block keeps its projection shortcut shared.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from sdp.models.base import HiddenDim, HiddenSlice, ResidualBlock, SDPModel


class BasicBlock(ResidualBlock):
    """relu(shortcut(x) + scale * bn2(conv2(relu(bn1(conv1(x))))))."""

    def __init__(self, *, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(self.forward_skip_pre(x) + self.branch_scale * out)

    def forward_skip_pre(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.shortcut is None else self.shortcut(x)

    def forward_skip(self, x: torch.Tensor) -> torch.Tensor:
        # x is already post-ReLU for an identity shortcut, so relu(x) == x: a true identity.
        return x if self.shortcut is None else F.relu(self.shortcut(x))

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        slices = tuple(
            HiddenSlice(t, 0)
            for t in ("conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var")
        ) + (HiddenSlice("conv2.weight", 1),)
        return (HiddenDim(name="mid", size=self.conv1.out_channels, slices=slices),)

    def shared_submodules(self) -> tuple[str, ...]:
        return ("shortcut",) if self.shortcut is not None else ()


class ResNetCIFAR(SDPModel):
    """ResNet-18 layout for small images: stem conv3x3 -> 4 stages x ``blocks_per_stage`` -> head."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        width: int = 64,
        blocks_per_stage: tuple[int, ...] | list[int] = (2, 2, 2, 2),
    ) -> None:
        super().__init__()
        self.in_channels, self.image_size = in_channels, image_size
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        ch = width
        for stage, n in enumerate(blocks_per_stage):
            out_ch = width * 2**stage
            for j in range(n):
                stride = 2 if (stage > 0 and j == 0) else 1
                blocks.append(BasicBlock(in_ch=ch, out_ch=out_ch, stride=stride))
                ch = out_ch
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, num_classes))

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.in_channels, self.image_size, self.image_size)
