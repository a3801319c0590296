"""Stochastic depth and LayerDrop inside DDP: every rank drops each block independently per batch.

These are the regularisers SDP's block-level subnetworks resemble: at survival probability p each
rank computes about p of the blocks (SDP at coverage C = p without SDP's structure: here every rank
still holds, all-reduces and updates the whole model). A dropped block never runs its residual
branch (``ResidualBlock.active = False``: identity, or the shared projection shortcut of a
downsampling block), and a kept branch is scaled by 1/p (``branch_scale``) so its expected
contribution matches the full model used at evaluation.

Why not ``torchvision.ops.StochasticDepth``: its ``row`` mode drops per sample inside a batch and its
``batch`` mode multiplies the branch output by zero -- both still compute the branch, which is
exactly the saving being compared. The per-batch block drop is done with the blocks' own switch.

DDP must be told that parameters may go unused (``find_unused_parameters=True`` whenever p < 1):
a skipped block's parameters then get zero gradients that are still averaged over all ranks, the
usual semantics of stochastic depth under data parallelism. Draws come from a generator seeded by
(seed, rank), so runs are reproducible and ranks drop different blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from sdp.core.fields import Number, flag, key
from sdp.errors import require
from sdp.metrics.flops import BlockShare, forward_fraction
from sdp.metrics.timing import PhaseTimer
from sdp.models.base import ResidualBlock, SDPModel
from sdp.parallel.base import LossFn, OptimizerFactory, StepResult
from sdp.parallel.ddp import DDPReducerConfig, DDPSpec, DDPStrategy
from sdp.parallel.spec import Coverage, register
from sdp.parallel.job import JobFacts


def survival_probs(*, n: int, p: float, decay: str) -> list[float]:
    """Per-block survival: ``uniform`` p everywhere; ``linear`` 1 - (l+1)/n (1 - p), so the last
    block survives with p (Huang et al. 2016, with block l counted from 0)."""
    if decay == "uniform":
        return [p] * n
    return [1.0 - (i + 1) / n * (1.0 - p) for i in range(n)]


def draw_generator(*, seed: int, rank: int, stream: int) -> torch.Generator:
    """Each rank's own generator of block draws, seeded by (``seed``, ``rank``) and a ``stream`` per user (1: the drop
    baselines, 2: SDP's consolidation drops), so runs are reproducible and ranks draw differently."""
    return torch.Generator().manual_seed(seed * 1_000_003 + 17 * rank + stream)


def draw_active(blocks: Sequence[ResidualBlock], *, probs: Sequence[float], generator: torch.Generator,
                exact: int | None = None) -> list[bool]:
    """Switch each block on with its probability (the others skip their branch), touching nothing else; returns
    the draws. ``exact``: keep exactly that many blocks, a uniform draw without replacement (each block's survival
    is then exact / n, the depth never varies: an SDP worker's fixed depth without SDP's holder sets)."""
    if exact is None:
        u = torch.rand(len(blocks), generator=generator).tolist()
        kept = [ui < pi for ui, pi in zip(u, probs)]
    else:
        chosen = set(torch.randperm(len(blocks), generator=generator)[:exact].tolist())
        kept = [i in chosen for i in range(len(blocks))]
    for block, keep in zip(blocks, kept):
        block.active = keep
    return kept


def draw_blocks(blocks: Sequence[ResidualBlock], *, probs: Sequence[float], rescale: bool, generator: torch.Generator,
                exact: int | None = None) -> list[bool]:
    """:func:`draw_active`, then each kept branch scaled by 1 / its probability (``rescale``) or 1."""
    kept = draw_active(blocks, probs=probs, generator=generator, exact=exact)
    for block, keep, pi in zip(blocks, kept, probs):
        block.branch_scale = 1.0 / pi if (keep and rescale) else 1.0
    return kept


def exact_count(*, n: int, p: float, depth: str) -> int | None:
    """The blocks a rank keeps under ``depth=exact`` (``p`` x n, which must be whole, as an SDP worker's n x C is);
    None under ``depth=random`` (each block kept independently)."""
    if depth != "exact":
        return None
    k = round(p * n)
    require(abs(k - p * n) < 1e-9 and k >= 1, "parallelism.survival_prob", p,
            f"p x {n} blocks whole and >= 1 with parallelism.depth=exact (a rank keeps exactly p x n blocks)")
    return k


def reset_blocks(blocks: Sequence[ResidualBlock]) -> None:
    for block in blocks:
        block.active, block.branch_scale = True, 1.0


class _DropStrategy(DDPStrategy):
    """DDP plus a per-rank, per-batch block draw; the full model (all blocks, scale 1) at evaluation."""

    def setup(self, *, model: SDPModel, optimizer_factory: OptimizerFactory) -> None:
        units = model.sdp_units()
        require(len(units) > 0, "model", type(model).__name__, "declares no ResidualBlock to drop")
        self.blocks = [b for _, b in units]
        self.probs = survival_probs(n=len(self.blocks), p=float(self.cfg.survival_prob), decay=str(self.cfg.decay))
        self.rescale = bool(self.cfg.rescale)
        self.exact = exact_count(n=len(self.blocks), p=float(self.cfg.survival_prob), depth=str(self.cfg.depth))
        self.generator = draw_generator(seed=self.job.seed, rank=self.ctx.rank, stream=1)
        self.kept_counts = [0] * len(self.blocks)
        self.draws = 0
        self.cfg = OmegaConf.merge(self.cfg, {"find_unused_parameters": min(self.probs) < 1.0})
        super().setup(model=model, optimizer_factory=optimizer_factory)

    def train_step(
        self, *, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer, step: int
    ) -> StepResult:
        kept = draw_blocks(self.blocks, probs=self.probs, rescale=self.rescale, generator=self.generator, exact=self.exact)
        try:
            result = super().train_step(inputs=inputs, targets=targets, loss_fn=loss_fn, timer=timer, step=step)
        finally:
            reset_blocks(self.blocks)
        self.kept_counts = [c + int(k) for c, k in zip(self.kept_counts, kept)]
        self.draws += 1
        return result

    def checkpoint_state(self) -> dict[str, dict[str, Any]]:
        """DDP's state plus this rank's draw generator, so a resumed run drops the same blocks."""
        state = super().checkpoint_state()
        state["local"]["extra"] = {"generator": self.generator.get_state(), "kept_counts": list(self.kept_counts),
                                   "draws": self.draws}
        return state

    def load_checkpoint_state(self, state: dict[str, dict[str, Any]]) -> None:
        super().load_checkpoint_state(state)
        extra = state["local"]["extra"]
        self.generator.set_state(extra["generator"])
        self.kept_counts, self.draws = list(extra["kept_counts"]), int(extra["draws"])

    def summary_extra(self) -> dict[str, Any]:
        n = max(self.draws, 1)
        return {
            "survival_probs": self.probs,
            "rescale": self.rescale,
            "executed_fraction_per_block": [c / n for c in self.kept_counts],  # this rank (rank 0 in summary.json)
            "executed_fraction": sum(self.kept_counts) / (n * len(self.blocks)),
            "expected_fraction": sum(self.probs) / len(self.probs),
            "steps_drawn": self.draws,
        }


@dataclass
class DropConfig(DDPReducerConfig):
    """``parallelism=ddp_stochastic_depth`` (and :class:`LayerDropConfig`'s keys): DDP whose ranks skip residual branches
    (DDP's reducer keys, :class:`~sdp.parallel.ddp.DDPReducerConfig`; ``find_unused_parameters`` is not a key: set
    whenever p < 1)."""

    survival_prob: Number = key(above=0, at_most=1)
    """p in (0, 1]: a block's survival probability (the last block's under linear decay)."""
    decay: str = key(choices=("uniform", "linear"))
    """uniform: p for every block | linear: block l of n survives with 1 - (l+1)/n (1 - p) (stochastic depth only)."""
    rescale: bool = flag()
    """Scale a kept branch by 1 / its survival probability."""
    depth: str = key(choices=("random", "exact"))
    """random: each block kept independently (a rank's depth varies per batch) | exact: each rank keeps exactly
    p x n blocks, drawn uniformly per batch (uniform decay only; SDP's fixed worker depth without its holder sets)."""


@dataclass
class LayerDropConfig(DropConfig):
    """``parallelism=ddp_layerdrop``: DropConfig's keys, the same survival probability for every block."""

    decay: str = key(choices=("uniform",))
    """uniform only: every block survives with p (the linear decay is ddp_stochastic_depth's)."""




class _DropSpec(DDPSpec):
    """The drop baselines in the driver: DDP's prediction (every block kept), a coverage of the mean
    survival probability and FLOP matching like SDP's forward masking at that coverage."""

    runtime = _DropStrategy

    schema: type = DropConfig  # each key's own rule (p in (0, 1], the decays, booleans), and depth's below

    @classmethod
    def validate(cls, *, cfg: DictConfig, job: JobFacts) -> None:
        require(str(cfg.depth) == "random" or str(cfg.decay) == "uniform", "parallelism.depth", cfg.depth,
                f"random with parallelism.decay={cfg.decay} (exact keeps p x n blocks, every one equally likely)")

    @classmethod
    def prepare(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel) -> None:
        """Checks ``depth=exact``'s count against the model's blocks before any rank starts; nothing to hand over."""
        exact_count(n=len(model.sdp_units()), p=float(cfg.survival_prob), depth=str(cfg.depth))
    plan_note = "stochastic depth / LayerDrop predicted with every block kept"

    @classmethod
    def checkpoint_tensors(cls, *, cfg: DictConfig, job: JobFacts, model: SDPModel, step: int,
                           prepared: Any = None) -> list[dict[str, list[torch.Tensor]]] | None:
        """DDP's, plus each rank's draw generator state in its own file (:meth:`_DropStrategy.checkpoint_state`)."""
        parts = super().checkpoint_tensors(cfg=cfg, job=job, model=model, step=step, prepared=prepared)
        return [{**p, "local": [*p["local"], torch.Generator().get_state()]} for p in parts or []]

    @classmethod
    def coverage(cls, *, cfg: DictConfig, world_size: int, n_units: int | None, prepared: Any = None) -> Coverage | None:
        """The mean of :func:`survival_probs`: ``p`` under ``decay=uniform``; the linear decay's mean needs
        the block count ``n_units`` (fraction None without it)."""
        p = cfg.survival_prob  # in (0, 1]: its schema's range, checked before any budget or rank
        fraction: float | None = float(p)
        if str(cfg.decay) != "uniform":
            probs = survival_probs(n=int(n_units), p=float(p), decay=str(cfg.decay)) if n_units else None
            fraction = sum(probs) / len(probs) if probs else None
        return Coverage(key="parallelism.survival_prob", symbol="p", value=p, fraction=fraction)

    @classmethod
    def flops_fraction(cls, *, cfg: DictConfig, coverage: Coverage, shares: dict[str, dict[int, BlockShare]],
                       prepared: Any = None) -> float:
        """A dropped block skips its forward and backward, like SDP's forward masking: each block's branch
        weighed by its own survival probability (the linear decay's early blocks run more often), so a drop
        baseline at a uniform ``p`` is FLOP-matched exactly like SDP at C = p with every block a unit."""
        blocks = sorted(shares["block"])  # the model's sdp_units, in order, as setup draws them
        probs = survival_probs(n=len(blocks), p=float(cfg.survival_prob), decay=str(cfg.decay))
        return forward_fraction(shares=shares["block"], computed={b: (p, p) for b, p in zip(blocks, probs)})


@register("ddp_stochastic_depth")
class DDPStochasticDepthSpec(_DropSpec):
    """Stochastic depth (Huang et al. 2016): linear decay of survival with depth, or uniform."""

    label = "DDP+StochDepth"


@register("ddp_layerdrop")
class DDPLayerDropSpec(_DropSpec):
    """LayerDrop (Fan et al. 2019): the same drop rate for every block."""

    label = "DDP+LayerDrop"
    schema = LayerDropConfig  # decay: uniform only
