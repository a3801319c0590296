"""The depth gate's loss by difficulty group (:mod:`sdp.bench.gate`): where a task's runs record
``eval_loss_by_group`` (:class:`sdp.data.base.EvalGroups`: automaton's k, pointer's lookups), one small table per
task of the final eval loss of DDP-8 / DDP-4 / DDP-2 in each group.

Why: the gate's verdict says whether depth pays on a task at equal FLOPs, not why. A task whose items need
1, 2, .. sequential steps should show a deeper model gaining at the larger k (lookups) and tying at the small
ones; a deeper model that gains nowhere, or only at k = 1, points at the optimisation, not the task's depth need.
Read from summary.json only (``final.eval_loss_by_group`` of each run, collected with the gate's losses); a task
whose runs recorded no groups (the committed runs made before the field) adds nothing.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence


def group_lines(*, task: str, groups: Mapping[int, Mapping[int, Mapping[str, Any] | None]],
                depths: Sequence[int]) -> list[str]:
    """The table of ``task``'s loss by group: ``groups`` is blocks -> seed -> the run's ``eval_loss_by_group``
    (None where the run recorded none), rows by ``depths``, deepest first. Each cell is the mean over the seeds
    present at that depth (their number in the row's header cell); [] when no run of the task recorded groups."""
    found = {d: {s: g for s, g in per_seed.items() if g} for d, per_seed in groups.items()}
    records = [g for per_seed in found.values() for g in per_seed.values()]
    if not records:
        return []
    names = {g["name"] for g in records}
    assert len(names) == 1, f"task {task}: runs group by different names {sorted(names)}"
    labels = list(dict.fromkeys(k for g in records for k in g["loss"]))  # the groups in their recorded order
    name = names.pop()
    head = ["depth", *(f"{name} = {k}" for k in labels)]
    lines = [f"Eval loss by {name} (`{task}`; mean over the seeds present at each depth, n in brackets; "
             f"scored targets per group: {_counts(records, labels)}):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in sorted(depths, reverse=True):
        per_seed = found.get(d, {})
        if not per_seed:
            continue
        cells = [_mean([g["loss"].get(k) for g in per_seed.values()]) for k in labels]
        lines.append("| " + " | ".join([f"DDP-{d} (n = {len(per_seed)})", *cells]) + " |")
    return [*lines, ""]


def _mean(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{statistics.fmean(present):.3f}" if present else "–"


def _counts(records: list[Mapping[str, Any]], labels: list[str]) -> str:
    """The groups' scored counts (the validation set is the same for every run: one figure per group, or a range
    where runs differ)."""
    out = []
    for k in labels:
        seen = sorted({int(g["count"][k]) for g in records if k in g.get("count", {})})
        out.append(f"{k}: " + ("?" if not seen else f"{seen[0]:,}" if len(seen) == 1 else f"{seen[0]:,}–{seen[-1]:,}"))
    return ", ".join(out)
