"""The typed schema of the nodes a ``_target_`` builds: each model of ``conf/model/`` and each optimizer of
``conf/optim/`` (the datasets: :mod:`sdp.driver.schema_data`).

Why: these nodes are keyword arguments of a constructor (any model or optimizer may be named, a plugin's too),
so their YAMLs extend no schema and Hydra types none of their keys while composing. A value of the right type
that cannot work then failed inside the build, as a symptom that does not name the key (``model.n_layers=0``:
"declares no SDP units"; ``model.width=0``: an ``IndexError``) or was taken (``model.hidden=0``,
``optim.optimizer.momentum=1``). Each dataclass here lists the keys its target reads with their type and range;
:func:`sdp.driver.typed.check_built` holds a node to the schema of its ``_target_``
(:func:`sdp.core.fields.conform`: only the keys the schema declares, so every other argument still reaches the
target, whose own error an unknown one remains). A target with no entry here (a plugin's) is checked by its
build alone; an optimizer's ``lr`` is checked for every target (:class:`OptimizerArgs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from sdp.core.fields import Number, flag, key
from sdp.models import resnet, vit


@dataclass
class MLPArgs:
    """``sdp.models.mlp.MLP``: a residual MLP (``model=mlp``)."""

    num_classes: int = key(at_least=1)
    """Logits per sample (from the dataset)."""
    input_shape: List[int] = key(at_least=1)
    """Shape of one sample, flattened by the stem (from the dataset)."""
    dim: int = key(at_least=1)
    """Residual stream width."""
    hidden: int = key(at_least=1)
    """Hidden units per block (what neuron-level SDP splits)."""
    depth: int = key(at_least=1)
    """Residual blocks (SDP's block units)."""


@dataclass
class ResNetCIFARArgs:
    """``sdp.models.resnet.ResNetCIFAR`` (``model=resnet18_cifar``: the cifar stem, set by the class)."""

    num_classes: int = key(at_least=1)
    """Logits per sample (from the dataset)."""
    in_channels: int = key(at_least=1)
    """Image channels (from the dataset)."""
    image_size: int = key(at_least=1)
    """Image height = width (from the dataset)."""
    width: int = key(at_least=1)
    """Channels of the first stage; stage s has width x 2^s (x 4 for bottleneck blocks)."""
    blocks_per_stage: List[int] = key(at_least=1)
    """Blocks of each stage (a stage without blocks is no stage: give a shorter list)."""
    block: str = key(choices=tuple(resnet.BLOCKS))
    """basic (two 3x3 convs) | bottleneck (1x1-3x3-1x1, x4 expansion)."""


@dataclass
class ResNetArgs(ResNetCIFARArgs):
    """``sdp.models.resnet.ResNet`` (``model=resnet18``, ``resnet50``)."""

    stem: str = key(choices=resnet.STEMS)
    """imagenet (7x7/2 conv + max-pool) | cifar (3x3 conv, no pool)."""


@dataclass
class SwinArgs:
    """``sdp.models.swin.Swin`` (``model=swin_t``; torchvision's Swin Transformer)."""

    num_classes: int = key(at_least=1)
    """Logits per sample (from the dataset)."""
    in_channels: int = key(at_least=1)
    """Image channels (torchvision's patch embedding takes 3: the model refuses others, naming the key)."""
    image_size: int = key(at_least=1)
    """Image height = width (from the dataset)."""
    patch_size: int = key(at_least=1)
    """Patch embedding stride."""
    embed_dim: int = key(at_least=1)
    """Width of the first stage."""
    depths: List[int] = key(at_least=1)
    """Swin blocks of each stage."""
    num_heads: List[int] = key(at_least=1)
    """Attention heads of each stage."""
    window_size: int = key(at_least=1)
    """Attention window."""
    mlp_ratio: Number = key(above=0)
    """MLP hidden = mlp_ratio x width."""
    stochastic_depth_prob: Number = key(at_least=0, at_most=1)
    """torchvision's own block dropping probability."""


@dataclass
class ViTArgs:
    """``sdp.models.vit.ViT`` (``model=vit_tiny``, ``vit_small``)."""

    num_classes: int = key(at_least=1)
    """Logits per sample (from the dataset)."""
    in_channels: int = key(at_least=1)
    """Image channels (from the dataset)."""
    image_size: int = key(at_least=1)
    """Image height = width (a multiple of patch_size: the model refuses others, naming both)."""
    patch_size: int = key(at_least=1)
    """Patch side in pixels."""
    dim: int = key(at_least=1)
    """Residual stream width."""
    depth: int = key(at_least=1)
    """Transformer blocks (SDP's block units)."""
    n_heads: int = key(at_least=1)
    """Attention heads."""
    mlp_ratio: Number = key(above=0)
    """MLP hidden = mlp_ratio x dim."""
    pool: str = key(choices=vit.POOLS)
    """cls (class token) | mean (average over tokens)."""


@dataclass
class LLaMAArgs:
    """``sdp.models.llama.LLaMA`` (``model=llama_tiny``, ``llama_134m``, ``llama_500m``, ``llama_1b``)."""

    vocab_size: int = key(at_least=1)
    """Token id range (from the dataset)."""
    max_seq_len: int = key(at_least=1)
    """Context length (from the dataset's seq_len)."""
    dim: int = key(at_least=1)
    """Residual stream width."""
    n_layers: int = key(at_least=1)
    """Decoder layers (SDP's block units)."""
    n_heads: int = key(at_least=1)
    """Query heads (must divide dim: the model refuses others, naming both)."""
    n_kv_heads: Optional[int] = key(at_least=1)
    """null (= n_heads) or the key/value heads of grouped-query attention."""
    hidden: int = key(at_least=1)
    """SwiGLU hidden units per layer."""
    tie_embeddings: bool = flag()
    """Share the embedding matrix with the LM head."""
    rope_base: Number = key(above=0)
    """Rotary embedding base."""
    norm_eps: Number = key(above=0)
    """RMSNorm epsilon."""
    init_std: Number = key(above=0)
    """Standard deviation of the N(0, init_std) init."""


@dataclass
class OptimizerArgs:
    """``optim.optimizer`` of any optimizer: the learning rate every ``torch.optim`` optimizer takes."""

    lr: Number = key(above=0)
    """Peak learning rate (the schedule scales it)."""


@dataclass
class SGDArgs(OptimizerArgs):
    """``torch.optim.SGD`` (``optim=sgd``)."""

    momentum: Number = key(at_least=0, below=1)
    """Momentum factor (1 would never forget a gradient)."""
    dampening: Number = key(at_least=0, at_most=1)
    """Dampening of the momentum."""
    weight_decay: Number = key(at_least=0)
    """L2 penalty."""
    nesterov: bool = flag()
    """Nesterov momentum."""
    maximize: bool = flag()
    """Maximize the objective."""


@dataclass
class AdamWArgs(OptimizerArgs):
    """``torch.optim.AdamW`` and ``torch.optim.Adam`` (``optim=adamw``)."""

    betas: List[Number] = key(at_least=0, below=1)
    """Decay rates of the first and second moment estimates."""
    eps: Number = key(above=0)
    """Added to the denominator."""
    weight_decay: Number = key(at_least=0)
    """Decoupled weight decay (AdamW) | L2 penalty (Adam)."""
    amsgrad: bool = flag()
    """The AMSGrad variant."""
    maximize: bool = flag()
    """Maximize the objective."""


MODELS: dict[str, type] = {"sdp.models.mlp.MLP": MLPArgs, "sdp.models.resnet.ResNet": ResNetArgs,
                           "sdp.models.resnet.ResNetCIFAR": ResNetCIFARArgs, "sdp.models.swin.Swin": SwinArgs,
                           "sdp.models.vit.ViT": ViTArgs, "sdp.models.llama.LLaMA": LLaMAArgs}
OPTIMIZERS: dict[str, type] = {"torch.optim.SGD": SGDArgs, "torch.optim.AdamW": AdamWArgs, "torch.optim.Adam": AdamWArgs}
