"""Planning a pipeline: where to cut the model, which rank owns which stage, and every check that
can fail before a rank starts.

Kept apart from the strategy so the driver can validate a config (it builds the model on the meta
device only) and tests can check cuts without a process group. Cuts are at the block boundaries the
model declares (``SDPModel.pipeline_split_points()``); the stem belongs to the first stage and the
head to the last, so their parameters count there when balancing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from sdp.core.fields import key
from sdp.errors import ConfigError, fail, require
from sdp.models.base import SDPModel, count_params

SINGLE_STAGE = ("gpipe", "1f1b")  # the schedules of PipelineConfig.schedule that run one stage per rank


@dataclass
class PipelineConfig:
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


@dataclass(frozen=True)
class PipelinePlan:
    """``bounds[s]:bounds[s+1]`` are the blocks of stage ``s``; stage ``s`` runs on pipeline rank ``s % pp``
    (looped placement, which interleaved 1F1B expects)."""

    pp: int
    dp: int
    stages_per_rank: int
    bounds: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stages_of(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.num_stages, self.pp))

    def owner(self, stage: int) -> int:
        return stage % self.pp


def stage_weights(model: SDPModel) -> list[int]:
    """Parameter count per block, with the stem added to the first block and the head to the last."""
    w = [count_params(b) for b in model.blocks]
    w[0] += count_params(model.stem)
    w[-1] += count_params(model.head)
    return w


def balanced_bounds(*, weights: Sequence[int], allowed: Sequence[int], stages: int) -> tuple[int, ...]:
    """Contiguous cut of ``weights`` into ``stages`` non-empty parts, cutting only at ``allowed``
    indices, minimising the heaviest part (exact dynamic programme: block counts are small)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    starts = [0] + sorted(i for i in set(allowed) if 0 < i < n)
    ends = starts[1:] + [n]
    best: dict[tuple[int, int], tuple[int, int]] = {(0, 0): (0, -1)}  # (stages, end) -> (max part, prev end)
    for s in range(1, stages + 1):
        for j in ends:
            options = [(max(best[(s - 1, i)][0], prefix[j] - prefix[i]), i)
                       for i in starts if i < j and (s - 1, i) in best]
            if options:
                best[(s, j)] = min(options)
    if (stages, n) not in best:
        raise ConfigError(f"cannot cut {n} blocks into {stages} stages at the allowed split points {list(allowed)}")
    bounds, j = [n], n
    for s in range(stages, 0, -1):
        j = best[(s, j)][1]
        bounds.append(j)
    return tuple(reversed(bounds))


def check_layout(*, cfg: Any, world_size: int) -> tuple[int, int, int, int]:
    """The body of :meth:`PipelineSpec.validate <sdp.parallel.pipeline.PipelineSpec.validate>`: the layout's rules
    of several keys and ``world_size`` (each key's own rule, the schedule's choices and each degree >= 1, is
    :class:`PipelineConfig`'s, checked before); returns (pp, dp, stages_per_rank, microbatches)."""
    dp, spr, mb = cfg.dp, cfg.stages_per_rank, cfg.microbatches
    require(world_size % dp == 0, "parallelism.dp", dp, f"must divide cluster.world_size={world_size} (pp x dp = world)")
    pp = world_size // dp
    require(pp >= 2, "parallelism.dp", dp,
            f"leaves a pipeline of {pp} rank(s) (world {world_size} / dp {dp}); a pipeline needs >= 2 ranks")
    if cfg.schedule in SINGLE_STAGE:
        require(spr == 1, "parallelism.stages_per_rank", spr, f"schedule {cfg.schedule} runs one stage per rank: use 1")
    else:
        require(spr >= 2, "parallelism.stages_per_rank", spr, "interleaved_1f1b needs >= 2 stages per rank")
        require(mb % pp == 0, "parallelism.microbatches", mb,
                f"interleaved_1f1b needs a multiple of the pipeline degree {pp}")
    stages = pp * spr
    require(mb >= stages, "parallelism.microbatches", mb,
            f"must be >= the number of stages {stages} (pp {pp} x stages_per_rank {spr}); fewer leaves stages idle or hangs")
    return pp, dp, spr, mb


def make_plan(*, cfg: Any, world_size: int, model: SDPModel, batch_size: int) -> PipelinePlan:
    """Every check (layout, batch split, model cut points) and the stage boundaries."""
    pp, dp, spr, mb = check_layout(cfg=cfg, world_size=world_size)
    per_replica = batch_size * pp  # global batch (batch_size x world) split over dp replicas
    require(per_replica % mb == 0, "parallelism.microbatches", mb,
            f"must divide the per-replica batch {per_replica} (train.batch_size {batch_size} x pp {pp})")
    stages, n = pp * spr, len(model.blocks)
    require(stages <= n, "parallelism.stages_per_rank" if spr > 1 else "parallelism.dp", spr if spr > 1 else dp,
            f"gives {stages} stages but the model has only {n} blocks to cut between")
    allowed = model.pipeline_split_points()
    points = cfg.split_points
    if points is None:
        return PipelinePlan(pp=pp, dp=dp, stages_per_rank=spr,
                            bounds=balanced_bounds(weights=stage_weights(model), allowed=allowed, stages=stages))
    points = list(points)
    if len(points) != stages - 1 or points != sorted(set(points)) or any(p not in allowed for p in points):
        fail("parallelism.split_points", points,
             f"need {stages - 1} strictly increasing block indices (where stages 1..{stages - 1} start) from {allowed}")
    return PipelinePlan(pp=pp, dp=dp, stages_per_rank=spr, bounds=(0, *points, n))
