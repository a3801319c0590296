"""From runs to tables: group by everything but the seed, aggregate over seeds, ratios to DDP.

Group keys are derived, not configured: every config key (dotted) that takes two or more different
values across the sweep's runs, minus the seed and run-location keys (``exclude``). A key present in
only some runs with one value (a preset's own knob) follows from another key and is not a group key.
Group keys outside ``parallelism.*``, ``train.steps`` and the schedule keys a FLOP budget scales with the
steps (:data:`sdp.driver.budget.SCALED_KEYS`) split the sweep into separate tables (one
per model, dataset, world size, budget, evaluation protocol ``eval.bn``, ...); within a table, rows
are method variants, so no table ever compares rows that were evaluated differently.

Statistics: mean and sample standard deviation (n - 1) over the seeds with a ``summary.json``; ``n``
is shown against the seeds the sweep has, and every missing or failed seed is named in the row's
notes. Ratios to DDP are ratios of means against the DDP row of the same table.
"""

from __future__ import annotations

import fnmatch
import statistics
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from sdp.driver.budget import SCALED_KEYS
from sdp.parallel import STRATEGIES
from sdp.report.runs import Run, run_figures
from sdp.report.stats import PAIRED_METRICS, TARGET_FACTOR, Paired, paired_difference, ratio, run_time_to_target
from sdp.results import evalresult
from sdp.results.contract import RUN_CONTROL_KEYS

DEFAULT_EXCLUDE = ("seed", "hydra.*", "logger.*", "*dir", "*_dir", "*root", "run_dir",
                   *(p for key in RUN_CONTROL_KEYS for p in (key, f"{key}.*")))
# what the budget sets per method (sdp/driver/budget.py: steps and the schedule keys scaled with them; shown as row columns)
METHOD_KEYS = ("parallelism.*", "train.steps", *SCALED_KEYS)
TITLE_KEYS = {"model.name": "model", "dataset.name": "dataset", "cluster.world_size": "workers",
              "train.budget": "budget", "scale.name": "scale", "eval.bn": "eval BN"}
# A title fact left out at this value: scale=paper is conf/scale's default, "the experiment as written", so it
# says nothing of a run's size (a digits run is no paper-scale run); a scale that changed the run (cpu) is shown.
TITLE_DEFAULTS = {"scale.name": "paper"}
METHOD_ORDER = ("DDP", "B-SDP", "B_β-SDP", "N-SDP", "N_β-SDP")
# the evaluation's figures the table shows (sdp.results.evalresult: read from its fields), then the run's own
AGGREGATED = (*(name for name, _, _ in evalresult.columns()), "train_loss", "model_state_bytes",
              "train_peak_bytes", "peak_bytes",
              "comm_bytes_per_step", "step_s", "samples_per_s", "straggler_spread", "steps", "total_flops")
RATIOS = {"model_state_bytes": "state_mem_x_ddp", "train_peak_bytes": "train_peak_mem_x_ddp", "peak_bytes": "peak_mem_x_ddp",
          "comm_bytes_per_step": "comm_x_ddp", "step_s": "step_time_x_ddp", "total_flops": "flops_x_ddp"}


def method_facts(run: Run) -> tuple[str, dict[str, Any] | None]:
    """(label, coverage) of a run's method: as summary.json records them (the strategy's
    ``report_facts``), else -- a run written before summary.json had them, or one without a summary --
    asked of its strategy from the run's config; a strategy this process does not know: its name."""
    if run.summary is not None and run.summary.label is not None:
        return run.summary.label, run.summary.coverage
    name = str(run.flat.get("parallelism.name"))
    if name not in STRATEGIES:
        return name, None
    cfg = OmegaConf.create(run.config)
    facts = STRATEGIES.get(name).report_facts(cfg=cfg.parallelism, world_size=int(cfg.cluster.world_size),
                                               ac=str(cfg.get("train", {}).get("ac", "none")))
    return facts["label"], facts["coverage"]


def method_label(run: Run) -> str:
    """The paper's name of a run's method (DDP, B-SDP, B_β-SDP, N-SDP, N_β-SDP, ...), from its strategy."""
    return method_facts(run)[0]


def row_coverage(run: Run) -> float | None:
    """The C column: the value of the key the strategy states its coverage with (SDP's coverage, a drop
    baseline's survival probability p: the reviewers' p = C); None for a method that runs the whole model."""
    cov = method_facts(run)[1]
    return None if cov is None else cov["value"]


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def group_keys(runs: list[Run], *, exclude: tuple[str, ...] = DEFAULT_EXCLUDE) -> list[str]:
    """Config keys with two or more distinct values across ``runs`` (seed and locations excluded)."""
    keys = sorted({k for r in runs for k in r.flat})
    out = []
    for k in keys:
        if _matches(k, exclude):
            continue
        values = {_hashable(r.flat[k]) for r in runs if k in r.flat}
        if len(values) > 1:
            out.append(k)
    return out


@dataclass
class Stat:
    mean: float | None
    std: float | None
    n: int


def aggregate(values: list[float | None]) -> Stat:
    present = [float(v) for v in values if v is not None]
    if not present:
        return Stat(None, None, 0)
    std = statistics.stdev(present) if len(present) > 1 else None
    return Stat(statistics.fmean(present), std, len(present))


@dataclass
class Row:
    """One method variant of one table: its runs, statistics over seeds, ratios and notes."""

    method: str
    coverage: float | None
    keys: dict[str, Any]
    runs: list[Run]
    expected_seeds: list[Any]
    stats: dict[str, Stat] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)
    paper: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    by_seed: dict[Any, dict[str, Any]] = field(default_factory=dict)  # run_figures of each seed with results
    paired: dict[str, Paired] = field(default_factory=dict)  # per-seed difference to the reference row
    to_target: dict[str, Stat] = field(default_factory=dict)  # steps / seconds to the reference's loss x 1.02
    reached: tuple[int, int] = (0, 0)  # (runs that reached the target, runs with results)

    @property
    def n_ok(self) -> int:
        return sum(r.ok for r in self.runs)


@dataclass
class Table:
    """One paper-layout table: rows are method variants, ``context`` the values shared by all rows."""

    context: dict[str, Any]
    extra_keys: list[str]
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    paper_notes: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        """What the rows share: model, dataset, workers, budget, scale (unless :data:`TITLE_DEFAULTS`' value), then
        the other context keys."""
        runs = [r for row in self.rows for r in row.runs]
        facts = {k: runs[0].flat.get(k) for k in TITLE_KEYS
                 if runs and runs[0].flat.get(k) is not None and runs[0].flat.get(k) != TITLE_DEFAULTS.get(k)}
        facts.update(self.context)
        return ", ".join(f"{TITLE_KEYS.get(k, k)}={v}" for k, v in facts.items()) or "all runs"


def _row(*, runs: list[Run], keys: dict[str, Any], expected: list[Any]) -> Row:
    row = Row(method=method_label(runs[0]), coverage=row_coverage(runs[0]), keys=keys, runs=runs,
              expected_seeds=expected)
    row.by_seed = {r.seed: run_figures(r.summary) for r in runs if r.ok}
    figures = list(row.by_seed.values())
    row.stats = {m: aggregate([f[m] for f in figures]) for m in AGGREGATED}
    seen = {r.seed for r in runs}
    for r in runs:
        if not r.ok:
            row.notes.append(f"seed {r.seed}: {r.status()} [{r.path.name}]")
    for s in expected:
        if s not in seen:
            row.notes.append(f"seed {s}: no run directory")
    return row


def _order(row: Row) -> tuple:
    rank = METHOD_ORDER.index(row.method) if row.method in METHOD_ORDER else len(METHOD_ORDER)
    return (rank, row.method, row.coverage if row.coverage is not None else 2.0,
            tuple(str(v) for v in row.keys.values()))


def build_tables(runs: list[Run], *, exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
                 reference: str = "DDP") -> list[Table]:
    """Group ``runs`` into tables and rows; fill statistics and ratios to the ``reference`` row."""
    if not runs:
        return []
    keys = group_keys(runs, exclude=exclude)
    context_keys = [k for k in keys if not _matches(k, METHOD_KEYS)]
    row_keys = [k for k in keys if k not in context_keys]
    expected = sorted({r.seed for r in runs}, key=str)
    tables: dict[tuple, dict[tuple, list[Run]]] = {}
    for r in runs:
        ctx = tuple(_hashable(r.flat.get(k)) for k in context_keys)
        grp = tuple(_hashable(r.flat.get(k)) for k in row_keys)
        tables.setdefault(ctx, {}).setdefault(grp, []).append(r)
    label_keys = {"parallelism.name", "train.steps", *(c["key"] for r in runs if (c := method_facts(r)[1])),
                  *(f"parallelism.{k}" for n in STRATEGIES.names() for k in STRATEGIES.get(n).label_keys)}  # shown already
    extra = [k for k in row_keys if k not in label_keys]
    out = []
    for ctx, groups in tables.items():
        rows = [_row(runs=g, keys={k: g[0].flat.get(k) for k in extra}, expected=expected) for g in groups.values()]
        rows.sort(key=_order)
        table = Table(context=dict(zip(context_keys, ctx)), extra_keys=extra, rows=rows)
        refs = [row for row in rows if row.method == reference]
        if len(refs) > 1:
            table.notes.append(f"{len(refs)} {reference} rows; ratios use the first ({refs[0].keys})")
        if not refs:
            table.notes.append(f"no {reference} row in this table: ratios are empty")
        for row in rows:
            for metric, name in RATIOS.items():
                row.ratios[name] = ratio(row.stats[metric].mean, refs[0].stats[metric].mean if refs else None)
        if refs:
            compare_to_reference(rows, reference=refs[0])
        out.append(table)
    return out


def compare_to_reference(rows: list[Row], *, reference: Row) -> None:
    """Paired differences (by seed) of every row to ``reference``, and each row's time to reach the
    reference's mean final eval loss x ``TARGET_FACTOR`` (see :mod:`sdp.report.stats`)."""
    target_loss = reference.stats["eval_loss"].mean
    for row in rows:
        if row is not reference:
            row.paired = {m: paired_difference({s: f[m] for s, f in row.by_seed.items()},
                                               {s: f[m] for s, f in reference.by_seed.items()}) for m in PAIRED_METRICS}
        if target_loss is None:
            continue
        hits = [run_time_to_target(r.path, target=target_loss * TARGET_FACTOR) for r in row.runs if r.ok]
        reached = [h for h in hits if h[0] is not None]
        row.reached = (len(reached), len(hits))
        row.to_target = {"steps": aggregate([h[0] for h in reached]), "seconds": aggregate([h[1] for h in reached])}
