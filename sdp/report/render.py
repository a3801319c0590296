"""Tables to markdown, CSV and W&B: the paper's layout (rows = method variants, columns = metrics).

Markdown shows mean ± sample std over seeds with ``seeds`` (``2 of 3`` when a seed is missing), ratios to
DDP as ``0.52x``, paired differences to DDP as mean ± the half-width of their 95 % interval (:data:`STD_NOTE`,
:data:`DELTA_NOTE`: the footer of every table says which ± is which), and a ``paper`` column right after every metric the paper gives a value for in
this table. Columns empty in every row are left out (no accuracy for language models). CSV keeps
every number apart (mean, std, n) so that plots and checks read it without parsing.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sdp.report.stats import PAIRED_METRICS, TARGET_FACTOR
from sdp.results import evalresult
from sdp.report.tables import AGGREGATED, RATIOS, Row, Table


@dataclass(frozen=True)
class Column:
    key: str            # stats key, ratio name or "paper" key
    header: str
    kind: str           # "stat" | "ratio"
    digits: int


# What each ± of a table is, said under every table that shows one (this module's and sdp.report.compare's).
STD_NOTE = "seeds = the seeds with results (of the sweep's); a ± after a mean is the sample std over those seeds."
DELTA_NOTE = ("Δ vs DDP (95 % CI): the mean of the per-seed differences to DDP (same seed = same initial weights and "
              "data order) ± the half-width of its 95 % Student t interval (seeds − 1 degrees of freedom), "
              "\"not resolved\" when the interval contains 0; one seed gives no interval.")


def delta_note(header: list[str]) -> str:
    """`` `` + :data:`DELTA_NOTE` where the table has a Δ column (a table without a DDP row has none), else ``""``."""
    return f" {DELTA_NOTE}" if any(h.startswith("Δ") for h in header) else ""


COLUMNS = (
    Column("steps", "steps", "stat", 0),
    *(Column(name, header, "stat", digits) for name, header, digits in evalresult.columns()),  # by EvalResult field
    Column("state_mem_x_ddp", "model-state mem ×DDP", "ratio", 3),
    Column("train_peak_mem_x_ddp", "train peak mem ×DDP", "ratio", 3),
    Column("peak_mem_x_ddp", "peak mem ×DDP", "ratio", 3),
    Column("comm_x_ddp", "comm bytes/step ×DDP", "ratio", 3),
    Column("step_time_x_ddp", "step time ×DDP", "ratio", 3),
    Column("straggler_spread", "straggler spread", "stat", 3),
    Column("flops_x_ddp", "FLOPs ×DDP", "ratio", 3),
)


def _num(v: float | None, digits: int) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _stat_cell(row: Row, col: Column) -> str:
    s = row.stats.get(col.key)
    if s is None or s.mean is None:
        return ""
    if s.std is None or (col.digits == 0 and s.std == 0):
        return _num(s.mean, col.digits)
    return f"{_num(s.mean, col.digits)} ± {_num(s.std, col.digits)}"


def _cell(row: Row, col: Column) -> str:
    if col.kind == "stat":
        return _stat_cell(row, col)
    r = row.ratios.get(col.key)
    return "" if r is None else f"{r:.{col.digits}f}x"


def _seeds(row: Row) -> str:
    if not row.runs:
        return ""
    total = len(row.expected_seeds)
    return f"{row.n_ok}" if row.n_ok == total else f"{row.n_ok} of {total}"


def _paired(row: Row, metric: str, digits: int) -> str:
    p = row.paired.get(metric)
    if p is None or p.mean is None:
        return ""
    if p.half_width is None:
        return f"{p.mean:+.{digits}f} ({p.n} seed: no interval)"
    return f"{p.mean:+.{digits}f} ± {p.half_width:.{digits}f}" + ("" if p.resolved else " (not resolved)")


def _target(row: Row, key: str, digits: int) -> str:
    reached, total = row.reached
    if total == 0:
        return ""
    if reached == 0:
        return "not reached"
    mean = row.to_target[key].mean
    return f"{mean:.{digits}f}" + ("" if reached == total else f" ({reached} of {total})")


def _coverage(row: Row) -> str:
    return "" if row.coverage is None else f"{row.coverage:g}"


def layout(table: Table, *, columns: tuple[Column, ...] = COLUMNS,
           after_coverage: tuple[tuple[str, Callable[[Row], str]], ...] = ()) -> tuple[list[str], list[list[str]]]:
    """Header and string cells of the markdown table (empty columns dropped): method, C, the
    ``after_coverage`` columns, the row keys, seeds, then ``columns`` (each with its paper column, if any)."""
    cols: list[tuple[str, Callable[[Row], str]]] = [("method", lambda r: r.method), ("C", _coverage), *after_coverage]
    cols += [(k.split(".")[-1] if k.count(".") else k, (lambda r, k=k: str(r.keys.get(k, "")))) for k in table.extra_keys]
    cols.append(("seeds", _seeds))
    for col in columns:
        cols.append((col.header, lambda r, col=col: _cell(r, col)))
        if any(col.key in r.paper for r in table.rows):
            cols.append((f"paper {col.header}", lambda r, col=col: _num(r.paper.get(col.key), col.digits)))
    cols.append(("Δ eval loss vs DDP (95 % CI)", lambda r: _paired(r, "eval_loss", 4)))
    cols.append(("Δ eval acc vs DDP (pts, 95 % CI)", lambda r: _paired(r, "eval_accuracy", 2)))
    cols.append((f"steps to DDP loss ×{TARGET_FACTOR:g}", lambda r: _target(r, "steps", 0)))
    cols.append((f"seconds to DDP loss ×{TARGET_FACTOR:g}", lambda r: _target(r, "seconds", 1)))
    cols.append(("notes", lambda r: "; ".join(r.notes)))
    cells = [[fn(r) for _, fn in cols] for r in table.rows]
    keep = [i for i, (name, _) in enumerate(cols) if name in ("method", "seeds") or any(c[i] for c in cells)]
    return [cols[i][0] for i in keep], [[c[i] for i in keep] for c in cells]


def markdown_grid(header: list[str], cells: list[list[str]]) -> list[str]:
    """A markdown table's lines (a ``|`` inside a cell becomes ``/``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]


def to_markdown(table: Table) -> str:
    header, cells = layout(table)
    lines = [f"### {table.title}", "", *markdown_grid(header, cells)]
    notes = table.notes + table.paper_notes
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    lines += ["", f"{STD_NOTE} Ratios are ratios of means to the DDP row; memory and comm "
              "on the rank where each is largest; peak = CUDA max allocated when on GPU, else peak RSS delta."
              f"{delta_note(header)} Steps / seconds to DDP loss ×{TARGET_FACTOR:g}: first evaluation "
              "at or below DDP's mean final eval loss times that factor (resolution: train.eval_every)."]
    return "\n".join(lines)


def records(table: Table) -> tuple[list[str], list[list[Any]]]:
    """Every number apart (for CSV and wandb.Table): mean/std per metric, ratios, paper values."""
    paper_keys = sorted({k for r in table.rows for k in r.paper})
    header = ["method", "coverage", *table.extra_keys, "n", "n_expected"]
    header += [f"{m}_{s}" for m in AGGREGATED for s in ("mean", "std")]
    header += list(RATIOS.values()) + [f"paper_{k}" for k in paper_keys]
    header += [f"delta_{m}_{s}" for m in PAIRED_METRICS for s in ("mean", "ci95_half_width", "n", "resolved")]
    header += ["target_reached", "target_steps_mean", "target_seconds_mean", "notes"]
    rows = []
    for r in table.rows:
        line: list[Any] = [r.method, r.coverage, *[r.keys.get(k) for k in table.extra_keys], r.n_ok, len(r.expected_seeds)]
        for m in AGGREGATED:
            s = r.stats.get(m)
            line += [s.mean if s else None, s.std if s else None]
        line += [r.ratios.get(k) for k in RATIOS.values()] + [r.paper.get(k) for k in paper_keys]
        for m in PAIRED_METRICS:
            p = r.paired.get(m)
            line += [p.mean, p.half_width, p.n, p.resolved] if p is not None else [None] * 4
        hit = r.to_target
        line += [f"{r.reached[0]}/{r.reached[1]}", hit["steps"].mean if hit else None, hit["seconds"].mean if hit else None]
        line.append("; ".join(r.notes))
        rows.append(line)
    return header, rows


def slug(table: Table, *, index: int, count: int) -> str:
    if count == 1:
        return "table"
    text = "_".join(f"{k.split('.')[-1]}-{v}" for k, v in table.context.items()) or f"table{index}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:120]


def write_table(table: Table, *, out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / f"{name}.md", out_dir / f"{name}.csv"
    md.write_text(to_markdown(table) + "\n")
    header, rows = records(table)
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in row] for row in rows])
    return md, csv_path
