"""PNG plots of a set of runs, one bar or curve per run: stacked memory by category, comm bytes per
step by kind, the step-time split, and loss against step and against wall-clock.

Shared by the measurement report (``benchmarks/report.py``) and the comparison that ``sdp-train``
runs by default (:mod:`sdp.report.compare`). Each figure is taken on the rank where it matters: memory
on the fullest rank, the step-time split on the slowest, comm on the busiest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdp.report.runs import load_run, run_figures
from sdp.results.contract import read_metrics

CATEGORIES = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes")
PHASES = ("data", "forward", "backward", "forward_backward", "comm", "optimizer", "resample")


def plot_row(label: str, run_dir: Path) -> dict[str, Any]:
    """One strategy's figures (largest rank), its memory by category on its fullest rank, the
    step-time split of its slowest rank, comm by kind of its busiest rank, and its loss curve."""
    s = load_run(run_dir).summary
    assert s is not None, f"{run_dir} has no summary.json"
    fig = run_figures(s)
    mem = s.memory_per_rank
    full = max(mem, key=lambda m: sum(m.get(c) or 0 for c in CATEGORIES))
    slow = max(s.time["per_rank"], key=lambda t: t["step_s_median"] or 0)
    busy = max(s.comm_per_rank, key=lambda c: c["bytes_per_step"])
    metrics = [r for r in read_metrics(run_dir) if "loss" in r]
    wall, curve = 0.0, []
    for r in metrics:
        wall += r.get("step_s", 0.0)
        curve.append((r["step"], wall, r["loss"]))
    return {"run": label, "strategy": s.strategy, "run_dir": str(run_dir), **fig,
            "memory_by_category": {c: full.get(c) or 0 for c in CATEGORIES}, "memory_rank": full["rank"],
            "phases_s": {p: v for p, v in slow.get("phases_s_median", {}).items()}, "phase_rank": slow["rank"],
            "comm_by_kind": {k: v["bytes"] for k, v in busy.get("by_kind", {}).items()}, "comm_rank": busy["rank"],
            "loss_curve": curve, "memory_per_rank": mem, "per_rank_step_s": [t["step_s_median"] for t in s.time["per_rank"]]}


def plots(rows: list[dict[str, Any]], *, out: Path, title: str) -> list[Path]:
    """Write memory.png, comm.png, step_time.png and loss.png for ``rows`` (:func:`plot_row`) into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["run"] for r in rows]
    files = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(out / name)

    def stacked(series: dict[str, list[float]], *, ylabel: str, what: str, name: str) -> None:
        """One bar per run, stacked by ``series`` (category, collective kind or phase)."""
        fig, ax = plt.subplots(figsize=(8, 4))
        bottom = [0.0] * len(rows)
        for key, vals in series.items():
            ax.bar(labels, vals, bottom=bottom, label=key)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel(ylabel)
        ax.set_title(f"{what} — {title}")
        ax.legend()
        ax.tick_params(axis="x", rotation=30)
        save(fig, name)

    stacked({c.replace("_bytes", ""): [r["memory_by_category"][c] / 2**20 for r in rows] for c in CATEGORIES},
            ylabel="MiB (fullest rank)", what="Memory by category", name="memory.png")
    kinds = sorted({k for r in rows for k in r["comm_by_kind"]})
    stacked({k: [r["comm_by_kind"].get(k, 0) / 2**20 for r in rows] for k in kinds},
            ylabel="MiB per step (busiest rank)", what="Communication per step", name="comm.png")
    phases = [p for p in PHASES if any(p in r["phases_s"] for r in rows)]
    split = {p: [r["phases_s"].get(p, 0.0) for r in rows] for p in phases}
    split["other"] = [max((r["step_s"] or 0) - sum(r["phases_s"].values()), 0.0) for r in rows]
    stacked(split, ylabel="seconds (slowest rank, median)", what="Step-time split", name="step_time.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        steps, wall, loss = zip(*r["loss_curve"]) if r["loss_curve"] else ((), (), ())
        a1.plot(steps, loss, label=r["run"], marker=".")
        a2.plot(wall, loss, label=r["run"], marker=".")
    a1.set_xlabel("step")
    a2.set_xlabel("wall-clock s (sum of step times)")
    a1.set_ylabel("train loss")
    a1.legend(fontsize=7)
    fig.suptitle(f"Loss — {title}")
    save(fig, "loss.png")
    return files
