"""Swin Transformer (torchvision's implementation) cut into SDP units.

torchvision's ``SwinTransformer`` is built as is, then re-assembled: its patch embedding becomes the
stem, every ``SwinTransformerBlock`` becomes one :class:`SwinUnit` (a ResidualBlock holding that
block's own ``norm1``/``attn``/``norm2``/``mlp`` modules, so weights and init are torchvision's),
every ``PatchMerging`` layer stays a shared non-unit block, and final norm + pooling + classifier are
the head. Stochastic depth is off by default (``stochastic_depth_prob=0``): in this suite block
dropping is owned by SDP and the stochastic-depth baseline, through ``active``/``branch_scale``.
Neuron-level SDP may split the MLP hidden units; heads are not declared because torchvision fuses
q, k and v in one ``qkv`` projection (a head is three strided row blocks, not one slice).
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models.swin_transformer import ShiftedWindowAttention, SwinTransformer, SwinTransformerBlock

from sdp.models.base import HiddenDim, HiddenSlice, ResidualBlock, SDPModel, split_output


class SwinMLP(nn.Sequential):
    """torchvision's Swin MLP, ``Sequential(Linear, GELU, Dropout, Linear, Dropout)``, with the same
    children (so the same parameter names and values), whose forward takes the scale of what its hidden
    units produce (fc2's bias not scaled). A module of its own so that its work is counted as its own
    (``HiddenDim.branch="mlp"``: the FLOP counter keys work by the module called)."""

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:  # noqa: D102
        fc1, act, drop1, fc2, drop2 = self
        return drop2(split_output(fc2, drop1(act(fc1(x))), scale=scale))


class SwinUnit(ResidualBlock):
    """x + s * attn(norm1(x)), then + s * mlp(norm2(.)): one torchvision Swin block as an SDP unit.
    At neuron level only the MLP is split, so only what its hidden units produce is rescaled."""

    def __init__(self, block: SwinTransformerBlock) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, SwinMLP(*block.mlp)

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.branch_scale * self.attn(self.norm1(x))  # no hidden dim splits attn: never a hidden scale
        return x + self.branch_scale * self.mlp(self.norm2(x), scale=self.scale_of("mlp"))

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        # torchvision's MLP is Sequential(Linear, GELU, Dropout, Linear, Dropout).
        fc1, fc2 = self.mlp[0], self.mlp[3]
        assert isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear), f"unexpected Swin MLP layout {self.mlp}"
        slices = (HiddenSlice("mlp.0.weight", 0), HiddenSlice("mlp.0.bias", 0), HiddenSlice("mlp.3.weight", 1))
        return (HiddenDim(name="mlp", size=fc1.out_features, slices=slices, branch="mlp"),)


class Swin(SDPModel):
    """Swin-T by default (embed 96, depths 2-2-6-2, heads 3-6-12-24, window 7, patch 4; 224x224)."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 224,
        patch_size: int = 4,
        embed_dim: int = 96,
        depths: tuple[int, ...] | list[int] = (2, 2, 6, 2),
        num_heads: tuple[int, ...] | list[int] = (3, 6, 12, 24),
        window_size: int = 7,
        mlp_ratio: float = 4.0,
        stochastic_depth_prob: float = 0.0,
    ) -> None:
        super().__init__()
        if in_channels != 3:
            raise ValueError(f"model.in_channels={in_channels}: torchvision's Swin patch embedding takes 3 channels")
        self.image_size = image_size
        tv = SwinTransformer(
            patch_size=[patch_size, patch_size], embed_dim=embed_dim, depths=list(depths), num_heads=list(num_heads),
            window_size=[window_size, window_size], mlp_ratio=mlp_ratio, stochastic_depth_prob=stochastic_depth_prob,
            num_classes=num_classes,
        )
        self.stem = tv.features[0]
        blocks: list[nn.Module] = []
        for layer in list(tv.features)[1:]:
            if isinstance(layer, nn.Sequential):  # a stage of Swin blocks
                unit = SwinUnit if stochastic_depth_prob == 0 else _SDSwinUnit
                blocks.extend(unit(b) for b in layer)
            else:  # PatchMerging: shared, changes the residual stream's shape
                blocks.append(layer)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(tv.norm, tv.permute, tv.avgpool, tv.flatten, tv.head)

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 3, self.image_size, self.image_size)

    def init_module(self, module: nn.Module) -> bool:
        """torchvision's scheme: truncated normal Linear weights with zero biases; a window attention's
        bias table drawn again and its (constant) position index recomputed."""
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            return True
        if isinstance(module, ShiftedWindowAttention):
            module.define_relative_position_bias_table()  # new CPU tensors (materialisation happens on the CPU)
            module.define_relative_position_index()
            return True
        return False


class _SDSwinUnit(SwinUnit):
    """A Swin unit that keeps torchvision's per-block stochastic depth (only when asked for)."""

    def __init__(self, block: SwinTransformerBlock) -> None:
        super().__init__(block)
        self.stochastic_depth = block.stochastic_depth

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.branch_scale * self.stochastic_depth(self.attn(self.norm1(x)))
        return x + self.branch_scale * self.stochastic_depth(self.mlp(self.norm2(x), scale=self.scale_of("mlp")))
