"""The comparison table: every method of one setting next to DDP, its costs as ratios to DDP.

What ``sdp-train`` prints at the end of its default job (``experiment=compare``; the multirun callback
with ``compare: true``) and what ``sdp-report SWEEP --compare`` rebuilds: one row per method with its
eval accuracy, then training peak memory, model state, comm bytes per step and step time, each a ratio
of means to the DDP row of the same table (the statistics of :mod:`sdp.report.tables`). Accuracy stays
in percent: a ratio of accuracies hides the gap that matters. Under the table come DDP's own figures,
so that a ratio reads as bytes and seconds, and what each column measures. The plots of
:mod:`sdp.report.plots` for the same runs are written next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sdp.report.render import Column, layout, markdown_grid
from sdp.report.runs import run_figures
from sdp.report.tables import Row, Table
from sdp.summary import Summary

REFERENCE = "DDP"
PEAK_KINDS = {  # run_figures' peak_kind -> (name, what it measures)
    "train_peak": ("train peak", "train peak = the largest memory in use during a training step on the fullest "
                   "rank (memory.per_rank[].train_peak_bytes)"),
    "cuda_max_allocated": ("CUDA peak", "peak = CUDA max allocated on the fullest rank over the whole run "
                           "(training peak not recorded by these runs)"),
    "peak_rss_delta": ("peak RSS delta", "peak = the fullest rank's peak resident memory minus its RSS before "
                       "training (training peak not recorded by these runs; on CPU this includes allocator and "
                       "library overheads, so it moves far less than model state)"),
}


@dataclass
class Comparison:
    """The printed text (one table per setting of the sweep) and every file written."""

    markdown: str
    files: list[Path]


def _first_summary(row: Row) -> Summary | None:
    return next((r.summary for r in row.runs if r.ok), None)


def peak_kind(table: Table) -> str:
    """``train_peak`` when every row with results recorded it, else the whole-run peak the runs have."""
    rows = [row for row in table.rows if row.n_ok]
    if rows and all(row.stats["train_peak_bytes"].mean is not None for row in rows):
        return "train_peak"
    first = next((s for s in map(_first_summary, rows) if s is not None), None)
    return str(run_figures(first)["peak_kind"]) if first is not None else "peak_rss_delta"


def holders(row: Row) -> str:
    """k, the workers holding each unit, from the run's plan (``summary.json`` strategy_info.plan)."""
    s = _first_summary(row)
    k = ((s.strategy_info or {}) if s is not None else {}).get("plan", {}).get("k")
    return "" if k is None else str(k)


def _mib(v: float | None, unit: str = "MiB") -> str:
    return "n/a" if v is None else f"{v / 2**20:.2f} {unit}"


def comparison_markdown(table: Table) -> str:
    """One table: method, C, k, n, eval accuracy and four ratios to DDP, then DDP's figures and a legend."""
    kind = peak_kind(table)
    labels = [(row.method, row.coverage) for row in table.rows]
    if len(set(labels)) == len(labels):  # method and C name every row: the preset knobs that differ add nothing
        table = replace(table, extra_keys=[])
    peak_name, peak_note = PEAK_KINDS[kind]
    peak_stat = "train_peak_bytes" if kind == "train_peak" else "peak_bytes"
    columns = (
        Column("eval_accuracy", "eval acc (%)", "stat", 2),
        Column("train_peak_mem_x_ddp" if kind == "train_peak" else "peak_mem_x_ddp", f"{peak_name} ×DDP", "ratio", 2),
        Column("state_mem_x_ddp", "model state ×DDP", "ratio", 2),
        Column("comm_x_ddp", "comm bytes/step ×DDP", "ratio", 2),
        Column("step_time_x_ddp", "step time ×DDP", "ratio", 2),
    )
    header, cells = layout(table, columns=columns, after_coverage=(("k", holders),))
    lines = [f"### {table.title}", "", *markdown_grid(header, cells), ""]
    ref = next((row for row in table.rows if row.method == REFERENCE and row.n_ok), None)
    if ref is not None:
        st = ref.stats
        step = st["step_s"].mean
        lines.append(f"{REFERENCE} itself (= 1.00x): {peak_name} {_mib(st[peak_stat].mean)}, "
                     f"model state {_mib(st['model_state_bytes'].mean)}, comm {_mib(st['comm_bytes_per_step'].mean, 'MiB/step')}, "
                     f"step {'n/a' if step is None else f'{step:.3f} s'}.")
    steps = {row.stats["steps"].mean for row in table.rows if row.n_ok}
    lines += [f"Every row: the same seed(s), data, initialisation and {'/'.join(f'{s:.0f}' for s in sorted(steps))} "
              "optimizer steps; n = seeds with results (mean ± sample std when n > 1). C = coverage, k = workers "
              "holding each unit (k = 1: no unit gradient is ever averaged). Ratios are ratios of means to the "
              f"{REFERENCE} row, each figure on the rank where it is largest: model state = params + grads + "
              "optimizer state; comm = bytes all-reduced per training step; step time = the slowest rank's median "
              f"step; {peak_note}."]
    lines += [f"- {n}" for n in table.notes]
    return "\n".join(lines)


def _plot_rows(tables: list[Table]) -> list[dict[str, Any]]:
    """One plot row per run with results, labelled by its method (and seed / setting when several)."""
    from sdp.report.plots import plot_row

    runs = [(row, run) for table in tables for row in table.rows for run in row.runs if run.ok]
    labels = [row.method + (f" C={row.coverage:g}" if row.coverage is not None else "") for row, _ in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{label} [{run.path.name}]" for label, (_, run) in zip(labels, runs)]
    return [plot_row(label, run.path) for label, (_, run) in zip(labels, runs)]


def plot_title(tables: list[Table], *, fallback: str) -> str:
    """``resnet18_cifar on digits, 4 workers`` when the runs share them, else ``fallback``."""
    runs = [r for t in tables for row in t.rows for r in row.runs]
    facts = {k: {r.flat.get(k) for r in runs} for k in ("model.name", "dataset.name", "cluster.world_size")}
    if not runs or any(len(v) != 1 for v in facts.values()):
        return fallback
    (model,), (data,), (world,) = facts.values()
    return f"{model} on {data}, {world} workers"


def write_comparison(*, tables: list[Table], out_dir: Path, title: str) -> Comparison:
    """Write ``comparison.md`` and the plots (titled ``title``) into ``out_dir``; return the text and the files."""
    from sdp.report.plots import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(comparison_markdown(t) for t in tables) + "\n"
    md = out_dir / "comparison.md"
    md.write_text(text)
    rows = _plot_rows(tables)
    return Comparison(markdown=text, files=[md, *(plots(rows, out=out_dir, title=title) if rows else [])])
