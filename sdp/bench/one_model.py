"""The verdict of issue 39 in a CPU study's report: can block-level SDP hand over ONE model (DDP's inference cost)
at DDP's quality with a training peak of at most 0.60x DDP's in every phase?

Layout read (the study's stages ``onemodel-*`` and ``onemodelpeaks-*``, :mod:`sdp.bench.cpu_study`):

- the reference row, B-SDP C = 0.5 with its fixed plan and its final weights kept (``train.save_final``; the
  weights ``sdp-bench diagnose`` reads, ``diagnosis.json`` beside them): the main row whose runs kept them
  (:attr:`Study.kept`, ``runs/main/kept``), or, in a study made before it, ``<study>/runs/onemodel/seed-<s>/fixed``;
- ``<study>/runs/onemodel/seed-<s>/remedies``: the remedies, FLOP-matched as every other row: consolidation
  (``parallelism.consolidate`` = f: the last f of the budget trains the assembled model), with distillation
  (``parallelism.distill_alpha``), and assembly calibration (``parallelism.calibrate_steps``);
- ``<study>/runs/onemodel/peaks``: one short run per mechanism with the live-tensor tracker, placed so that every
  phase it has runs inside it (phase 1, the consolidation phase, calibration): each phase's peak, which does not
  depend on f (the same model state and step) nor on the number of calibration steps.

Each remedy's assembled model is paired by seed with the main sweep's DDP runs (same seeds, data and initial
weights; 95 % Student t, :func:`sdp.report.stats.paired_difference`). The target (issue 39, the same as issue 28's:
:data:`sdp.bench.remedies.MOONSHOT_NATS`, :data:`~sdp.bench.remedies.MOONSHOT_PEAK`) is met when the upper 95 % end
is at most +0.03 nats AND every phase's peak is at most 0.60x DDP's training peak AND the evaluated model costs
DDP's inference FLOPs. Beside the target, what a user could run instead at the same memory: each assembled model
minus the dense model of a worker's depth (DDP at the blocks a worker holds, FLOP-matched; :meth:`OneModel.small_dense`), paired
by seed, and DDP+AC's measured peak (:func:`context_lines`). Nothing is written without ``runs/onemodel``, so a study
without it renders as before.

Consolidation + calibration is not run (a row would appear here if a run set both keys): as built, the driver refuses
the pair before any rank starts (``sdp.parallel.sdp_config.consolidation_rules``): calibration gates the assembled
subnetworks of a forward-masked run, while after the consolidation switch every rank trains the full model.
"""

from __future__ import annotations

from pathlib import Path

from sdp.bench import diagnosis_verdict as D
from sdp.bench.baseline_verdicts import small_dense
from sdp.bench.depth_mismatch import consolidation, depth_lines, world_averaged
from sdp.bench.one_model_scale import context_line
from sdp.bench.remedies import MOONSHOT_NATS, MOONSHOT_PEAK, _collect
from sdp.bench.study_report import Row, Study, fmt, interval, markdown_table, pm, row_name, write_csv
from sdp.report.runs import Run, _max_over_ranks, find_runs
from sdp.report.stats import Paired, paired_difference, ratio, seeds_needed

ONEMODEL, PEAKS = "onemodel", "peaks"  # runs/onemodel and its peak runs (sdp.bench.cpu_study writes them there)
FIXED = "fixed plan"
# (column, summary.json memory key) of each training phase: phase 1 is the run's ``train`` phase (the measured
# steps before a consolidation switch), the later ones are reported only where they ran (sdp.metrics.memory)
PHASES = (("phase 1", "train_peak_bytes"), ("consolidation", "consolidate_peak_bytes"),
          ("calibration", "calibrate_peak_bytes"))
FLOP_TOLERANCE = 1e-9  # the assembled model's inference FLOPs equal DDP's when counted on the same architecture


def remedy(run: Run) -> tuple[float | None, float, int]:
    """(consolidate f or None, distillation alpha, calibration steps) of a run's config: what sets a remedy apart.
    ``or``: runs recorded before a key existed read as off."""
    cons = consolidation(run)
    return (None if cons is None else cons[0], float(run.flat.get("parallelism.distill_alpha") or 0),
            int(run.flat.get("parallelism.calibrate_steps") or 0))


def label(run: Run) -> str:
    """The table's name of a run's remedy: ``fixed plan`` or its parts, e.g. ``consolidate f=0.2 + distill α=0.5``,
    ``consolidate f=1 + LayerDrop p=0.5`` (``consolidate_survival``), ``consolidate f=0.5 + world average``;
    a branch scale set apart from the default (``parallelism.rescale``: what consolidation's blocks are scaled by)
    follows in brackets, e.g. ``consolidate f=1 (rescale=train)``."""
    f, alpha, cal = remedy(run)
    parts = ([] if f is None else [f"consolidate f={f:g}"]) + ([f"distill α={alpha:g}"] if alpha else [])
    q = cons[1] if (cons := consolidation(run)) else 1.0  # consolidation's LayerDrop survival
    parts += ([f"LayerDrop p={q:g}"] if q < 1 else []) + (["world average"] if world_averaged(run) else [])
    parts += [f"calibrate {cal} steps"] if cal else []
    rescale = run.flat.get("parallelism.rescale")
    return (" + ".join(parts) or FIXED) + (f" (rescale={rescale})" if rescale not in (None, "auto") else "")


def mechanism(run: Run) -> tuple[bool, bool, bool, bool]:
    """Which phases a run has (consolidation, a distillation teacher beside it, calibration) and whether consolidation
    averages over the world (every gradient computed, each freed once reduced): the key that matches a remedy to its peak run, whatever its f or its calibration steps (neither changes a phase's peak), or its
    consolidation survival q: a rank runs all n blocks at a step with probability q^n, so over a run's S steps its
    peak is the peak without drops unless (1 - q^n)^S is not small (q = 0.5, n = 8: 1/256 per step, ~53 of 13693)."""
    f, alpha, cal = remedy(run)
    return f is not None, alpha > 0, cal > 0, world_averaged(run)  # world averaging: every gradient, freed as reduced


def phases(run: Run) -> list[tuple[str, str]]:
    """The (column, memory key) of every training phase the run's remedy has (consolidation with f = 1 runs no
    step of phase 1: its column stays empty)."""
    f, _, cal = remedy(run)
    return ([PHASES[0]] if f is None or f < 1 else []) + ([PHASES[1]] if f is not None else []) + \
        ([PHASES[2]] if cal > 0 else [])


def _order(run: Run) -> tuple[bool, bool, float, float, int]:
    """The fixed plan first, then consolidation by f and alpha, then calibration (alone, then combined)."""
    f, alpha, cal = remedy(run)
    return (f is not None or cal > 0, cal > 0, -1.0 if f is None else f, alpha, cal)


class OneModel:
    """The remedy rows of one study against its DDP rows, every figure computed once."""

    def __init__(self, *, study: Study) -> None:
        self.st = study
        base = study.dir / "runs" / ONEMODEL
        quality = [r for r in find_runs(base) if PEAKS not in Path(r.path).relative_to(base).parts]
        rows = _collect(quality, key=label)
        kept = study.kept_of(quality) if quality else study.kept  # the remedies' own row; no remedy run yet: kept
        if FIXED not in rows and kept is not None:  # the reference: the main row's own runs, not a re-run
            rows[FIXED] = study.rows[kept]
        self.rows: dict[str, Row] = dict(sorted(rows.items(), key=lambda kv: _order(self.first(kv[1]))))
        peaks = find_runs(base / PEAKS) if (base / PEAKS).is_dir() else []
        self.peaks = {mechanism(r): r for r in peaks if r.ok}

    @staticmethod
    def first(row: Row) -> Run:
        return row.runs[min(row.runs)]

    def small_dense(self) -> str | None:
        """The study's DDP row at one worker's depth (:func:`sdp.bench.baseline_verdicts.small_dense`, the blocks a
        worker of the remedies' row holds as planned): what a user gets at SDP's phase-1 peak without SDP."""
        return small_dense(self.st, self.first(next(iter(self.rows.values())))) if self.rows else None

    def backward_masked(self) -> str | None:
        """The main table's backward-masked row at the remedies' level, coverage, depth and budget, without AC or a
        remedy (B_β-SDP C = 0.5): consolidation from the first step without its recomputation, so the mark of what
        consolidating into one model can reach; None where the study has no such row."""
        if not self.rows:
            return None
        ref = self.first(next(iter(self.rows.values()))).flat
        same = ("parallelism.level", "parallelism.coverage", "model.n_layers", "train.budget")

        def match(run: Run) -> bool:
            f = run.flat
            return (f.get("parallelism.masking") == "backward" and all(f.get(k) == ref.get(k) for k in same)
                    and f.get("train.ac") in (None, "none") and not any(mechanism(run)))
        return next((name for name, row in self.st.rows.items() if match(self.first(row))), None)

    def paired_to(self, name: str, other: str | None) -> Paired:
        """The assembled model minus the main table's row ``other``, paired by seed (no pair without that row)."""
        return (Paired(None, None, 0) if other is None
                else paired_difference(self.rows[name].values("eval_loss"), self.st.rows[other].values("eval_loss")))

    def paired_small(self, name: str) -> Paired:
        """The assembled model minus the dense model of a worker's depth, paired by seed."""
        return self.paired_to(name, self.small_dense())

    def paired(self, name: str) -> Paired:
        """The assembled (evaluated) model minus DDP's, paired by seed with the main sweep's DDP runs."""
        return paired_difference(self.rows[name].values("eval_loss"), self.st.ddp.values("eval_loss"))

    def peak_ratios(self, name: str) -> dict[str, float | None]:
        """Each phase's measured training peak (fullest rank) over DDP's (runs/peaks): the fixed plan's phase 1 is
        the main study's B-SDP C = 0.5 peak run, a remedy's every phase its mechanism's run in runs/onemodel/peaks."""
        ddp_row, run = self.st.peaks.get("DDP"), self.first(self.rows[name])
        ddp = None if ddp_row is None else ddp_row.mean_std("train_peak_bytes")[0]
        if not any(mechanism(run)):
            row = self.st.peaks.get("B-SDP C=0.5")
            return {PHASES[0][0]: ratio(None if row is None else row.mean_std("train_peak_bytes")[0], ddp)}
        peak_run = self.peaks.get(mechanism(run))
        return {col: ratio(None if peak_run is None else _max_over_ranks(peak_run.summary.memory_per_rank, key), ddp)
                for col, key in phases(run)}

    def inference(self, name: str) -> float | None:
        """The evaluated model's FLOPs per sample over DDP's, from each summary's model FLOP count
        (``budget.flops_per_sample``: the full architecture's, which the assembled model runs once)."""
        per = lambda row: [(r.summary.budget or {}).get("flops_per_sample") for r in row.runs.values()]  # noqa: E731
        mine, ddp = [v for v in per(self.rows[name]) if v], [v for v in per(self.st.ddp) if v]
        return ratio(max(mine), min(ddp)) if mine and ddp else None

    def misses(self, name: str) -> list[str]:
        """Every part of the target the row misses (empty: target met), each with its figure."""
        p, out = self.paired(name), []
        if p.mean is None:
            out.append("no run paired with DDP by seed")
        elif p.half_width is None:
            out.append(f"quality: one seed ({p.mean:+.3f} nats), no interval")
        elif p.mean + p.half_width > MOONSHOT_NATS:  # and whether more seeds could meet it, if the mean held
            more = ("its mean is above it: at that mean no number of seeds would meet it" if p.mean >= MOONSHOT_NATS else
                    f"{seeds_needed(p, MOONSHOT_NATS - p.mean)} seeds would at the observed spread, if the mean held")
            out.append(f"quality: upper 95 % end {p.mean + p.half_width:+.3f} > +{MOONSHOT_NATS} nats ({more})")
        for col, value in self.peak_ratios(name).items():
            if value is None:
                out.append(f"{col} peak not measured")
            elif value > MOONSHOT_PEAK:
                out.append(f"{col} peak {value:.3f}x > {MOONSHOT_PEAK:.2f}x DDP's")
        cost = self.inference(name)
        if cost is None or cost > 1 + FLOP_TOLERANCE:
            out.append(f"inference FLOPs {fmt(cost, '.2f')}x DDP's (target 1.00x)")
        return out

    def depth_rows(self) -> list[tuple[str, Row]]:
        """The consolidation rows the depth table sets beside the drop baselines (by their main-table name, e.g.
        ``B-SDP C=0.5 rescale=none consolidate=1 survival=0.5``): consolidation alone, with or without its drops,
        averaged over the holders or the world, not those a distillation or a calibration sets apart."""
        return [(row_name(self.first(row)), row) for row in self.rows.values()
                if (m := mechanism(self.first(row)))[0] and not (m[1] or m[2])]

    def records(self) -> list[dict[str, str]]:
        out = []
        for name, row in self.rows.items():
            p, peaks = self.paired(name), self.peak_ratios(name)
            misses = self.misses(name)
            out.append({"remedy (B-SDP C=0.5)": name + (" (reference)" if name == FIXED else ""),
                        "seeds": ",".join(map(str, sorted(row.runs))), "pairs with DDP": str(p.n),
                        "assembled − DDP": interval(p),
                        "upper 95 % end": "–" if p.mean is None or p.half_width is None else f"{p.mean + p.half_width:+.3f}",
                        "assembled − dense at a worker's depth": interval(self.paired_small(name)),
                        "assembled − B_β-SDP": interval(self.paired_to(name, self.backward_masked())),
                        **{f"{col} peak x DDP": fmt(peaks[col]) if col in peaks else "n/a" for col, _ in PHASES},
                        "inference FLOPs x DDP": fmt(self.inference(name), ".2f"),
                        "target": "met" if not misses else "not met"})
        return out


def diagnosis_lines(*, study: Study) -> tuple[list[str], list[str]]:
    """(The diagnosis section of the runs' ``diagnosis.json`` files (:mod:`sdp.bench.diagnosis_verdict`), the
    explanations each supports); empty where no run was diagnosed (``sdp-bench diagnose RUN_DIR``)."""
    diags = D.read_all(study.dir / "runs")  # wherever the diagnosed runs live (runs/main/kept, runs/onemodel)
    return D.section(diags), [f"seed {d['seed']}: " + (", ".join(D.verdict(d)["explanations"]) or "neither explanation")
                              for d in diags]


def verdict_lines(*, one: OneModel, explanations: list[str]) -> list[str]:
    """One line per row (met, or which parts missed with their figures) and the study's one-line verdict."""
    out, met = [], []
    for name in one.rows:
        misses = one.misses(name)
        met += [] if misses else [name]
        out.append(f"- {name}: " + ("target met" if not misses else f"not met ({'; '.join(misses)})"))
    why = "" if not explanations else (" Diagnosis of the fixed plan's assembly gap, per diagnosed run: "
                                       + "; ".join(explanations) + ".")
    remedies = [n for n in one.rows if n != FIXED]
    line = (f"**Verdict: target met** by {', '.join(met)}." if [n for n in met if n != FIXED]
            else f"**Verdict: not met** by any of the {len(remedies)} remedies run.{why}")
    return [*out, "", line, "", *context_lines(one=one)]


def context_lines(*, one: OneModel) -> list[str]:
    """The same-memory alternatives the verdict is read against (no remedy of SDP: what a user could run instead):
    the dense model of a worker's depth (the table's column against it) and DDP with activation checkpointing,
    whose loss is DDP's by construction (AC recomputes, bit for bit: tests/test_ac.py) at its measured peak."""
    small, peak = one.small_dense(), lambda name: fmt(one.st.ratio(name, "train_peak_bytes", source="peaks"))  # noqa: E731
    parts = [] if small is None else [f"{small}: eval loss {pm(*one.st.rows[small].mean_std('eval_loss'))} (mean ± sd), "
                                      f"training peak {peak(small)}x DDP's"]
    if "DDP+AC" in one.st.peaks:
        parts.append(f"DDP+AC: DDP's model and loss, training peak {peak('DDP+AC')}x DDP's")
    out = [] if not parts else ["Same-memory alternatives, not remedies (measured peaks: runs/peaks): " + "; ".join(parts) + "."]
    out += ["", *scale] if (scale := context_line(results_root=one.st.dir.parent.parent)) else []
    bb = one.backward_masked()
    if bb is not None:  # the table's column against it: what consolidation's own mechanism reaches over the budget
        ddp = one.st.paired(bb)
        out += ["", f"The mark consolidation is read against (one model, but over the peak target: backward masking "
                    f"without AC's recomputation, the whole budget): {bb}: eval loss "
                    f"{pm(*one.st.rows[bb].mean_std('eval_loss'))} (mean ± sd), − DDP {interval(ddp)}, training peak "
                    f"{peak(bb)}x DDP's."]
    return out


def one_model_section(*, study: Study) -> list[str]:
    """The markdown lines of the section (none without ``runs/onemodel``); writes ``one_model.csv``."""
    if not (study.dir / "runs" / ONEMODEL).is_dir():
        return []
    one = OneModel(study=study)
    if not one.rows:
        return []
    records = one.records()
    write_csv(study.dir / "one_model.csv", records)
    diagnosis, explanations = diagnosis_lines(study=study)
    return ["## One model at DDP's quality (issue 39)", "",
            f"Target: the assembled (one) model's eval loss − DDP's, upper 95 % end ≤ +{MOONSHOT_NATS} nats (paired by "
            f"seed with the main sweep's DDP runs, Student t), the training peak of every phase ≤ {MOONSHOT_PEAK:.2f}x "
            "DDP's, inference at DDP's FLOPs. B-SDP C = 0.5, FLOP-matched (every extra forward and recomputation "
            "charged). Peaks: measured (live-tensor tracker, fullest rank) in one short run per mechanism "
            "(runs/onemodel/peaks: the consolidation switch inside the run, calibration after it); the fixed plan's "
            "from runs/peaks; 'n/a' = the remedy has no such phase. sdp-plan's predicted peaks are not recorded in "
            "summary.json: `sdp-plan` with a run's overrides prints them. Inference FLOPs: the evaluated model's FLOP "
            "count per sample (summary.json budget.flops_per_sample) over DDP's. Against B_β-SDP: the main table's "
            "backward-masked row (consolidation's mechanism over the whole budget, without AC), paired by seed.", "",
            markdown_table(records), "", *verdict_lines(one=one, explanations=explanations), "",
            *depth_lines(study=study, also=one.depth_rows()),
            *diagnosis]
