"""The embedded default dataset: scikit-learn's bundled real 8x8 handwritten digits (1797 images).

Needs no download, so a fresh machine trains on real data at once. Images are scaled to [0, 1],
normalised with the training-split statistics, resized to ``image_size`` and optionally repeated to
3 channels; the train/val split is a fixed permutation (seed 0), the same on every machine.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from sdp.data.base import DataBundle


def build(
    *, image_size: int = 8, channels: int = 1, val_fraction: float = 0.2, split_seed: int = 0, num_classes: int = 10
) -> DataBundle:
    """Digits as in-memory tensors of shape (N, channels, image_size, image_size)."""
    if num_classes != 10:
        raise ValueError(f"dataset.num_classes={num_classes} is invalid: the digits set has exactly 10 classes")
    from sklearn.datasets import load_digits

    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"dataset.val_fraction={val_fraction} must be in (0, 1)")
    if channels not in (1, 3):
        raise ValueError(f"dataset.channels={channels} must be 1 or 3")
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(round(len(x) * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    if channels == 3:
        x = x.repeat(1, 3, 1, 1)
    return DataBundle(
        train=TensorDataset(x[train_idx].contiguous(), y[train_idx]),
        val=TensorDataset(x[val_idx].contiguous(), y[val_idx]),
        task="classification",
        num_classes=10,
        input_shape=(channels, image_size, image_size),
    )
