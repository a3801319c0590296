"""A residual MLP whose blocks declare no hidden dims: SDP units at block level only, so
``parallelism.level=neuron`` must be refused on it before any rank starts (validation catalogue)."""

from __future__ import annotations

from torch import nn

from sdp.models.base import HiddenDim
from sdp.models.mlp import MLP, MLPBlock


class OpaqueBlock(MLPBlock):
    """An MLP block that keeps its hidden width to itself (``ResidualBlock``'s default: none)."""

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        return ()


class OpaqueMLP(MLP):
    """:class:`~sdp.models.mlp.MLP` (same constructor) built from :class:`OpaqueBlock` s."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        dim, hidden = self.blocks[0].fc1.in_features, self.blocks[0].fc1.out_features
        self.blocks = nn.ModuleList(OpaqueBlock(dim=dim, hidden=hidden) for _ in self.blocks)
