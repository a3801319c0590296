"""A study's REPORT.md: the table of :mod:`sdp.bench.study_report`, one computed verdict per claim of the paper,
and the plots. Every figure in it is read from the run directories; the wording around a figure depends
only on whether its interval is resolved and where the measured ratio falls, so re-rendering after new
runs rewrites the verdicts too.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from sdp.report.runs import Run
from sdp.bench import diagnosis_verdict as D
from sdp.bench.baseline_verdicts import baseline_lines, fsdp_lines
from sdp.bench.frontier import GPU, LINKS, frontier_lines, plot_frontier
from sdp.bench.gate import gate_section, no_gate_lines
from sdp.bench.one_model import one_model_section
from sdp.bench.remedies import remedies_section
from sdp.report.stats import TARGET_FACTOR, paired_difference, seeds_needed
from sdp.bench.study_report import (NOMINAL_RANGE, PAPER_COMMANDS, Row, Study, curve, markdown_table, mean_interval,
                                    pm, verdict, write_csv)

LM_TARGET_HW, IMAGE_TARGET_HW = 0.02, 1.5  # issue 17's interval targets (nats; accuracy points)


AC_ROWS = ("DDP+AC", "FSDP+AC", "B-SDP+AC C=0.5")  # their peak runs (runs/peaks); B-SDP+AC: conf/variant/b_sdp_c50_ac.yaml


def memory_lines(st: Study) -> list[str]:
    lo, hi = NOMINAL_RANGE
    out = []
    for name in ("B-SDP C=0.25", "B-SDP C=0.5", "B-SDP C=0.75", "B_β-SDP C=0.5", "N-SDP C=0.5"):
        peak = st.ratio(name, "train_peak_bytes", source="peaks")
        state = st.ratio(name, "model_state_bytes", source="peaks")
        if peak is None:
            continue
        where = "inside" if lo <= peak <= hi else ("below (a larger saving than)" if peak < lo else "above (less saving than)")
        out.append(f"- {name}: measured training peak {peak:.3f}x DDP's, {where} the claimed 0.40-0.72x; "
                   f"model state {state:.3f}x (by construction: follows from the plan, not a measurement of the claim).")
    ac = {name: st.ratio(name, "train_peak_bytes", source="peaks") for name in AC_ROWS}
    if any(v is not None for v in ac.values()):  # the memory baseline a reviewer asks for, with and without SDP
        out.append("- against activation checkpointing (every loss unchanged, bit for bit: tests/test_ac.py; paid in "
                   "recomputation): measured training peak " +
                   ", ".join(f"{name} {v:.3f}x" for name, v in ac.items() if v is not None) + " DDP's.")
    return out


def _gap(row: Row) -> str:
    gaps = row.present("assembly_gap")
    return f"{mean_interval(gaps)} nats (n = {len(gaps)})"


def gap_lines(st: Study, *, unit: str) -> list[str]:
    """The assembly gap (assembled eval loss minus the mean of the workers' own subnetworks) of B-SDP C = 0.5
    under each rescale rule run (the main row's ``auto`` is ``eval``), each rule against ``eval`` paired by
    seed, and, where ``runs/depth`` exists, the gap at every depth."""
    main = "B-SDP C=0.5"
    names = [n for n in st.rows if n.startswith(main) and "iterations" not in n]
    out = ["Assembly gap = the assembled model's eval loss minus the mean over workers of each worker's own "
           "subnetwork's eval loss (the model that was trained).", ""]
    unscaled = unscaled_lines(st, main=main, unit=unit)
    for name in sorted(names, key=len):
        row = st.rows[name]
        if not row.present("assembly_gap") or (unscaled and name == _unscaled(main)):  # read below, all seeds
            continue
        rule = name[len(main):].strip() or "rescale=eval (auto)"
        line = f"- {rule}: assembly gap {_gap(row)}; {verdict(st.paired(name), what='assembled − DDP', unit=unit)}"
        if row.present("eval_loss_ensemble"):  # runs that predate the ensemble say nothing of it
            line += f"; {verdict(st.paired_ensemble(name), what='ensemble − DDP', unit=unit)}"
        if name != main:
            line += f"; {verdict(st.paired(name, reference=main), what='assembled − rescale=eval', unit=unit)}"
        out.append(line)
    out += unscaled
    depths = st.gap_by_depth(main) if st.depth else {}
    if len(depths) > 1:
        out += ["", f"Gap against depth ({main}, FLOP-matched to DDP at the same depth; the 95 % t interval over seeds):", ""]
        for n_layers, row in depths.items():
            loss, workers = row.mean_std("eval_loss"), row.mean_std("eval_loss_workers")
            ensemble = row.mean_std("eval_loss_ensemble")
            both = f"workers' own {pm(*workers)}" + ("" if ensemble[0] is None else f", their ensemble {pm(*ensemble)}")
            out.append(f"- {n_layers} blocks: assembled {pm(*loss)}, {both}, gap {_gap(row)}")
        ordered = list(depths.items())  # by depth
        (low, shallow), (high, deep) = ordered[0], ordered[-1]
        trend = paired_difference(deep.values("assembly_gap"), shallow.values("assembly_gap"))  # same seed, same data
        out.append(f"- {verdict(trend, what=f'gap at {high} blocks − gap at {low} blocks (paired by seed)', unit=unit)}")
    return out if len(out) > 2 else ["- no B-SDP C=0.5 run with a subnetwork evaluation"]


def _unscaled(main: str) -> str:
    """The row name of ``main`` trained with ``parallelism.rescale=none`` (one spelling for both sections)."""
    return f"{main} rescale=none"


def unscaled_lines(st: Study, *, main: str, unit: str) -> list[str]:
    """rescale=none for every seed whose fixed-plan run kept its weights and was diagnosed. The branch scale acts at
    evaluation only, so a rescale=none run trains the fixed plan bit for bit: its assembled loss is the kept weights'
    at branch scale 1 (``sdp-bench diagnose``'s scale sweep), read there instead of trained again; a rescale=none
    run, where one was made, is printed as the check (its loss minus the kept weights', same seed)."""
    row = st.rows.get(main)
    none = D.at_scale(row.runs, scale=1.0) if row else {}
    if not none:
        return []
    workers = row.values("eval_loss_workers")
    gaps = [none[s] - workers[s] for s in none if workers.get(s) is not None]
    line = (f"- rescale=none (the fixed plan's kept final weights at branch scale 1, `sdp-bench diagnose`; its training "
            f"is the fixed plan's, the scale acting at evaluation only): assembly gap {mean_interval(gaps)} nats "
            f"(n = {len(gaps)}); {verdict(paired_difference(none, st.ddp.values('eval_loss')), what='assembled − DDP', unit=unit)}; "
            f"{verdict(paired_difference(none, row.values('eval_loss')), what='assembled − rescale=eval', unit=unit)}")
    ran = st.rows.get(_unscaled(main))
    checks = [f"seed {s} {v - none[s]:+.1e}" for s, v in sorted((ran.values("eval_loss") if ran else {}).items())
              if s in none and v is not None]
    return [line + ("" if not checks else "; its rescale=none runs' assembled loss − this: " + ", ".join(checks))]


def claims(st: Study) -> list[str]:
    """One line per claim, computed from the rows present."""
    unit, acc = "nats", st.metric is not None
    lines = ["### Memory: 28-60 % less per device (measured live-tensor training peak, fullest rank)", ""]
    lines += memory_lines(st) or ["- no peak runs"]
    lines += ["", "### Quality parity above C ≈ 0.3 (FLOP-matched, final eval loss, paired by seed)", ""]
    parity = ("B-SDP C=0.25", "B-SDP C=0.5", "B-SDP C=0.75", "B_β-SDP C=0.5", "N-SDP C=0.5")
    if not any(name in st.rows for name in parity):
        lines.append(f"- no SDP run yet (rows looked for: {', '.join(parity)})")
    for name in parity:
        if name in st.rows:  # "assembled" only where workers trained different models (forward masking)
            ensembled = st.paired_ensemble(name).mean is not None  # only rows whose runs evaluated the ensemble
            assembled = st.paired_workers(name).mean is not None or ensembled
            model = " (assembled model)" if assembled else " (the full model every worker ran)"
            lines.append(f"- {verdict(st.paired(name), what=f'{name}{model} − DDP', unit=unit)}")
            if st.paired_workers(name).mean is not None:
                own = "its workers' own subnetworks − DDP"
                lines.append(f"  - {verdict(st.paired_workers(name), what=own, unit=unit)}")
            if acc:
                lines.append(f"  - accuracy: {verdict(st.paired(name, 'eval_accuracy'), what=f'{name} − DDP', unit='points')}")
            if ensembled:
                ens = "the ensemble of its workers' subnetworks (mean probability) − DDP"
                lines.append(f"  - {verdict(st.paired_ensemble(name), what=ens, unit=unit)}")
                if acc:
                    ens_acc = st.paired_ensemble(name, "eval_accuracy")
                    lines.append(f"  - ensemble accuracy: {verdict(ens_acc, what=f'{name} ensemble − DDP', unit='points')}")
    lines += ["", "### Block vs neuron level at C = 0.5", "",
              f"- {verdict(st.paired('N-SDP C=0.5', reference='B-SDP C=0.5'), what='N-SDP − B-SDP', unit=unit)}",
              "", "### Forward vs backward masking at matched FLOPs (C = 0.5)", "",
              f"- {verdict(st.paired('B-SDP C=0.5', reference='B_β-SDP C=0.5'), what='B-SDP − B_β-SDP', unit=unit)}",
              "", "### The reviewers' stochastic-depth question (p = C = 0.5, FLOP-matched)", ""]
    for ref in ("DDP+StochDepth p=0.5", "DDP+LayerDrop p=0.5"):
        lines.append(f"- {verdict(st.paired('B-SDP C=0.5', reference=ref), what=f'B-SDP C=0.5 − {ref}', unit=unit)}")
    lines += ["", "### The reviewers' same-iteration question (DDP's step count, so fewer FLOPs: the table's FLOPs x DDP)", ""]
    for name in ("B-SDP C=0.5 (same iterations)", "B_β-SDP C=0.5 (same iterations)"):
        lines.append(f"- {verdict(st.paired(name), what=f'{name} − DDP', unit=unit)}")
    lines += ["", *baseline_lines(st, unit=unit)]
    lines += ["", "### The assembled model vs the subnetworks that were trained (B-SDP C = 0.5)", ""]
    lines += gap_lines(st, unit=unit)
    if "FSDP" in st.rows or "FSDP+AC" in st.rows:
        head = "### Check: FSDP against DDP (the same updates; only the float summation order differs)"
        lines += ["", head, "", *fsdp_lines(st)]
    p = st.paired("B-SDP C=0.5")
    key, target = ("eval_accuracy", IMAGE_TARGET_HW) if acc else ("eval_loss", LM_TARGET_HW)
    if acc:
        p = st.paired("B-SDP C=0.5", key)
    lines += ["", "### Interval target", ""]
    if p.mean is None:
        lines.append("- no B-SDP C=0.5 run paired with DDP yet")
    for what, q in ((f"B-SDP C=0.5 − DDP ({key}, assembled model)", p),
                    ("B-SDP C=0.5 workers' own subnetworks − DDP (eval_loss)", st.paired_workers("B-SDP C=0.5"))):
        if q.mean is None:
            continue
        met = q.half_width is not None and q.half_width <= (target if q is p else LM_TARGET_HW)
        goal = target if q is p else LM_TARGET_HW
        need = "" if met or q.half_width is None else f" At the observed spread of the differences {seeds_needed(q, goal)} seeds would meet it."
        lines.append(f"- {what}: half-width {'–' if q.half_width is None else f'{q.half_width:.3f}'} against the target "
                     f"± {goal}: {'met' if met else 'NOT met'} with n = {q.n} seeds.{need}")
    lines += [
              "", "### Where this CPU scale cannot decide", "",
              "- A claim marked *not resolved* above, and every memory figure on a GPU allocator (this peak counts live "
              "CPU tensors; NCCL buffers and allocator caching are not in it), needs the paper-scale sweep:",
              f"  `{PAPER_COMMANDS[st.study]}`"]
    return lines


def plot(st: Study) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[Path] = []

    def save(fig, ax, *, xlabel: str, ylabel: str, title: str, name: str) -> None:  # type: ignore[no-untyped-def]
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(st.dir / name, dpi=110)
        plt.close(fig)
        files.append(st.dir / name)

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, row in st.rows.items():
        curves = []
        for seed, run in sorted(row.runs.items()):
            ddp = st.ddp.runs.get(seed) or next(iter(st.ddp.runs.values()))
            curves.append(curve(run, ddp_flops=ddp.summary.budget["total_flops"]))
        n = min(len(c) for c in curves)
        xs = [statistics.fmean(c[i][0] for c in curves) for i in range(n)]
        ys = [statistics.fmean(c[i][1] for c in curves) for i in range(n)]
        sd = [statistics.stdev([c[i][1] for c in curves]) if len(curves) > 1 else 0.0 for i in range(n)]
        (line,) = ax.plot(xs, ys, marker=".", label=name)
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.15,
                        color=line.get_color())
    save(fig, ax, xlabel="fraction of DDP's total training FLOPs", ylabel="evaluation loss (mean ± sample std over seeds)",
         title=f"CPU study: {st.study}", name="curves.png")

    files.append(plot_frontier(st, path=st.dir / "frontier.png"))
    return files


def frontier_section(st: Study) -> list[str]:
    """Quality against each resource (:mod:`sdp.bench.frontier`): the figure and the figures behind it."""
    return ["## Frontier: quality per resource", "",
            f"Every method as a point with its 95 % t interval over seeds, against the measured training peak, the "
            f"wire bytes per trained token, and the predicted training time (its steps x `sdp-plan`'s step-time "
            f"model, sdp/planning/throughput.py) on {GPU} with each of the links {', '.join(LINKS)} of "
            f"conf/hardware.yaml, at the study's own shape: the runs' counted FLOPs and measured wire bytes, so that "
            f"each point's cost comes from the runs its quality comes from (at this tiny shape a step is "
            f"microseconds on a GPU: read the order and the ratios, not the seconds; a whole run, not a step, since "
            f"FLOP matching gives some methods more steps).", "",
            "![frontier](frontier.png)", "", *frontier_lines(st), ""]


def commits_by_stage(runs: list[Run], *, root: Path) -> str:
    """``<commit> (<stage> seeds ..., ...)`` for every commit the runs were made at: which runs a commit made,
    so that a reader can re-run any of them at its own commit (``sdp-rerun``). A stage whose runs recorded a
    working tree that differed from the commit (``git_dirty``) says so."""
    found: dict[str, dict[str, set[int]]] = {}
    dirty: set[tuple[str, str]] = set()
    for r in runs:
        rel = Path(r.path).relative_to(root).parts
        stage = "/".join(rel[:2]) if rel[:2] in (("main", "seeds-3-4"), ("main", "kept")) else rel[0]
        commit = str(r.summary.versions.get("git_commit"))[:12]
        found.setdefault(commit, {}).setdefault(stage, set()).add(int(r.seed))
        if r.summary.versions.get("git_dirty"):
            dirty.add((commit, stage))

    def stage_text(c: str, st: str, seeds: set[int]) -> str:
        return f"{st} seeds {','.join(map(str, sorted(seeds)))}" + (" (tree differed from it)" if (c, st) in dirty else "")
    return " and ".join(f"{c} ({'; '.join(stage_text(c, st, s) for st, s in sorted(stages.items()))})"
                        for c, stages in sorted(found.items()))


def write_report(*, study_dir: Path, study: str, header: str = "") -> list[Path]:
    """Write REPORT.md, table.csv and the plots of one study; returns the files written."""
    st = Study(study_dir=study_dir, study=study)
    records = st.table()
    write_csv(st.dir / "table.csv", records)
    ddp = st.ddp.runs[min(st.ddp.runs)].summary
    every = [r for rows in (st.rows, st.peaks, st.timing) for row in rows.values() for r in row.runs.values()]
    every += [r for rows in st.depth.values() for row in rows.values() for r in row.runs.values()]
    gate = gate_section(study_dir=st.dir, study=study) or no_gate_lines(study=study,
                                                                        ddp_accuracy=st.ddp.mean_std("eval_accuracy")[0])
    md = [f"# CPU study: {study}", "", *gate, header,
          f"{len(st.runs)} runs ({sum(len(r.runs) for r in st.rows.values())} with results), DDP {ddp.steps} steps, "
          f"{ddp.world_size} ranks, model {ddp.model}; code at commit(s) {commits_by_stage(every, root=st.dir / 'runs')}. Every method of one seed shares the initial weights and the "
          f"data order; Δ columns are per-seed differences to DDP with the 95 % Student t interval (n − 1 d.f.); "
          f"'not resolved' = the interval contains 0. Time to target: first evaluation at or below DDP's mean final "
          f"eval loss x {TARGET_FACTOR} (mean steps over the seeds that reach it, of all seeds; seconds = those steps x "
          f"the method's step time from runs/timing). Ratios are of means on the rank where each figure is largest. "
          f"Training peak and model state come from runs/peaks (20 steps, seed 0, live-tensor tracker); step time "
          f"from runs/timing (60 steps, seed 0, median after warm-up, run with nothing else on the machine); comm "
          f"bytes from the main runs.", "",
          markdown_table(records), "", "![curves](curves.png)", "", *frontier_section(st),
          "## Verdicts, claim by claim", "", *claims(st), "", *remedies_section(study=st),
          *one_model_section(study=st)]
    (st.dir / "REPORT.md").write_text("\n".join(md))
    return [st.dir / "REPORT.md", st.dir / "table.csv", *plot(st)]


def write_index(*, out: Path) -> Path:
    """``<out>/README.md``: what each study is, the command that re-creates it, and a link to its report."""
    lines = ["# CPU studies (issue 17)", "",
             "Each study is re-created, runs and report, by one command (resumable; `--render-only` re-writes the "
             "report from the committed runs). Every figure in the reports is computed from the run directories.", ""]
    for study in sorted(p.name for p in out.iterdir() if (p / "REPORT.md").exists()):
        lines += [f"- [{study}]({study}/REPORT.md): `python benchmarks/cpu_study.py --study {study}`"]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return out / "README.md"
