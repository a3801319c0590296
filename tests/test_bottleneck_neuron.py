"""Neuron-level SDP refuses a block with a tensor sliced by two hidden dims (a Bottleneck's 3x3 conv:
inputs one hidden width, outputs the other), before any rank starts: the check reads the declarations
(:func:`sdp.subnet.plan.cross_sliced`), so it holds for any model, not a name list. Block level still
plans such models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sdp.models.base import HiddenDim, HiddenSlice, ResidualBlock, SDPModel
from sdp.models.resnet import ResNet
from sdp.subnet.plan import PlanError, build_plan
from sdp.subnet.units import cross_sliced


class ChainBlock(ResidualBlock):
    """x + fc3(relu(fc2(relu(fc1(x))))): widths a (fc1 out, fc2 in) and b (fc2 out, fc3 in), so fc2's
    weight is sliced by both, as a Bottleneck's conv2."""

    def __init__(self, *, dim: int, a: int, b: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(dim, a), nn.Linear(a, b), nn.Linear(b, dim)

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch_scale * self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        return (
            HiddenDim(name="a", size=self.fc1.out_features, branch="",
                      slices=(HiddenSlice("fc1.weight", 0), HiddenSlice("fc1.bias", 0), HiddenSlice("fc2.weight", 1))),
            HiddenDim(name="b", size=self.fc2.out_features, branch="",
                      slices=(HiddenSlice("fc2.weight", 0), HiddenSlice("fc2.bias", 0), HiddenSlice("fc3.weight", 1))),
        )


class ChainNet(SDPModel):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Flatten(), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([ChainBlock(dim=8, a=4, b=6) for _ in range(3)])

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 2, 4)


def test_a_block_with_a_tensor_sliced_by_two_hidden_dims_is_refused_at_neuron_level() -> None:
    model = ChainNet()
    assert cross_sliced(model.blocks[0]) == {"fc2.weight": ["a (dim 1)", "b (dim 0)"]}
    with pytest.raises(PlanError, match=r"parallelism.level='neuron' is not supported for model ChainNet: blocks.0 "
                                        r"\(ChainBlock\) has fc2.weight sliced by two hidden dims, a \(dim 1\) and "
                                        r"b \(dim 0\).*allowed: parallelism.level=block"):
        build_plan(model=model, world_size=2, coverage=0.5, level="neuron", groups=2)
    plan = build_plan(model=model, world_size=2, coverage=0.5, level="block")  # block level: whole blocks
    assert len(plan.units) == 3 and plan.k == 1


def test_bottleneck_resnet_plans_at_block_level_and_is_refused_at_neuron_level() -> None:
    with torch.device("meta"):
        model = ResNet(num_classes=5, image_size=32, width=4, block="bottleneck", blocks_per_stage=[2, 1, 1, 1])
    assert cross_sliced(model.blocks[0]) == {"conv2.weight": ["mid1 (dim 1)", "mid2 (dim 0)"]}
    assert len(build_plan(model=model, world_size=2, coverage=1.0, level="block").units) == 5
    for drop_downsample in (True, False):  # False: blocks.1 is the one unit (no projection)
        with pytest.raises(PlanError, match=r"level='neuron' is not supported for model ResNet: blocks.\d \(Bottleneck\) "
                                            r"has conv2.weight sliced by two hidden dims"):
            build_plan(model=model, world_size=2, coverage=1.0, level="neuron", drop_downsample=drop_downsample)


def test_validation_refuses_resnet50_at_neuron_level_naming_model_and_level() -> None:
    """What sdp-train and sdp-plan run before any rank starts (the rank died on an AssertionError)."""
    from sdp.driver.config import validate
    from sdp.errors import ConfigError
    from tests.helpers import compose

    with pytest.raises(ConfigError, match=r"parallelism.level='neuron' is not supported for model ResNet: .*"
                                          r"Bottleneck.*conv2.weight.*allowed: parallelism.level=block \(model=resnet50\)"):
        validate(compose(["model=resnet50", "dataset=synthetic_image", "parallelism=sdp_neuron_fwd"]))
    validate(compose(["model=resnet50", "dataset=synthetic_image", "parallelism=sdp"]))  # block level runs
