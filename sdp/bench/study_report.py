"""The report of a CPU study (``benchmarks/cpu_study.py``): one row per method, every difference to DDP
paired by seed with its 95 % interval, time to DDP's quality, measured training peaks, plots, and one
verdict per claim of the paper, all computed from the run directories.

Layout read: ``<study>/runs/main`` (the FLOP-matched and same-iteration rows, seeds 0-2, and seeds 3-4 in
``main/seeds-3-4``; a row run apart with its final weights kept in ``main/kept``, :attr:`Study.kept`; with a depth gate, the DDP rows are the gate's runs of the study's task, :func:`sdp.bench.gate.task_runs`), ``<study>/runs/extras`` (FSDP's check, rescale rules), ``<study>/runs/depth`` (B-SDP
C = 0.5 at other depths: the assembly gap against depth), ``<study>/runs/peaks`` (one short run per method
with the live-tensor tracker: the training peak). Written: ``<study>/REPORT.md``, ``table.csv``,
``curves.png`` (evaluation loss against the fraction of DDP's FLOPs, mean and a band of +- one sample
std over seeds), ``frontier.png`` (quality against each resource: :mod:`sdp.bench.frontier`); with ``runs/gate``
(LM), the depth gate first (:mod:`sdp.bench.gate`).

What is measured and what follows by construction is kept apart: the training peak, comm bytes, time
and losses are measured; the model-state ratio follows from the plan and is labelled so.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from sdp.bench.gate import task_runs
from sdp.report.runs import Run, find_runs, run_figures
from sdp.report.stats import TARGET_FACTOR, Paired, paired_difference, ratio, t_half_width, time_to_target
from sdp.report.tables import method_facts
from sdp.results.contract import read_metrics

T = TypeVar("T")

NOMINAL_RANGE = (0.40, 0.72)  # the paper's "28-60 % less memory per device" as a ratio to DDP
PAPER_COMMANDS = {
    "lm": "sdp-train -m experiment=paper_llama_fineweb dataset.root=/data/fineweb10B cluster=slurm_gpu",
    "lm_text": "sdp-train -m experiment=paper_llama_fineweb dataset.root=/data/fineweb10B cluster=slurm_gpu",
    "image": "sdp-train -m experiment=paper_resnet18_cifar10 dataset.root=/data/cifar10 cluster=slurm_gpu",
}


def row_name(run: Run, *, remedies: bool = True) -> str:
    """A method's row: its paper label, coverage (C) or survival probability (p), and what sets it apart;
    ``remedies=False``: without issue 39's one-model remedies, the row a remedy run is of."""
    f = run.flat
    label, cov = method_facts(run)
    name = label
    if cov is not None:
        name += f" {cov['symbol']}={cov['value']:g}"  # C = coverage, p = a drop baseline's survival probability
    ref = {k[len("train.flops_reference."):]: v for k, v in f.items()
           if k.startswith("train.flops_reference.") and f.get(f"model.{k[len('train.flops_reference.'):]}") != v}
    if ref:  # a smaller (or other) model matched to a reference model's FLOPs (a model matched to itself is the plain row)
        own = ", ".join(f"{k}={f.get(f'model.{k}')}" for k in ref)
        name += f" {own} (FLOP-matched to {', '.join(f'{k}={v}' for k, v in ref.items())})"
    rescale = f.get("parallelism.rescale")
    if f.get("parallelism.masking") == "forward" and rescale not in (None, "auto"):  # backward: always none
        name += f" rescale={rescale}"
    if f.get("parallelism.depth") == "exact":  # a drop baseline keeping exactly p x n blocks per rank and batch
        name += " exact depth"
    if remedies and f.get("parallelism.consolidate") is not None:  # issue 39: the last share of the budget trains the assembled model
        name += f" consolidate={f['parallelism.consolidate']:g}"
        name += f" distill={f['parallelism.distill_alpha']:g}" if f.get("parallelism.distill_alpha") else ""
        q = float(f.get("parallelism.consolidate_survival") or 1.0)
        name += (f" survival={q:g}" if q < 1 else "") + (" average=world" if f.get("parallelism.consolidate_average") == "world" else "")
    if remedies and f.get("parallelism.calibrate_steps"):  # assembly calibration after training (sdp/parallel/sdp_calibrate.py)
        name += f" calibrate={f['parallelism.calibrate_steps']}"
    if f.get("train.budget") == "iterations" and cov is not None:  # a FLOP budget would have run it longer
        name += " (same iterations)"
    return name


def peak_name(name: str) -> str:
    return name.replace(" (same iterations)", "")


@dataclass
class Row:
    name: str
    runs: dict[int, Run] = field(default_factory=dict)  # by seed

    def values(self, key: str) -> dict[int, float | None]:
        return {s: run_figures(r.summary)[key] for s, r in self.runs.items()}

    def present(self, key: str) -> list[float]:
        """``key``'s values over the seeds that have one."""
        return [v for v in self.values(key).values() if v is not None]

    def mean_std(self, key: str) -> tuple[float | None, float | None]:
        vals = self.present(key)
        if not vals:
            return None, None
        return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def collect(runs: list[Run]) -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for run in runs:
        if not run.ok:
            continue
        name = row_name(run)
        rows.setdefault(name, Row(name)).runs[int(run.seed)] = run
    return rows


def collect_depths(runs: list[Run]) -> dict[int, dict[str, Row]]:
    """Rows by the model's depth (``model.n_layers``), then by method."""
    depths: dict[int, list[Run]] = {}
    for run in runs:
        depths.setdefault(int(run.flat["model.n_layers"]), []).append(run)
    return {n: collect(rs) for n, rs in sorted(depths.items())}


def by_method(rows: dict[str, Row]) -> dict[str, Row]:
    return {peak_name(name): row for name, row in rows.items()}


def curve(run: Run, *, ddp_flops: float) -> list[tuple[float, float]]:
    """(fraction of DDP's total FLOPs, eval loss) at each evaluation of ``run``."""
    per_step = (run.summary.budget or {}).get("flops_per_step") or 0.0
    return [(r["step"] * per_step / ddp_flops, r["eval_loss"]) for r in read_metrics(run.path)
            if r.get("eval_loss") is not None]


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)


def pm(mean: float | None, std: float | None, spec: str = ".3f") -> str:
    return "–" if mean is None else fmt(mean, spec) + ("" if std is None else f" ± {fmt(std, spec)}")


def interval(p: Paired, spec: str = "+.3f") -> str:
    if p.mean is None:
        return "–"
    hw = "no interval (n = 1)" if p.half_width is None else f"± {p.half_width:.3f}"
    return f"{p.mean:{spec}} {hw}" + ("" if p.resolved else " · not resolved")


def mean_interval(values: list[float]) -> str:
    """``+mean ± 95 % t half-width`` of ``values`` (no interval from one value; "–" from none)."""
    if not values:
        return "–"
    hw = t_half_width(values)
    return f"{statistics.fmean(values):+.3f}" + ("" if hw is None else f" ± {hw:.3f}")


def verdict(p: Paired, *, what: str, unit: str = "nats") -> str:
    """One line: the difference, its interval, and whether it is resolved (interval excludes 0)."""
    if p.mean is None:
        return f"{what}: no paired runs"
    if p.half_width is None:
        return f"{what}: {p.mean:+.3f} {unit} from one seed: no interval, not resolved"
    side = "higher" if p.mean > 0 else "lower"
    if not p.resolved:
        return f"{what}: not resolved ({p.mean:+.3f} ± {p.half_width:.3f} {unit}, n = {p.n})"
    return f"{what}: {side} by {abs(p.mean):.3f} ± {p.half_width:.3f} {unit} (n = {p.n}, resolved)"


class Study:
    """The rows of one study and every derived figure, computed once."""

    def __init__(self, *, study_dir: Path, study: str) -> None:
        self.dir, self.study = Path(study_dir), study
        runs_dir = self.dir / "runs"
        self.runs = [r for sub in ("main", "extras") if (runs_dir / sub).is_dir() for r in find_runs(runs_dir / sub)]
        self.runs += task_runs(study_dir=self.dir, study=study)  # the gate's DDP runs of the study's task, every depth
        self.rows = collect(self.runs)
        # one short run per method (under the iterations budget whatever the method's): keyed by the method
        self.peaks = by_method(collect(find_runs(runs_dir / "peaks"))) if (runs_dir / "peaks").is_dir() else {}
        self.timing = by_method(collect(find_runs(runs_dir / "timing"))) if (runs_dir / "timing").is_dir() else {}
        # the same method at other depths (model.n_layers), kept out of the rows: its row name would collide
        self.depth = collect_depths(find_runs(runs_dir / "depth")) if (runs_dir / "depth").is_dir() else {}
        assert "DDP" in self.rows, f"no DDP run with a summary below {runs_dir}: rows {sorted(self.rows)}"
        self.ddp = self.rows["DDP"]
        self.metric = "eval_accuracy" if self.ddp.mean_std("eval_accuracy")[0] is not None else None
        self.target = self.ddp.mean_std("eval_loss")[0] * TARGET_FACTOR
        self._once: dict[str, Any] = {}

    def once(self, key: str, build: Callable[[], T]) -> T:
        """``build()``'s result, built at the first call with ``key`` and kept: a figure several sections read (the
        remedies' rows, the frontier's points) is computed once per render, not once per section."""
        return self._once[key] if key in self._once else self._once.setdefault(key, build())

    def paired(self, name: str, key: str = "eval_loss", *, reference: str = "DDP", ref_key: str | None = None) -> Paired:
        """Per-seed ``name``'s ``key`` minus ``reference``'s ``ref_key`` (default the same key)."""
        if name not in self.rows or reference not in self.rows:
            return Paired(None, None, 0)
        return paired_difference(self.rows[name].values(key), self.rows[reference].values(ref_key or key))

    def paired_workers(self, name: str) -> Paired:
        """The subnetworks that were trained (mean over workers of each one's own eval loss) minus DDP's model."""
        return self.paired(name, "eval_loss_workers", ref_key="eval_loss")

    def paired_ensemble(self, name: str, key: str = "eval_loss") -> Paired:
        """The ensemble of the workers' subnetworks (their mean predicted probability) minus DDP's model, on
        ``key`` (eval_loss or eval_accuracy); no pairs where ``name``'s runs predate the ensemble."""
        return self.paired(name, f"{key}_ensemble", ref_key=key)

    @property
    def ensembled(self) -> bool:
        """Whether any row has an ensemble evaluation: the ensemble's columns exist only then, so a study
        whose runs all predate it renders as it did before them."""
        return any(row.present("eval_loss_ensemble") for row in self.rows.values())

    @property
    def kept(self) -> str | None:
        """The row whose runs kept their final weights (``train.save_final``): a main row run once and read by every
        section that needs the fixed plan (the re-draw and one-model sections), None where no row did."""
        return next((name for name, row in self.rows.items()
                     if any(str(r.flat.get("train.save_final", "none")) != "none" for r in row.runs.values())), None)

    def kept_of(self, runs: list[Run]) -> str | None:
        """The kept row (:attr:`kept`) when ``runs`` (a section's re-draws or remedies) are variants of it: their row
        name without issue 39's remedies (re-draw keys are not in a row name); else None, so that a section never
        borrows the kept runs of another row as its fixed plan."""
        return self.kept if self.kept in {row_name(r, remedies=False) for r in runs} else None

    def gap_by_depth(self, name: str) -> dict[int, Row]:
        """``name``'s row at every depth run: the main sweep's depth and each depth of ``runs/depth``."""
        out = {n: rows[name] for n, rows in self.depth.items() if name in rows}
        if name in self.rows:
            out[int(next(iter(self.rows[name].runs.values())).flat["model.n_layers"])] = self.rows[name]
        return dict(sorted(out.items()))

    def ratio(self, name: str, key: str, *, source: str = "main") -> float | None:
        rows = {"peaks": self.peaks, "timing": self.timing, "main": self.rows}[source]
        name = name if source == "main" else peak_name(name)  # one peak / timing run per method, whatever the budget
        ref = "DDP"
        if name not in rows or ref not in rows:
            return None
        return ratio(rows[name].mean_std(key)[0], rows[ref].mean_std(key)[0])

    def step_s(self, name: str) -> float | None:
        """The method's median step time from its quiet timing run (None without one)."""
        row = self.timing.get(peak_name(name))
        return None if row is None else row.mean_std("step_s")[0]

    def reach(self, row: Row) -> str:
        """Steps to DDP's final loss x TARGET_FACTOR (mean over the seeds that reach it) and seconds = those
        steps x the timing run's step time (the long runs' own wall-clock is not used: other jobs may have run)."""
        hits = [time_to_target(read_metrics(r.path), target=self.target) for r in row.runs.values()]
        done = [h for h in hits if h[0] is not None]
        if not done:
            return f"not reached (0/{len(hits)})"
        steps = statistics.fmean(h[0] for h in done)
        step_s = self.step_s(row.name)
        secs = "" if step_s is None else f" / {steps * step_s:.0f} s"
        return f"{steps:.0f} st{secs} ({len(done)}/{len(hits)})"

    def table(self) -> list[dict[str, str]]:
        out = []
        for name, row in sorted(self.rows.items(), key=lambda kv: _order(kv[0])):
            flops = self.ratio(name, "total_flops")
            rec = {
                "method": name, "seeds": ",".join(str(s) for s in sorted(row.runs)),
                "steps": fmt(row.mean_std("steps")[0], ".0f"), "FLOPs x DDP": fmt(flops, ".2f"),
                "eval loss": pm(*row.mean_std("eval_loss")),
                "Δ loss vs DDP (95 % CI)": "" if name == "DDP" else interval(self.paired(name)),
            }
            if self.metric:
                rec["accuracy %"] = pm(*row.mean_std("eval_accuracy"), ".2f")
                rec["Δ acc vs DDP (pts)"] = "" if name == "DDP" else interval(self.paired(name, "eval_accuracy"), "+.2f")
            rec["workers' own loss"] = pm(*row.mean_std("eval_loss_workers"))
            workers = self.paired_workers(name)
            rec["Δ workers' loss vs DDP"] = "–" if workers.mean is None else interval(workers)
            rec["assembly gap"] = mean_interval(row.present("assembly_gap"))
            if self.ensembled:  # "–" in a row whose runs have no ensemble (DDP's, older runs): absent, not 0
                rec["workers' ensemble loss"] = pm(*row.mean_std("eval_loss_ensemble"))
                rec["Δ ensemble loss vs DDP"] = interval(self.paired_ensemble(name))
                if self.metric:
                    rec["Δ ensemble acc vs DDP (pts)"] = interval(self.paired_ensemble(name, "eval_accuracy"), "+.2f")
            rec[f"to DDP loss x {TARGET_FACTOR}"] = self.reach(row)
            rec["train peak x DDP"] = fmt(self.ratio(name, "train_peak_bytes", source="peaks"))
            rec["state x DDP (by construction)"] = fmt(self.ratio(name, "model_state_bytes", source="peaks"))
            rec["comm/step x DDP"] = fmt(self.ratio(name, "comm_bytes_per_step"))
            rec["step s x DDP"] = fmt(self.ratio(name, "step_s", source="timing"))
            out.append(rec)
        return out


def _order(name: str) -> tuple[int, str]:
    for i, prefix in enumerate(("DDP", "FSDP", "B-SDP", "B_β-SDP", "N-SDP", "DDP+")):
        if name == prefix or name.startswith(prefix + " ") or (prefix == "DDP+" and name.startswith(prefix)):
            return i, name
    return 9, name


def write_csv(path: Path, records: list[dict[str, str]]) -> None:
    """``records`` (one dict per row, the first one's keys the header) as a CSV file: every section's table
    beside the report (table.csv, remedies.csv, one_model.csv) is written by this one function."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def markdown_table(records: list[dict[str, str]]) -> str:
    head = list(records[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r[h] for h in head) + " |" for r in records]
    return "\n".join(lines)
