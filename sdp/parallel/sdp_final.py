"""SDP's final weights (``train.save_final``, :mod:`sdp.rank.final_weights`): each tensor once, from its lowest holder.

Why from the lowest holder: every holder of a unit keeps bit-identical values (its gradient is averaged over the
holders, its optimizer state is the same), so one copy is the unit; the files then hold one model, not n x C copies,
and no rank ever holds more than its own subnetwork (the full model is never gathered). With the pieces come the facts
a reader needs to rebuild what the run evaluated: the plan (who held which unit), the factor evaluation puts on every
unit (:func:`eval_scale`) and each rank's own branch scales (``parallelism.rescale=train``: what its subnetwork ran).
"""

from __future__ import annotations

from typing import Any

from sdp.parallel.sdp_plan import plan_lists
from sdp.subnet.masking import Piece, locate, view
from sdp.subnet.plan import Plan


def eval_scale(*, plan: Plan, rescale: str) -> float:
    """The factor evaluation puts on every unit of the assembled model: k / n under ``parallelism.rescale=eval``
    (the stochastic-depth rule: each unit ran in a fraction k / n of the workers' forwards), else 1."""
    return plan.k / plan.world_size if rescale == "eval" else 1.0


def piece_key(p: Piece) -> str:
    """A piece's name in the files: the tensor's full-model name, with ``#dim:start:length`` for a slice of it."""
    return p.name if p.dim is None else f"{p.name}#{p.dim}:{p.start}:{p.length}"


def final_state(strategy: Any) -> dict[str, Any]:
    """:meth:`sdp.parallel.base.Strategy.final_state` of an SDP strategy (``strategy``: an ``SDPStrategy``): the pieces
    this rank is the lowest holder of (detached views; the writer copies them), the plan and scales (``facts``, the
    same on every rank) and this rank's held blocks with the branch scale each ran at (``own``)."""
    rank, module, plan = strategy.ctx.rank, strategy.module, strategy.plan
    tensors = {}
    for p in strategy.pieces:
        if min(p.holders) == rank:
            spec = locate(p, strategy.layout)
            assert spec is not None, f"rank {rank} is the lowest holder of {p.name} (holders {p.holders}) but lacks it"
            tensors[piece_key(p)] = view(*spec).detach()
    blocks = sorted({plan.units[u].block for u in plan.held_units(rank)})
    return {"tensors": tensors,
            "facts": {"plan": plan_lists(plan), "rescale": strategy.rescale, "masking": str(strategy.cfg.masking),
                      "eval_scale": eval_scale(plan=plan, rescale=strategy.rescale)},
            "own": {"blocks": blocks, "branch_scale": {str(b): float(module.blocks[b].branch_scale) for b in blocks}}}
