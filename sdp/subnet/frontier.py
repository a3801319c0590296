"""Every assignment of a small SDP plan, scored: the memory floor and the Pareto frontier per worker.

Why: a target such as "activations <= 0.6x of DDP on the fullest worker" may be out of reach for a
model's shape, and two targets may pull apart (ResNet-18's parameters sit in its last stage, its
activations in its first). Counting every assignment of units to k-subsets of the n workers, which
is C(n, k) ** units (8 blocks on 4 workers at C = 0.5: 6 ** 8), shows what any planner could reach:

- the **floor**: the mean over workers, which no assignment that holds every unit k times can beat on
  its fullest worker (a sum over workers does not depend on who holds what);
- the **frontier**: the assignments no other one beats on both model state and activations, each
  figure on the fullest worker, as ratios to the full model (DDP);
- the **connected frontier**: the same among the assignments whose worker-overlap graph is connected
  (what the default ``balanced`` planner chooses from, see :mod:`sdp.subnet.assign`).

Per-worker figures are additive in the plan's unit costs: model state is the shared parameters plus
the held units' (exact, since gradients and optimizer state follow the parameters), activations are
the full model's bytes minus the dropped units' in-context bytes (see ``plan.measure_block_costs``; exact up
to how neighbouring dropped blocks interact, which the planner test bounds).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from sdp.subnet.plan import Plan, PlanError


@dataclass(frozen=True)
class Point:
    """One assignment's fullest-worker figures as ratios to the full model, its holder sets, and
    whether its worker-overlap graph is connected (None for the floor, which is no assignment)."""

    state: float
    activations: float
    holders: tuple[tuple[int, ...], ...]
    connected: bool | None = None


def worst_loads(*, costs: np.ndarray, n: int, k: int, limit: int = 2_000_000) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """For every assignment with unit 0 on workers 0..k-1 (workers are interchangeable), the largest
    per-worker load of each resource: an (assignments, resources) array whose row i is the
    assignment ``np.unravel_index(i, (len(combos),) * (units - 1))`` over units 1.. (unit 0 fixed)."""
    units, resources = costs.shape
    combos = list(itertools.combinations(range(n), k))
    count = len(combos) ** (units - 1)
    if count > limit:
        raise PlanError(f"{units} units on {n} workers with k={k} give {count:,} assignments to enumerate, "
                        f"over the limit of {limit:,}: use fewer units (block level) or a smaller world")
    member = np.zeros((len(combos), n))
    for i, h in enumerate(combos):
        member[i, list(h)] = 1.0
    loads = (member[0][:, None] * costs[0][None, :])[None]  # (1, n, resources)
    for u in range(1, units):
        step = member[:, :, None] * costs[u][None, None, :]  # (combos, n, resources)
        loads = (loads[:, None] + step[None]).reshape(-1, n, resources)
    return loads.max(axis=1), combos


def connected_assignments(*, combos: list[tuple[int, ...]], units: int, n: int) -> np.ndarray:
    """For every assignment in :func:`worst_loads`' order, whether its worker-overlap graph is connected:
    workers as bits, the set reached from unit 0's holders grown by every unit that touches it, n - 1
    times (each round reaches at least one more worker while any is still reachable)."""
    bits = np.array([sum(1 << r for r in h) for h in combos], dtype=np.min_scalar_type((1 << n) - 1))
    count = len(combos) ** (units - 1)
    index = np.arange(count, dtype=np.int64)
    masks = [bits[(index // len(combos) ** (units - 1 - u)) % len(combos)] for u in range(1, units)]
    reach = np.full(count, bits[0], dtype=bits.dtype)
    for _ in range(n - 1):
        for m in masks:
            reach = np.where(reach & m, reach | m, reach)
    return reach == (1 << n) - 1


def _pareto(*, state: np.ndarray, act: np.ndarray, keep: np.ndarray, connected: np.ndarray,
            combos: list[tuple[int, ...]], units: int) -> list[Point]:
    """The assignments among ``keep`` that no other one of them beats on both figures."""
    order = np.lexsort((act, state))
    points, best_act = [], np.inf
    for i in order[keep[order]]:
        if act[i] < best_act - 1e-12:
            best_act = act[i]
            digits = np.unravel_index(i, (len(combos),) * (units - 1)) if units > 1 else ()
            holders = (combos[0], *(combos[int(d)] for d in digits))
            points.append(Point(state=float(state[i]), activations=float(act[i]), holders=holders,
                                connected=bool(connected[i])))
    return points


def frontier(*, plan: Plan, full_activation_bytes: float, limit: int = 2_000_000) -> dict[str, object]:
    """The floor, the Pareto frontier (of every assignment, and of the connected ones) and the given
    plan's own point (ratios to the full model).

    ``full_activation_bytes``: the full model's saved bytes per sample, on the scale of the units'
    ``act_bytes`` (per sample)."""
    params = np.array([u.params for u in plan.units], dtype=np.float64)
    acts = np.array([u.act_bytes for u in plan.units], dtype=np.float64)
    total = plan.shared_params + params.sum()
    base_act = full_activation_bytes - acts.sum()  # what a worker holding no unit keeps
    assert base_act > -1e-6 * full_activation_bytes, (
        f"units' activation bytes {acts.sum()} exceed the full model's {full_activation_bytes}")
    worst, combos = worst_loads(costs=np.stack([params, acts], axis=1), n=plan.world_size, k=plan.k, limit=limit)
    state = (plan.shared_params + worst[:, 0]) / total
    act = (base_act + worst[:, 1]) / full_activation_bytes
    linked = connected_assignments(combos=combos, units=len(plan.units), n=plan.world_size)
    pareto = dict(state=state, act=act, connected=linked, combos=combos, units=len(plan.units))
    n, k = plan.world_size, plan.k
    own = plan.worker_costs()  # params include the shared ones
    return {
        "assignments": len(state),
        "floor": Point(state=(plan.shared_params + k * params.sum() / n) / total,
                       activations=(base_act + k * acts.sum() / n) / full_activation_bytes, holders=()),
        "frontier": _pareto(keep=np.ones_like(linked), **pareto),
        "connected_assignments": int(linked.sum()),
        "connected_frontier": _pareto(keep=linked, **pareto),
        "plan": Point(state=max(c["params"] for c in own) / total,
                      activations=(base_act + max(c["act_bytes"] for c in own)) / full_activation_bytes,
                      holders=plan.holders, connected=len(plan.components()) == 1),
    }


def format_frontier(result: dict[str, object], *, title: str) -> str:
    """Markdown: the floor, the plan's point and the frontier, as ratios to the full model."""
    pct = lambda p: f"{p.state:.3f}x | {p.activations:.3f}x"  # noqa: E731
    yes = lambda p: "yes" if p.connected else "no"  # noqa: E731
    lines = [f"SDP plan frontier: {title}; {result['assignments']:,} assignments (unit 0 fixed, workers are "
             f"interchangeable), {result['connected_assignments']:,} of them connected (every worker reaches every "
             "other through shared units); fullest worker's figures as ratios to the full model (DDP)", "",
             "| point | model state | activations | connected | holder sets (unit 0, 1, ...) |", "|---|---|---|---|---|",
             f"| floor (mean over workers: no assignment beats it) | {pct(result['floor'])} | | |",
             f"| this config's plan | {pct(result['plan'])} | {yes(result['plan'])} | {_holders(result['plan'])} |"]
    lines += [f"| frontier {i} | {pct(p)} | {yes(p)} | {_holders(p)} |" for i, p in enumerate(result["frontier"])]
    lines += [f"| connected frontier {i} | {pct(p)} | yes | {_holders(p)} |"
              for i, p in enumerate(result["connected_frontier"])]
    return "\n".join(lines)


def _holders(p: Point) -> str:
    return " ".join("{" + ",".join(map(str, h)) + "}" for h in p.holders)
