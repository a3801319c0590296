"""Every ratio-to-DDP table: the comparison of a sweep and the tables of the benchmark suites.

- :func:`comparison_markdown`: what ``sdp-train experiment=compare`` prints at its end
  (``experiment=compare``; the multirun callback with ``compare: true``) and what ``sdp-report SWEEP
  --compare`` rebuilds: one row per method with its eval accuracy, then training peak memory, model state,
  comm bytes per step and step time, each a ratio of means to the DDP row of the same table (the
  statistics of :mod:`sdp.report.tables`). Accuracy stays in percent: a ratio of accuracies hides the gap
  that matters. Under the table come DDP's own figures, so that a ratio reads as bytes and seconds, and
  what each column measures. The plots of :mod:`sdp.report.plots` for the same runs are written next to it.
- :func:`report_markdown`, :func:`compare_markdown`, :func:`memory_markdown`, :func:`capacity_markdown`:
  the tables of ``sdp-bench report``, ``compare``, ``memory`` and ``capacity`` (:mod:`sdp.bench`), one row
  per run of a benchmark, each figure on the rank where it is largest.

Why one module: the reference row, the ratio (:func:`sdp.report.stats.ratio`) and the cell formats are
decided once for every table that says "x DDP", so two tables never disagree on what the ratio means.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sdp.report.render import STD_NOTE, Column, delta_note, layout, markdown_grid
from sdp.report.runs import run_figures
from sdp.report.stats import ratio
from sdp.report.tables import Row, Table
from sdp.results.summary import Summary

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


def mib(v: float | None, *, missing: str = "n/a") -> str:
    """Bytes as MiB with two decimals, the unit of every table here; ``missing`` when not measured."""
    return missing if v is None else f"{v / 2**20:.2f}"


def times(x: float | None, *, digits: int = 3, unit: str = "x", missing: str = "n/a") -> str:
    """A ratio as ``0.575x``; ``missing`` when either side was not measured (:func:`sdp.report.stats.ratio`)."""
    return missing if x is None else f"{x:.{digits}f}{unit}"


def _mib(v: float | None, unit: str = "MiB") -> str:
    return "n/a" if v is None else f"{mib(v)} {unit}"


def comparison_markdown(table: Table) -> str:
    """One table: method, C, k, seeds, eval accuracy and four ratios to DDP, then DDP's figures and a legend
    (what each ± is: :data:`~sdp.report.render.STD_NOTE`, :data:`~sdp.report.render.DELTA_NOTE`)."""
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
              f"optimizer steps. {STD_NOTE} C = coverage, k = workers "
              "holding each unit (k = 1: no unit gradient is ever averaged). Ratios are ratios of means to the "
              f"{REFERENCE} row, each figure on the rank where it is largest: model state = params + grads + "
              "optimizer state; comm = bytes all-reduced per training step; step time = the slowest rank's median "
              f"step; {peak_note}.{delta_note(header)}"]
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


# The benchmark suites' tables (sdp.bench): one row per run, a dict of run_figures' figures.
REPORT_RATIOS = ("model_state_bytes", "activation_bytes", "peak_bytes", "comm_bytes_per_step", "wire_bytes_per_step",
                 "step_s", "model_state_mean_bytes", "activation_mean_bytes")
COMPARE_RATIOS = ("model_state_bytes", "grad_optim_bytes", "comm_bytes_per_step", "wire_bytes_per_step", "step_s_median")
MEMORY_PEAKS = ("setup_peak_bytes", "train_peak_bytes", "eval_peak_bytes")


def reference_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row every ratio is taken to: the DDP run, else the first row (a set of runs without DDP)."""
    return next((r for r in rows if r["strategy"] == "ddp"), rows[0])


def add_ratios(rows: list[dict[str, Any]], *, keys: tuple[str, ...], base: dict[str, Any] | None = None) -> None:
    """``row["x_ddp"][key]``: each row's figure over ``base``'s (default :func:`reference_row`)."""
    base = reference_row(rows) if base is None else base
    for r in rows:
        r["x_ddp"] = {k: ratio(r.get(k), base.get(k)) for k in keys}


def _x(r: dict[str, Any], key: str) -> str:
    return "" if r["x_ddp"].get(key) is None else f" ({times(r['x_ddp'][key])})"


def _opt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def report_markdown(rows: list[dict[str, Any]], *, title: str) -> str:
    """``sdp-bench report``: every figure with its ratio to DDP, the interleaved repeats, fullest rank vs mean."""
    head = ("| run | model state MiB | activations MiB | peak MiB | comm MiB/step | wire MiB/step | step s (median) | "
            "straggler | samples/s | tokens/s | MFU | eval loss |")
    lines = [f"### {title}", "", head, "|" + "---|" * 12]
    m = lambda b: mib(b, missing="")  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['run']} | {m(r['model_state_bytes'])}{_x(r, 'model_state_bytes')} | {m(r['activation_bytes'])}{_x(r, 'activation_bytes')} | "
            f"{m(r['peak_bytes'])}{_x(r, 'peak_bytes')} | {m(r['comm_bytes_per_step'])}{_x(r, 'comm_bytes_per_step')} | "
            f"{m(r['wire_bytes_per_step'])}{_x(r, 'wire_bytes_per_step')} | {_opt(r['step_s'], '.4f')}{_x(r, 'step_s')} | "
            f"{_opt(r['straggler_spread'], '.3f')} | {_opt(r['samples_per_s'], '.1f')} | {_opt(r['tokens_per_s'], '.0f')} | "
            f"{_opt(r['mfu'], '.3f')} | {_opt(r['eval_loss'], '.4f')} |")
    kind = rows[0]["peak_kind"] if rows else ""
    lines += ["", f"Every figure on the rank where it is largest; ratios to DDP in parentheses. Model state = params + "
              f"grads + optimizer state; activations = bytes saved for backward in the first measured step; peak = {kind}; "
              "step s = the slowest rank's median step time (warm-up excluded; with --repeat, the median over the "
              "repeats); straggler = max/min of per-rank medians. "
              "SDP's transient evaluation assembly (its largest part) is reported apart (report.json: eval_assembled_bytes)."]
    if rows and len(rows[0]["step_s_repeats"]) > 1:
        base = reference_row(rows)
        lines += ["", "| run | step s per interleaved repeat | ratio to the same repeat's DDP |", "|---|---|---|"]
        lines += [f"| {r['run']} | {', '.join(f'{v:.4f}' for v in r['step_s_repeats'])} | "
                  f"{', '.join(times(ratio(v, b)) for v, b in zip(r['step_s_repeats'], base['step_s_repeats']))} |" for r in rows]
    lines += ["", "| run | model state MiB: fullest rank | mean over ranks | activations MiB: fullest rank | mean over ranks |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {m(r['model_state_bytes'])}{_x(r, 'model_state_bytes')} | {m(r['model_state_mean_bytes'])}"
              f"{_x(r, 'model_state_mean_bytes')} | {m(r['activation_bytes'])}{_x(r, 'activation_bytes')} | "
              f"{m(r['activation_mean_bytes'])}{_x(r, 'activation_mean_bytes')} |" for r in rows]
    lines += ["", "The mean over ranks is the floor of the fullest rank: when every unit is held by the same number of "
              "workers, the sum over ranks does not depend on which worker holds which unit (exactly for model state; "
              "for activations up to how neighbouring dropped blocks interact), so no assignment puts the fullest "
              "rank below the mean. `sdp-plan parallelism=sdp plan.frontier=true ...` scores every "
              "assignment and prints the frontier between the two figures."]
    return "\n".join(lines)


def compare_markdown(rows: list[dict[str, Any]]) -> str:
    """``sdp-bench compare``: the table only, with the communication counts and the accuracy."""
    head = ("| run | model state MiB (x) | grad+optim MiB (x) | comm MiB/step (x) | wire MiB/step (x) | "
            "collectives/step | step s (x) | straggler | accuracy |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        x = {k: times(v, unit="") for k, v in r["x_ddp"].items()}
        acc = "n/a" if r["eval_accuracy"] is None else f"{r['eval_accuracy']:.4f}"
        lines.append(
            f"| {r['run']} | {mib(r['model_state_bytes'])} ({x['model_state_bytes']}) | "
            f"{mib(r['grad_optim_bytes'])} ({x['grad_optim_bytes']}) | "
            f"{mib(r['comm_bytes_per_step'])} ({x['comm_bytes_per_step']}) | "
            f"{mib(r['wire_bytes_per_step'])} ({x['wire_bytes_per_step']}) | "
            f"{r['collectives_per_step']:.1f} | {r['step_s_median']:.4f} ({x['step_s_median']}) | "
            f"{r['straggler_spread']:.3f} | {acc} |"
        )
    return "\n".join(lines)


def memory_markdown(*, title: str, rows: dict[str, dict[str, Any]], targets: dict[str, float]) -> str:
    """``sdp-bench memory``: the three peaks against DDP's, SDP's against its targets, the tracker's cost."""
    base = rows["ddp"]
    lines = [f"### {title}", "",
             "| run | set-up peak MiB (x) | train peak MiB (x) | eval peak MiB (x) | model state MiB | step s |",
             "|---|---|---|---|---|---|"]
    for label, r in rows.items():
        cells = [f"{mib(r.get(k))} ({times(ratio(r.get(k), base.get(k)))})" for k in MEMORY_PEAKS]
        lines.append(f"| {label} | {' | '.join(cells)} | {mib(r['model_state_bytes'])} | {r['step_s']:.4f} |")
    lines.append("")
    for k, bound in targets.items():
        x = ratio(rows["sdp"].get(k), base.get(k))
        verdict = "n/a" if x is None else ("HIT" if x <= bound else "MISSED")
        lines.append(f"- {k}: sdp/ddp = {times(x, unit='')} (target <= {bound}) {verdict}")
    for name in ("ddp", "sdp"):
        off = rows.get(f"{name}_untracked")
        if off and off["step_s"]:
            lines.append(f"- tracker cost, {name}: step time on/off = {times(ratio(rows[name]['step_s'], off['step_s']), unit='')}")
    cats = rows["sdp"].get("train_categories")
    if cats:
        lines.append("- at the train peak (MiB), ddp: " + ", ".join(f"{k} {mib(v)}" for k, v in (base["train_categories"] or {}).items())
                     + "; sdp: " + ", ".join(f"{k} {mib(v)}" for k, v in cats.items()))
    return "\n".join(lines)


def capacity_markdown(*, title: str, best: list[dict[str, Any]]) -> str:
    """``sdp-bench capacity``: the largest model each strategy trained, its parameters against DDP's."""
    ddp = next((b["params"] for b in best if b["strategy"] == "ddp"), None)
    lines = [f"### {title}", "", "| strategy | depth | width | params (M) | params vs DDP | peak MiB (largest rank) |",
             "|---|---|---|---|---|---|"]
    for b in best:  # a strategy that fitted nothing has 0 parameters: no ratio, not 0.00x
        x = times(ratio(b["params"] or None, ddp), digits=2)
        lines.append(f"| {b['strategy']} | {b['depth']} | {b['width']} | {b['params'] / 1e6:.3f} | {x} | {mib(b['peak_bytes'])} |")
    return "\n".join(lines)
