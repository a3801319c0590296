"""The typed schema of each ``parallelism`` preset family (conf/parallelism/*.yaml): what each key means.

One dataclass per shape, fields in the YAML's key order (see :mod:`sdp.driver.schema`). Every rule of one
key is here (type, choices, range); what depends on more than one key or on the world (``fsdp.replicate``
divides the world, pipeline degrees, SDP's k = round(C n) >= 1 and a plan that cannot hold every unit)
stays in each strategy's own ``validate``, which first holds its node to its dataclass
(:func:`sdp.driver.fields.conform`: a plugin's untyped YAML too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from sdp.driver.fields import flag, key
from sdp.driver.schema import Number


@dataclass
class DDP:
    """``parallelism=ddp``: DistributedDataParallel, every rank holds the whole model."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    bucket_cap_mb: Number = key(above=0)
    """Gradient bucket size in MiB."""
    broadcast_buffers: bool = flag()
    """Broadcast BatchNorm buffers from rank 0 every forward (false: ranks keep their own)."""
    find_unused_parameters: bool = flag()
    """Only for models with parameters unused in some steps."""


@dataclass
class DDPAC:
    """``parallelism=ddp_ac``: a preset, DDP with ``train.ac=full`` at its own ``ac_every`` (sdp.parallel.job.ac_every)."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    ac_every: int = key(at_least=1)
    """Checkpoint blocks 0, k, 2k, ... (1: every block); read as train.ac_every."""
    bucket_cap_mb: Number = key(above=0)
    """Gradient bucket size in MiB."""
    broadcast_buffers: bool = flag()
    """As in parallelism=ddp."""
    find_unused_parameters: bool = flag()
    """As in parallelism=ddp."""


@dataclass
class Drop:
    """``parallelism=ddp_stochastic_depth`` (and :class:`LayerDrop`'s keys): DDP whose ranks skip residual branches."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    survival_prob: Number = key(above=0, at_most=1)
    """p in (0, 1]: a block's survival probability (the last block's under linear decay)."""
    decay: str = key(choices=("uniform", "linear"))
    """uniform: p for every block | linear: block l of n survives with 1 - (l+1)/n (1 - p) (stochastic depth only)."""
    rescale: bool = flag()
    """Scale a kept branch by 1 / its survival probability."""
    bucket_cap_mb: Number = key(above=0)
    """Gradient bucket size in MiB."""
    broadcast_buffers: bool = flag()
    """As in parallelism=ddp."""


@dataclass
class LayerDrop(Drop):
    """``parallelism=ddp_layerdrop``: Drop's keys, the same survival probability for every block."""

    decay: str = key(choices=("uniform",))
    """uniform only: every block survives with p (the linear decay is ddp_stochastic_depth's)."""


@dataclass
class FSDP:
    """``parallelism=fsdp``: FSDP2, parameters, gradients and optimizer state sharded over ranks."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    reshard_after_forward: bool = flag()
    """Free each block's gathered parameters after its forward (ZeRO-3) | keep them until backward."""
    replicate: int = key(at_least=1)
    """> 1: HSDP, shard within groups of world_size / replicate ranks (must divide cluster.world_size)."""


@dataclass
class Pipeline:
    """``parallelism=pipeline``: the model cut into stages at block boundaries, microbatches streamed."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    schedule: str = key(choices=("gpipe", "1f1b", "interleaved_1f1b"))
    """gpipe | 1f1b | interleaved_1f1b (several stages per rank)."""
    microbatches: int = key(at_least=1)
    """Microbatches per step and pipeline replica."""
    stages_per_rank: int = key(at_least=1)
    """1 for gpipe / 1f1b; >= 2 for interleaved_1f1b."""
    dp: int = key(at_least=1)
    """Data-parallel pipeline replicas; the pipeline degree is cluster.world_size / dp."""
    split_points: Optional[List[int]] = key()
    """null (most even parameter counts) or the increasing block indices at which stages 1, 2, ... start."""


@dataclass
class Balance:
    """``parallelism.balance``: weights of each resource in the balanced assignment's minimax objective."""

    params: Number = key(at_least=0)
    """Weight of the per-worker parameter load."""
    flops: Number = key(at_least=0)
    """Weight of the per-worker FLOP load."""
    activations: Number = key(at_least=0)
    """Weight of the per-worker activation bytes."""


@dataclass
class SDP:
    """``parallelism=sdp`` and its variants: each worker trains a subnetwork; a unit's gradients are averaged
    over its holders only (conf/parallelism/sdp.yaml says what every value does)."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    level: str = key(choices=("block", "neuron"))
    """block: each residual block is a unit | neuron: (block, group) units."""
    masking: str = key(choices=("forward", "backward"))
    """forward: a worker runs only its subnetwork | backward: full forward, grads only for held parameters."""
    coverage: Number = key(above=0, at_most=1)
    """C in (0, 1]: each unit is held by round(C x world_size) workers."""
    assignment: str = key(choices=("cyclic", "random", "balanced"))
    """How units are placed on workers."""
    balance: Balance = field(default_factory=Balance)
    """assignment=balanced: resource weights."""
    groups: int = key(at_least=1)
    """Neuron level: every hidden width is split into this many groups."""
    resample_every: Optional[int] = key(at_least=1)
    """null: fixed plan | R: re-draw the plan every R steps."""
    redraw: str = key(choices=("relabel", "shuffle", "rolling"))
    """How a re-draw chooses the new plan."""
    refresh: str = key(choices=("holders", "global"))
    """Backward masking: broadcast from a holder | all-reduce over the world."""
    rescale: str = key(choices=("auto", "none", "eval", "train"))
    """How the branch magnitude of partly trained units is corrected (auto: resolved per model and protocol)."""
    drop_downsample: bool = flag()
    """A downsampling block is a unit (false: stays whole and shared)."""
    bucket_cap_mb: Number = key(above=0)
    """Gradient bucket size in MiB."""
    overlap: bool = flag()
    """All-reduce each holder-set bucket during backward (false: after backward)."""
    max_holder_sets: Optional[int] = key(at_least=1)
    """null: no cap | M: at most M process groups for holder sets (balanced assignment only)."""
    plan_seed: int = key(at_least=0)
    """Seed of random assignment and of plan re-draws."""


@dataclass
class LocalSGD:
    """``parallelism=local_sgd`` (and ``diloco``): every rank trains its own replica for ``inner_steps`` steps, then
    one outer step on the averaged parameter change (sdp/parallel/local_sgd.py)."""

    name: str = key()
    """The strategy, looked up in sdp.parallel.STRATEGIES."""
    inner_steps: int = key(at_least=1)
    """H >= 1: inner optimizer steps between two synchronisations (1: every step)."""
    outer_lr: Number = key(above=0)
    """Outer learning rate > 0 on the averaged parameter change (1 with outer_momentum 0: plain local SGD)."""
    outer_momentum: Number = key(at_least=0, below=1)
    """Outer SGD momentum in [0, 1) (0: none)."""
    nesterov: bool = flag()
    """Nesterov outer momentum (DiLoCo) | heavy-ball; no effect at outer_momentum 0."""


# ConfigStore names under schema/parallelism/ (conf/parallelism/*.yaml: `- /schema/parallelism/<family>@_here_`).
FAMILIES = {"ddp": DDP, "ddp_ac": DDPAC, "drop": Drop, "layerdrop": LayerDrop, "fsdp": FSDP, "pipeline": Pipeline, "sdp": SDP,
            "local_sgd": LocalSGD}
# parallelism.name -> schema, for a recorded config.yaml (written untyped).
PRESETS = {"ddp": DDP, "ddp_ac": DDPAC, "ddp_layerdrop": LayerDrop, "ddp_stochastic_depth": Drop, "fsdp": FSDP,
           "pipeline": Pipeline, "sdp": SDP, "local_sgd": LocalSGD}
