"""ResNets built from SDP-declared residual blocks: CIFAR-style ResNet-18 and ImageNet ResNet-18/50.

One :class:`ResNet` covers both stems: ``stem="cifar"`` (3x3 conv, no max-pool, for 32x32 inputs)
and ``stem="imagenet"`` (7x7 stride-2 conv + 3x3 max-pool, torchvision's layout). Blocks are
:class:`BasicBlock` (ResNet-18/34) or :class:`Bottleneck` (ResNet-50/101, torchvision's v1.5 with the
stride on the 3x3 conv). Each block is an SDP unit; its hidden widths (the channels between its
convolutions) are what neuron-level SDP splits; a downsampling block keeps its projection shortcut
shared, because the residual stream after it has a new shape even when the branch is dropped.
Parameter names match torchvision's blocks (``conv1``, ``bn1``, ...), so a torchvision checkpoint maps
over with :meth:`ResNet.load_torchvision_state_dict` (only ``downsample`` becomes ``shortcut``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from sdp.models.base import HiddenDim, HiddenSlice, ResidualBlock, SDPModel

_BN_TENSORS = ("weight", "bias", "running_mean", "running_var")


def conv_bn_slices(*, conv: str, bn: str, consumer: str) -> tuple[HiddenSlice, ...]:
    """Slices of one hidden channel dim: ``conv`` output rows, ``bn`` vectors, ``consumer`` input columns."""
    return (
        (HiddenSlice(f"{conv}.weight", 0),)
        + tuple(HiddenSlice(f"{bn}.{t}", 0) for t in _BN_TENSORS)
        + (HiddenSlice(f"{consumer}.weight", 1),)
    )


class ShortcutBlock(ResidualBlock):
    """relu(shortcut(x) + scale * residual(x)); the shortcut is identity or a shared 1x1 projection.

    Every hidden dim's ``branch`` is ``""``, the whole residual: the last conv's output is the sum over
    the split channels and the closing BatchNorm acts on that sum, so the neuron-level scale multiplies
    the branch's output (after the norm) as the block-level one does."""

    shortcut: nn.Module | None
    normalised_branch = True  # the branch ends in bn2 (BasicBlock) / bn3 (Bottleneck)

    def _make_shortcut(self, *, in_ch: int, out_ch: int, stride: int) -> None:
        self.shortcut = None
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.forward_skip_pre(x) + self.gain("") * self.scale_of("") * self.residual(x))

    def gated_branches(self) -> dict[str, tuple[str, ...]]:
        """The whole residual, which ends in its last BatchNorm: its affine scale and shift."""
        last = "bn3" if hasattr(self, "bn3") else "bn2"
        return {"": (f"{last}.weight", f"{last}.bias")}

    def forward_skip_pre(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.shortcut is None else self.shortcut(x)

    def forward_skip(self, x: torch.Tensor) -> torch.Tensor:
        # x is already post-ReLU for an identity shortcut, so relu(x) == x: a true identity.
        return x if self.shortcut is None else F.relu(self.shortcut(x))

    def shared_submodules(self) -> tuple[str, ...]:
        return ("shortcut",) if self.shortcut is not None else ()


class BasicBlock(ShortcutBlock):
    """Two 3x3 convs; hidden width ``mid`` = conv1 outputs = bn1 = conv2 inputs."""

    expansion = 1

    def __init__(self, *, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self._make_shortcut(in_ch=in_ch, out_ch=out_ch, stride=stride)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        return (HiddenDim(name="mid", size=self.conv1.out_channels, branch="",
                          slices=conv_bn_slices(conv="conv1", bn="bn1", consumer="conv2")),)


class Bottleneck(ShortcutBlock):
    """1x1 reduce -> 3x3 (stride here, torchvision v1.5) -> 1x1 expand (x4); two hidden widths. The 3x3
    conv is sliced by both (inputs mid1, outputs mid2), so neuron-level SDP refuses the block
    (:func:`sdp.subnet.plan.cross_sliced`) and runs it at block level only."""

    expansion = 4

    def __init__(self, *, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        width = out_ch // self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self._make_shortcut(in_ch=in_ch, out_ch=out_ch, stride=stride)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        w = self.conv1.out_channels
        return (
            HiddenDim(name="mid1", size=w, slices=conv_bn_slices(conv="conv1", bn="bn1", consumer="conv2"), branch=""),
            HiddenDim(name="mid2", size=w, slices=conv_bn_slices(conv="conv2", bn="bn2", consumer="conv3"), branch=""),
        )


BLOCKS: dict[str, type[ShortcutBlock]] = {"basic": BasicBlock, "bottleneck": Bottleneck}
STEMS = ("imagenet", "cifar")


class ResNet(SDPModel):
    """stem -> 4 stages of ``blocks_per_stage`` blocks (stage s has ``width * 2**s`` planes) -> pool+fc."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 224,
        width: int = 64,
        blocks_per_stage: tuple[int, ...] | list[int] = (2, 2, 2, 2),
        block: str = "basic",
        stem: str = "imagenet",
    ) -> None:
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"model.block={block!r} is invalid: allowed {', '.join(BLOCKS)}")
        if stem not in STEMS:
            raise ValueError(f"model.stem={stem!r} is invalid: allowed {', '.join(STEMS)}")
        self.in_channels, self.image_size, self.blocks_per_stage = in_channels, image_size, tuple(blocks_per_stage)
        if stem == "cifar":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
            )
        cls = BLOCKS[block]
        blocks: list[nn.Module] = []
        ch = width
        for s, n in enumerate(self.blocks_per_stage):
            out_ch = width * 2**s * cls.expansion
            for j in range(n):
                blocks.append(cls(in_ch=ch, out_ch=out_ch, stride=2 if (s > 0 and j == 0) else 1))
                ch = out_ch
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, num_classes))

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.in_channels, self.image_size, self.image_size)

    def torchvision_key_map(self) -> dict[str, str]:
        """torchvision ResNet state_dict key -> this model's key (same tensors, renamed)."""
        ours = list(self.state_dict())
        mapping: dict[str, str] = {}
        for key in ours:
            parts = key.split(".")
            if parts[0] == "stem":
                mapping[{"0": "conv1", "1": "bn1"}[parts[1]] + "." + ".".join(parts[2:])] = key
            elif parts[0] == "head":
                mapping["fc." + parts[-1]] = key
            else:
                idx, rest = int(parts[1]), parts[2:]
                stage = next(s for s in range(len(self.blocks_per_stage)) if idx < sum(self.blocks_per_stage[: s + 1]))
                j = idx - sum(self.blocks_per_stage[:stage])
                rest = ["downsample" if p == "shortcut" else p for p in rest]
                mapping[f"layer{stage + 1}.{j}." + ".".join(rest)] = key
        return mapping

    def load_torchvision_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a ``torchvision.models.resnet*`` checkpoint (e.g. pretrained weights) into this model."""
        mapping = self.torchvision_key_map()
        missing = sorted(set(mapping) - set(state))
        unexpected = sorted(set(state) - set(mapping))
        if missing or unexpected:
            raise KeyError(f"torchvision state_dict does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.load_state_dict({ours: state[tv] for tv, ours in mapping.items()})


class ResNetCIFAR(ResNet):
    """ResNet-18 layout for small images (3x3 stem, no max-pool); ``width`` scales every stage."""

    def __init__(
        self,
        *,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 32,
        width: int = 64,
        blocks_per_stage: tuple[int, ...] | list[int] = (2, 2, 2, 2),
        block: str = "basic",
    ) -> None:
        super().__init__(num_classes=num_classes, in_channels=in_channels, image_size=image_size, width=width,
                         blocks_per_stage=blocks_per_stage, block=block, stem="cifar")
