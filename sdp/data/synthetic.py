"""Synthetic image data (random tensors, random labels) for shape tests and throughput benchmarks.

Seeded, so every rank builds the same tensors; no learnable signal, so losses say nothing."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from sdp.data.base import DataBundle


def build(
    *, num_samples: int = 1024, num_val: int = 256, channels: int = 3, image_size: int = 32, num_classes: int = 10, seed: int = 0
) -> DataBundle:
    g = torch.Generator().manual_seed(seed)
    shape = (channels, image_size, image_size)

    def make(n: int) -> TensorDataset:
        return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, num_classes, (n,), generator=g))

    return DataBundle(
        train=make(num_samples), val=make(num_val), task="classification", num_classes=num_classes, input_shape=shape
    )
