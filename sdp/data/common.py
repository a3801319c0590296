"""Helpers every file-backed dataset shares: root checks, the in-memory decision, flip+crop augmentation."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

IN_MEMORY = ("auto", True, False)


def require_dir(*, key: str, path: str | Path | None, what: str) -> Path:
    """``path`` as a Path, or a FileNotFoundError naming the config key and what belongs there."""
    if path is None or str(path) in ("", "None", "???"):
        raise FileNotFoundError(f"{key} is not set: point it at {what}")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{key}={str(path)!r}: no such directory; expected {what}")
    return p


def preflight(node: Any) -> None:
    """Run the dataset module's ``preflight(**keys)`` (if it has one) in the driver, before any rank starts,
    so a wrong root or a bad shard costs a second, not a launch."""
    module_name, _, fn_name = str(node["_target_"]).rpartition(".")
    check = getattr(importlib.import_module(module_name), "preflight", None)
    if check is not None:
        check(**{k: v for k, v in node.items() if k not in ("name", "_target_")})


def use_in_memory(*, setting: str | bool, nbytes: int, max_mb: float) -> bool:
    """Whether to hold the whole dataset as tensors (``auto``: when it needs at most ``max_mb``)."""
    if setting not in IN_MEMORY:
        raise ValueError(f"dataset.in_memory={setting!r} is invalid: allowed auto, true, false")
    if setting == "auto":
        return nbytes <= max_mb * 2**20
    return bool(setting)


class FlipCrop:
    """Random crop with ``padding`` (padded with ``fill``, per channel) and horizontal flip, on batches.

    The in-memory counterpart of torchvision's ``RandomCrop(size, padding)`` + ``RandomHorizontalFlip``
    (fill = what a black pixel normalises to, as torchvision pads before normalising).
    """

    def __init__(self, *, padding: int, fill: torch.Tensor) -> None:
        self.padding, self.fill = padding, fill.float()

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        offsets = torch.randint(0, 2 * self.padding + 1, (n, 2), generator=generator)
        flips = torch.randint(0, 2, (n, 1), generator=generator)
        return torch.cat((offsets, flips), dim=1)

    def apply(self, x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.padding
        padded = self.fill.to(x).view(1, c, 1, 1).expand(b, c, h + 2 * p, w + 2 * p).clone()
        padded[:, :, p : p + h, p : p + w] = x
        rows = (params[:, 0:1] + torch.arange(h)).to(x.device)  # (B, H)
        cols = (params[:, 1:2] + torch.arange(w)).to(x.device)  # (B, W)
        bi = torch.arange(b, device=x.device).view(b, 1, 1, 1)
        ci = torch.arange(c, device=x.device).view(1, c, 1, 1)
        out = padded[bi, ci, rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]
        flip = params[:, 2].bool().to(x.device).view(b, 1, 1, 1)
        return torch.where(flip, out.flip(-1), out)
