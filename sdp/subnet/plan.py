"""The SDP coverage planner: which worker holds which unit (pure functions, no process group).

Why a separate, pure planner: an impossible plan (coverage that rounds to zero holders, a width that
does not split into the asked groups) must fail in the driver before any rank starts, and the tests
must be able to check the maths over hundreds of (n, C, units) cases in milliseconds. The strategy
builds the very same plan on every rank from the same model declarations, so no plan is exchanged.

- Units come from the model's declarations: each :class:`ResidualBlock` is a unit at block level;
  at neuron level each (block, group) is one, a group being ``groups`` equal parts of every
  :class:`HiddenDim` of the block (a block with a tensor sliced by two hidden dims, a Bottleneck, is
  refused there: :func:`cross_sliced`). A downsampling block (one with shared sub-modules) is a unit
  unless ``drop_downsample`` is false, then it is shared whole (ResIST style).
- k = round(C * n) holders per unit ("uniform representation of each parameter", paper 1.2).
- Assignment (:mod:`sdp.subnet.assign`): ``cyclic`` (unit u -> u..u+k-1 mod n), ``random``
  (seeded k-subsets) or ``balanced``
  (LPT greedy, biggest unit first onto the k least-loaded workers, then a local search over moves
  and swaps, then an exact branch and bound seeded with it, within a node budget). A unit's cost is
  the vector (params, FLOPs, bytes saved for backward), each normalised by its total so none
  dominates by its unit of measure, then weighted by ``balance`` (default 1, 1, 1); the objective is
  minimax: the worst worker's worst resource first, so that neither memory nor time has a straggler.
  ``balanced`` keeps the worker-overlap graph connected (workers linked when they share a unit)
  wherever that is possible, so that no group of workers trains a part of the network alone.
- A re-draw (``resample_every``) follows ``redraw`` (:mod:`sdp.subnet.rolling`): ``relabel`` (default)
  permutes the workers, seeded (cyclic, balanced: balance and connectivity kept) or draws fresh subsets
  (random); ``shuffle`` also permutes interchangeable units; ``rolling`` rolls windows (FedRolex).
- :meth:`Plan.degenerate` names the settings in which SDP is not the paper's regime: k = 1 (no
  unit's gradient is ever averaged) and a disconnected overlap graph; :func:`warn_degenerate` warns
  with them once, in the process that checks the config before any rank starts.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sdp.models.base import SDPModel
from sdp.subnet.assign import PlanError, assign, components, connectable, relabel
from sdp.subnet.capped import cap_holder_sets
from sdp.subnet.rolling import check_redraw, rolling, shuffle
from sdp.subnet.units import declare_units, measure_block_costs, sliced_names

__all__ = ["Plan", "PlanError", "PlanWarning", "Unit", "assign", "build_plan", "check", "num_holders", "warn_degenerate"]


class PlanWarning(UserWarning):
    """A plan that runs but is not the regime SDP is about (k = 1, workers in disconnected groups)."""


@dataclass(frozen=True)
class Unit:
    """One SDP unit: a block (``group`` None) or one hidden group of a block, and its costs."""

    block: int
    group: int | None
    params: int
    flops: float
    act_bytes: float

    @property
    def name(self) -> str:
        return f"blocks.{self.block}" + ("" if self.group is None else f"/g{self.group}")


@dataclass
class Plan:
    """Unit -> holders for one draw; ``remainder`` = per-block branch params not in any group
    (held by every worker that holds at least one group of that block)."""

    world_size: int
    coverage: float
    k: int
    level: str
    assignment: str
    groups: int
    units: tuple[Unit, ...]
    holders: tuple[tuple[int, ...], ...]
    shared_params: int
    remainder: dict[int, int] = field(default_factory=dict)
    draw: int = 0
    redraw: str = "relabel"  # how draws after the first are made (sdp.subnet.rolling)
    redraw_info: dict[str, Any] = field(default_factory=dict)  # what that rule achieves (rolling: pair coverage)

    def held_units(self, rank: int) -> list[int]:
        return [u for u, h in enumerate(self.holders) if rank in h]

    def block_holders(self, block: int) -> tuple[int, ...]:
        """Union of the holders of every unit of ``block`` (who runs any of it)."""
        return tuple(sorted({r for u, h in zip(self.units, self.holders) if u.block == block for r in h}))

    def holder_sets(self) -> list[tuple[int, ...]]:
        """Distinct holder sets (units and block remainders) in one global order, same on all ranks."""
        sets = set(self.holders) | {self.block_holders(b) for b in self.remainder if self.remainder[b]}
        return sorted(sets, key=lambda h: (len(h), h))

    def params_of(self, rank: int) -> int:
        held = sum(self.units[u].params for u in self.held_units(rank))
        rem = sum(n for b, n in self.remainder.items() if rank in self.block_holders(b))
        return self.shared_params + held + rem

    def block_coverage(self) -> dict[int, tuple[float, float]]:
        """Per block with units: (share of the workers that run any of it, mean share of its units' workers),
        equal at block level; what :func:`sdp.metrics.flops.forward_fraction` weighs the block's FLOPs by."""
        out = {}
        for b in sorted({u.block for u in self.units}):
            sizes = [len(h) for u, h in zip(self.units, self.holders) if u.block == b]
            out[b] = (len(self.block_holders(b)) / self.world_size, sum(sizes) / (len(sizes) * self.world_size))
        return out

    def worker_costs(self) -> list[dict[str, float]]:
        tot = [max(sum(getattr(u, a) for u in self.units), 1e-30) for a in ("params", "flops", "act_bytes")]
        out = []
        for r in range(self.world_size):
            us = [self.units[u] for u in self.held_units(r)]
            p, f, a = (sum(getattr(u, x) for u in us) for x in ("params", "flops", "act_bytes"))
            out.append({"params": self.params_of(r), "flops": f, "act_bytes": a,
                        "cost": p / tot[0] + f / tot[1] + a / tot[2], "units": len(us)})
        return out

    def components(self) -> list[tuple[int, ...]]:
        """Groups of workers linked through shared units (one group: the overlap graph is connected)."""
        return components(holders=self.holders, n=self.world_size)

    def pair_coverage(self) -> float:
        """Fraction of the unordered pairs of units that some worker holds both of (trains together);
        1.0 with fewer than two units."""
        pairs = list(itertools.combinations(self.holders, 2))
        return sum(1 for a, b in pairs if set(a) & set(b)) / len(pairs) if pairs else 1.0

    def degenerate(self) -> list[str]:
        """Why this plan is not the regime SDP is about, one sentence each (empty: it is)."""
        n, k, out = self.world_size, self.k, []
        if k == 1 and n > 1:
            out.append(f"parallelism.coverage={self.coverage} on world_size={n} gives k=round({self.coverage * n:g})=1 "
                       f"holder per unit: no unit's gradient is ever averaged (only the shared parameters are); "
                       f"use coverage >= {1.5 / n:.3g} for k >= 2")
        comps = self.components()
        if len(comps) > 1:
            why = ("it cannot be connected: needs units x (k - 1) >= world_size - 1, here "
                   f"{len(self.units)} x {k - 1} < {n - 1}" if not connectable(n=n, k=k, units=len(self.units))
                   else "parallelism.redraw='rolling': its windows do not connect it" if self.redraw == "rolling"
                   else f"parallelism.assignment={self.assignment!r} does not keep it connected; balanced does")
            out.append(f"the worker-overlap graph is disconnected: worker groups "
                       f"{' '.join('{' + ','.join(map(str, c)) + '}' for c in comps)} share no unit, so each trains "
                       f"its part of the network alone ({why})")
        return out

    def summary(self) -> dict[str, Any]:
        costs = self.worker_costs()
        cs = [c["cost"] for c in costs]
        ps = [c["params"] for c in costs]
        comps = self.components()
        return {
            "level": self.level, "assignment": self.assignment, "coverage": self.coverage, "k": self.k,
            "world_size": self.world_size, "units": len(self.units), "groups": self.groups, "draw": self.draw,
            "redraw": self.redraw, "redraw_info": self.redraw_info,
            "holder_sets": len(self.holder_sets()),
            "connected": len(comps) == 1, "components": [list(c) for c in comps],
            "unit_pairs_trained_together": self.pair_coverage(),
            "plan": {u.name: list(h) for u, h in zip(self.units, self.holders)},
            "warnings": self.degenerate(), "shared_params": self.shared_params,
            "total_params": self.shared_params + sum(u.params for u in self.units) + sum(self.remainder.values()),
            "params_per_worker": ps, "cost_per_worker": cs,
            "cost_spread": max(cs) / min(cs) if min(cs) > 0 else float("inf"),
            "cost_stdev": statistics.pstdev(cs),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "units": [{**asdict(u), "name": u.name, "holders": list(h)} for u, h in zip(self.units, self.holders)],
            "workers": {str(r): [self.units[u].name for u in self.held_units(r)] for r in range(self.world_size)},
            "worker_costs": self.worker_costs(),
        }

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2))


def warn_degenerate(plan: Plan) -> list[str]:
    """Warn (:class:`PlanWarning`) with each of :meth:`Plan.degenerate`'s sentences, once per job: in the
    process that checks the config (the driver, sdp-plan), and under an external launcher (torchrun,
    Slurm), where every rank checks it, on rank 0 only. Returns the sentences."""
    found = plan.degenerate()
    if os.environ.get("RANK", "0") == "0":
        for text in found:
            warnings.warn(f"SDP plan: {text}", PlanWarning, stacklevel=2)
    return found


def num_holders(*, coverage: float, world_size: int) -> int:
    """k = round(C * n), checked to lie in [1, n]."""
    if not (0 < coverage <= 1):
        raise PlanError(f"parallelism.coverage={coverage!r} is invalid: must lie in (0, 1]")
    k = int(round(coverage * world_size))
    if k < 1:
        raise PlanError(
            f"parallelism.coverage={coverage} with world_size={world_size} gives k=round({coverage * world_size:g})=0 "
            f"holders per unit; need coverage >= {0.5 / world_size:g}"
        )
    return min(k, world_size)


def check(plan: Plan) -> None:
    """Every unit has exactly k distinct holders among ranks 0..n-1; raises PlanError naming them."""
    n, k = plan.world_size, plan.k
    if len(plan.holders) != len(plan.units):
        raise PlanError(f"plan has {len(plan.holders)} holder sets for {len(plan.units)} units")
    for unit, h in zip(plan.units, plan.holders):
        if len(set(h)) != k or len(h) != k or not all(0 <= r < n for r in h):
            raise PlanError(f"unit {unit.name} has holders {h}; need exactly k={k} distinct ranks in 0..{n - 1}")


def build_plan(*, model: SDPModel, world_size: int, coverage: float, level: str = "block", assignment: str = "balanced",
               groups: int = 1, drop_downsample: bool = True, seed: int = 0, draw: int = 0,
               balance: tuple[float, float, float] = (1.0, 1.0, 1.0),
               block_costs: dict[int, tuple[float, float]] | None = None, max_holder_sets: int | None = None,
               redraw: str = "relabel", base_holders: tuple[tuple[int, ...], ...] | None = None) -> Plan:
    """Declarations -> units with costs -> holders -> checked :class:`Plan` (same on every rank).

    ``balance`` weighs the normalised (params, FLOPs, activation bytes) in the balanced objective: 0
    ignores a resource, e.g. (0, 0, 1) gives the plan whose fullest worker keeps the fewest
    activations whatever its parameters (``sdp-plan plan.frontier=true`` shows the trade-off).
    ``block_costs``: :func:`measure_block_costs` of this model, when already measured (it runs one meta-device
    forward per block, seconds for LLaMA-1B, and depends on the model alone, not on n, C or the draw).
    ``max_holder_sets``: at most this many process groups for holder sets, every worker still holding a
    unit and all connected where any plan can (:mod:`sdp.subnet.capped`; PlanError naming the smallest
    cap that works otherwise). ``redraw``: how draw ``draw`` is made from draw 0 (:mod:`sdp.subnet.rolling`).
    ``base_holders``: draw 0's holders of these arguments, when already built: a later draw of the rules that
    start from draw 0's assignment (shuffle, capped) takes them instead of assigning again (every such rule
    relabels, which sorts each set, so the order within a set does not matter)."""
    check_redraw(redraw)
    if len(balance) != 3 or any(w < 0 for w in balance) or not any(balance):
        raise PlanError(f"balance={tuple(balance)} is invalid: three weights >= 0 (params, FLOPs, activations), not all 0")
    k = num_holders(coverage=coverage, world_size=world_size)
    decl = declare_units(model, level=level, groups=groups, drop_downsample=drop_downsample)
    costs = measure_block_costs(model) if block_costs is None else block_costs
    units, remainder, in_units = [], {}, set()
    for b, g in decl:
        block = model.blocks[b]
        branch = dict(block.branch_parameters())
        sliced = sliced_names(block) if g is not None else {}
        G = groups if g is not None else 1
        if g is None:
            p = sum(t.numel() for t in branch.values())
        else:
            p = sum(t.numel() for n, t in branch.items() if n in sliced) // G
        if g == 0:
            remainder[b] = sum(t.numel() for n, t in branch.items() if n not in sliced)
        f, a = costs[b]
        units.append(Unit(block=b, group=g, params=p, flops=f / G, act_bytes=a / G))
        in_units.add(b)
    branch_total = sum(t.numel() for b in in_units for _, t in model.blocks[b].branch_parameters())
    shared = sum(t.numel() for t in model.parameters()) - branch_total
    tot = [max(sum(getattr(u, a) for u in units), 1e-30) for a in ("params", "flops", "act_bytes")]
    unit_costs = [tuple(w * getattr(u, a) / t for w, a, t in zip(balance, ("params", "flops", "act_bytes"), tot))
                  for u in units]
    capped = max_holder_sets is not None  # capped on draw 0, relabelled for the draw (sdp.subnet.capped)
    blocks, info = [u.block for u in units], {}
    if redraw == "rolling":  # rolled windows replace the assignment, from draw 0 on
        if capped:
            raise PlanError(f"parallelism.max_holder_sets={max_holder_sets} is invalid with parallelism.redraw='rolling' "
                            f"(its windows fix the holder sets): allowed: null, or redraw=relabel or shuffle")
        holders, info = rolling(blocks=blocks, groups=[u.group for u in units], n=world_size, k=k, draw=draw)
    else:  # relabel: as before this key existed; shuffle: from draw 0's plan
        base = draw if redraw == "relabel" and not capped else 0
        if base == 0 and draw > 0 and base_holders is not None:
            holders = [tuple(h) for h in base_holders]
        else:
            holders = assign(costs=unit_costs, world_size=world_size, k=k, method=assignment, seed=seed, draw=base)
            if capped:
                unions = [[i for i, u in enumerate(units) if u.block == b] for b in remainder if remainder[b]]
                holders = cap_holder_sets(costs=unit_costs, holders=holders, n=world_size, k=k, cap=int(max_holder_sets),
                                          unions=unions)
        if redraw == "shuffle":
            holders, info = shuffle(holders=holders, blocks=blocks, costs=[(u.params, u.flops, u.act_bytes) for u in units],
                                    remainder=remainder, n=world_size, seed=seed, draw=draw)
        elif capped:
            holders = relabel(holders=holders, n=world_size, seed=seed, draw=draw)
    plan = Plan(world_size=world_size, coverage=coverage, k=k, level=level, assignment=assignment,
                groups=groups if level == "neuron" else 1, units=tuple(units), holders=holders,
                shared_params=shared, remainder=remainder, draw=draw, redraw=redraw, redraw_info=info)
    check(plan)
    return plan
