"""The depth table of the one-model section (issue 39's diagnosis): the full model, evaluated after training that
ran fewer of its blocks per step, against DDP.

Why: block-level SDP's assembled model runs all n blocks, while each worker trained chains of k = n x C of them; the
drop baselines evaluate the full model too after training that skipped blocks. Set side by side, the rows separate
how often the chains were re-composed (never: SDP's fixed plan; every R steps: its re-draws; every step, per rank:
the drop baselines), how many blocks a training step ran (exactly k, or a depth that varies per step: LayerDrop's
Binomial(n, p)) and how kept branches were scaled, so the report shows which of these the full model's quality
follows: what a remedy for the assembly gap has to reproduce. Read from the rows the report already has (the main
table's drop rows, the remedies section's re-draw rows, its fixed plan), paired by seed with DDP as there; an SDP
row's k / n is its plan's, the realised coverage the run recorded (``summary.json`` ``coverage.fraction``), not
re-derived from the coverage asked for.
"""

from __future__ import annotations

from sdp.bench.remedies import Remedies, period
from sdp.bench.study_report import Row, Study, interval, markdown_table
from sdp.report.runs import Run
from sdp.report.stats import paired_difference

DROPS = ("ddp_layerdrop", "ddp_stochastic_depth")  # parallelism.name of the drop baselines


def blocks_per_step(run: Run) -> str:
    """How many of the model's blocks one training step of one rank ran, from the run's resolved config."""
    f = run.flat
    n = int(f["model.n_layers"])
    if f.get("parallelism.name") in DROPS:
        p = float(f["parallelism.survival_prob"])
        if f.get("parallelism.depth") == "exact":
            return f"exactly {round(p * n)} of {n}"
        if f.get("parallelism.decay") == "linear":
            return f"each block with 1 - (l+1)/{n} x {1 - p:g}: varies per step"
        return f"Binomial({n}, {p:g}): {p * n:g} of {n} on average, varies per step"
    return f"exactly {round(_realised(run) * n)} of {n} (a worker's subnetwork)"


def _realised(run: Run) -> float:
    """An SDP run's k / n (block level: the share of blocks a worker holds), as its plan realised it."""
    return float(run.summary.coverage["fraction"])


def branch_scales(run: Run) -> str:
    """What a kept residual branch is multiplied by in training; at evaluation (the drop baselines' ``rescale`` flag,
    SDP's resolved ``strategy_info.rescale``), with its value at the run's p or k / n."""
    f = run.flat
    if f.get("parallelism.name") in DROPS:
        p = float(f["parallelism.survival_prob"])
        return f"1/p = {1 / p:g}; 1" if str(f.get("parallelism.rescale")) in ("True", "true") else "1; 1"
    c = _realised(run)
    rule = str((run.summary.strategy_info or {}).get("rescale", f.get("parallelism.rescale")))
    return {"eval": f"1; k/n = {c:g}", "train": f"n/k = {1 / c:g}; 1"}.get(rule, "1; 1")


def recomposed(run: Run) -> str:
    """How often the chains of blocks a rank runs change."""
    if run.flat.get("parallelism.name") in DROPS:
        return "every step, each rank its own draw"
    every = period(run)
    return "never (fixed plan)" if every is None else f"every {every} steps ({run.flat.get('parallelism.redraw')})"


def depth_rows(*, study: Study) -> list[tuple[str, Row]]:
    """(name, row): the main table's drop rows, then the remedies section's fixed plan and re-draw rows."""
    out = [(name, row) for name, row in study.rows.items()
           if next(iter(row.runs.values())).flat.get("parallelism.name") in DROPS]
    if (study.dir / "runs" / "remedies").is_dir():
        rem = Remedies(study=study)
        out += [(name, rem.rows[name]) for name in rem.rows]
    return out


def depth_lines(*, study: Study) -> list[str]:
    """The table (none when the study has no drop or re-draw row)."""
    rows = depth_rows(study=study)
    if not rows:
        return []
    records = []
    for name, row in rows:
        run = next(iter(row.runs.values()))
        records.append({"row": name, "blocks a training step ran": blocks_per_step(run), "chains re-composed": recomposed(run),
                        "branch scale (training; evaluation)": branch_scales(run),
                        "full model − DDP": interval(paired_difference(row.values("eval_loss"), study.ddp.values("eval_loss"))),
                        "seeds": ",".join(map(str, sorted(row.runs)))})
    return ["Depth in training against depth at evaluation (every row evaluates the full model; the drop rows from the "
            "main table, SDP's from the remedies section, paired by seed with DDP):", "", markdown_table(records), ""]
