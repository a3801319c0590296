"""A small Vision Transformer for 32x32 images (patch 4 -> 64 tokens), DeiT-Ti/S widths.

Stem: patch embedding (a strided conv), learned position embeddings and, with ``pool="cls"``, a
class token. Blocks: pre-norm :class:`sdp.models.transformer.TransformerBlock` (LayerNorm,
bidirectional attention with biases, GELU MLP), each one SDP unit declaring MLP hidden units and
attention heads. Head: LayerNorm, class token or mean over tokens, linear classifier.
"""

from __future__ import annotations

import torch
from torch import nn

from sdp.models.base import SDPModel
from sdp.models.transformer import TransformerBlock

POOLS = ("cls", "mean")


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> tokens (B, [1 +] H/p * W/p, dim) with position embeddings."""

    def __init__(self, *, in_channels: int, image_size: int, patch_size: int, dim: int, cls_token: bool) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be a multiple of patch_size={patch_size}")
        n = (image_size // patch_size) ** 2 + int(cls_token)
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None
        self.pos = nn.Parameter(torch.randn(1, n, dim) * 0.02)

    def reset_parameters(self) -> None:
        """The class token at zero, position embeddings N(0, 0.02) (the projection is its own module)."""
        if self.cls is not None:
            nn.init.zeros_(self.cls)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.proj(x).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1)
        return x + self.pos


class ViTHead(nn.Module):
    """LayerNorm, then the class token (``pool="cls"``) or the token mean, then a linear classifier."""

    def __init__(self, *, dim: int, num_classes: int, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.norm(x)
        return self.fc(x[:, 0] if self.pool == "cls" else x.mean(dim=1))


class ViT(SDPModel):
    """Pre-norm ViT; ``depth`` blocks of width ``dim`` with ``n_heads`` heads and ``mlp_ratio * dim`` MLP."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        patch_size: int = 4,
        dim: int = 192,
        depth: int = 12,
        n_heads: int = 3,
        mlp_ratio: float = 4.0,
        pool: str = "cls",
    ) -> None:
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"model.pool={pool!r} is invalid: allowed {', '.join(POOLS)}")
        self.in_channels, self.image_size = in_channels, image_size
        self.stem = PatchEmbed(in_channels=in_channels, image_size=image_size, patch_size=patch_size, dim=dim,
                               cls_token=pool == "cls")
        self.blocks = nn.ModuleList(
            TransformerBlock(dim=dim, n_heads=n_heads, hidden=int(dim * mlp_ratio), norm="layer", mlp="gelu",
                             bias=True, causal=False, rotary_base=None)
            for _ in range(depth)
        )
        self.head = ViTHead(dim=dim, num_classes=num_classes, pool=pool)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def init_module(self, module: nn.Module) -> bool:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        return isinstance(module, nn.Linear)

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.in_channels, self.image_size, self.image_size)
