"""Synthetic data (seeded random tensors) for shape tests and throughput benchmarks.

Every rank builds the same tensors; there is no learnable signal, so losses say nothing.
``build`` makes images with random labels (``dataset=synthetic_image``, alias ``synthetic``),
``build_text`` random token sequences (``dataset=synthetic_text``, next-token targets).
"""

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


def build_text(
    *, num_samples: int = 512, num_val: int = 64, seq_len: int = 64, vocab_size: int = 256, seed: int = 0
) -> DataBundle:
    """Random token windows of ``seq_len + 1``; x = window[:-1], y = window[1:] (the LM layout)."""
    g = torch.Generator().manual_seed(seed)

    def make(n: int) -> TensorDataset:
        w = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)
        return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())

    return DataBundle(train=make(num_samples), val=make(num_val), task="lm", num_classes=vocab_size, input_shape=(seq_len,))
