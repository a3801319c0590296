"""The depth table of the one-model section (issue 39's diagnosis): the full model, evaluated after training that
ran fewer of its blocks per step, against DDP.

Why: block-level SDP's assembled model runs all n blocks, while each worker trained chains of k = n x C of them; the
drop baselines evaluate the full model too after training that skipped blocks. Set side by side, the rows separate
how often the chains were re-composed (never: SDP's fixed plan; every R steps: its re-draws; every step, per rank:
the drop baselines), how many blocks a training step ran (exactly k, or a depth that varies per step: LayerDrop's
Binomial(n, p)), how kept branches were scaled and over how many ranks a block's gradient was averaged (SDP: a
block's holders; DDP and the drop baselines: all), so the report shows which of these the full model's quality
follows: what a remedy for the assembly gap has to reproduce. Consolidation (issue 39's remedy: the assembled model
trained over the last share of the budget, with LayerDrop's draws inside or without) is set among them, and its run
at C = 1 (every block averaged over all ranks) tells the holders' share apart. Read from the rows the report already
has (the main table's drop, backward-masked and consolidated rows, the remedies section's fixed plan and re-draw
rows, the one-model section's consolidation rows), paired by seed with DDP as there; an SDP row's k / n is its
plan's, the realised coverage the run recorded (``summary.json`` ``coverage.fraction``), not re-derived from the
coverage asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

from sdp.bench.remedies import period, remedies_of
from sdp.bench.study_report import Row, Study, interval, markdown_table
from sdp.report.runs import Run
from sdp.report.stats import paired_difference

DROPS = ("ddp_layerdrop", "ddp_stochastic_depth")  # parallelism.name of the drop baselines


def consolidation(run: Run) -> tuple[float, float] | None:
    """(consolidate f, its survival q) of an SDP run with consolidation; None without (``or``: older runs). The one
    reader of the two keys here and in the one-model section (:func:`sdp.bench.one_model.remedy`)."""
    f = run.flat.get("parallelism.consolidate")
    return None if f in (None, "null") else (float(f), float(run.flat.get("parallelism.consolidate_survival") or 1.0))


def blocks_per_step(run: Run) -> str:
    """How many of the model's blocks one training step of one rank ran, from the run's resolved config; a
    consolidated run names its phases (its last share f trains the assembled model, with LayerDrop's draws inside
    when its survival q < 1)."""
    f = run.flat
    n = int(f["model.n_layers"])
    if f.get("parallelism.name") in DROPS:
        p = float(f["parallelism.survival_prob"])
        if f.get("parallelism.depth") == "exact":
            return f"exactly {round(p * n)} of {n}"
        if f.get("parallelism.decay") == "linear":
            return f"each block with 1 - (l+1)/{n} x {1 - p:g}: varies per step"
        return _binomial(n, p)
    if _backward(run):
        return f"all {n} (backward masking: the full model's forward)"
    own = f"exactly {round(_realised(run) * n)} of {n} (a worker's subnetwork)"
    if (cons := consolidation(run)) is None:
        return own
    share, q = cons
    assembled = "the assembled model, " + (_binomial(n, q) if q < 1 else f"all {n}")
    return assembled if share >= 1 else f"{own}, then {assembled} (the last {share:g} of the budget)"


def _backward(run: Run) -> bool:
    """A block-level SDP run with backward masking (B_β-SDP): every rank runs the whole model, holds k / n of it."""
    return run.flat.get("parallelism.masking") == "backward" and run.flat.get("parallelism.level") == "block"


def _binomial(n: int, p: float) -> str:
    return f"Binomial({n}, {p:g}): {p * n:g} of {n} on average, varies per step"


def _realised(run: Run) -> float:
    """An SDP run's k / n (block level: the share of blocks a worker holds), as its plan realised it."""
    return float(run.summary.coverage["fraction"])


def branch_scales(run: Run) -> str:
    """What a kept residual branch is multiplied by in training; at evaluation (the drop baselines' ``rescale`` flag,
    SDP's resolved ``strategy_info.rescale``), with its value at the run's p or k / n. Consolidation trains the
    assembled model at the evaluation's scale (sdp.parallel.sdp_consolidate), after phase 1's."""
    f = run.flat
    if f.get("parallelism.name") in DROPS:
        p = float(f["parallelism.survival_prob"])
        return f"1/p = {1 / p:g}; 1" if str(f.get("parallelism.rescale")) in ("True", "true") else "1; 1"
    c = _realised(run)
    rule = str((run.summary.strategy_info or {}).get("rescale", f.get("parallelism.rescale")))
    train, evaluate = {"eval": ("1", f"k/n = {c:g}"), "train": (f"n/k = {1 / c:g}", "1")}.get(rule, ("1", "1"))
    if (cons := consolidation(run)) is None:
        return f"{train}; {evaluate}"
    return f"{evaluate}; {evaluate}" if cons[0] >= 1 else f"{train}, then {evaluate}; {evaluate}"


def recomposed(run: Run) -> str:
    """How often the chains of blocks a rank runs change."""
    if run.flat.get("parallelism.name") in DROPS:
        return "every step, each rank its own draw"
    if _backward(run):
        return "never (the full model)"
    if (cons := consolidation(run)) is not None:
        later = "every step, each rank its own draw" if cons[1] < 1 else "never (the assembled model)"
        return later if cons[0] >= 1 else f"never (fixed plan), then {later}"
    every = period(run)
    return "never (fixed plan)" if every is None else f"every {every} steps ({run.flat.get('parallelism.redraw')})"


def world_averaged(run: Run) -> bool:
    """Whether a consolidated run averaged each block's gradient over all ranks in consolidation
    (``parallelism.consolidate_average=world``: :mod:`sdp.subnet.world_sync`; older runs: its holders)."""
    return consolidation(run) is not None and run.flat.get("parallelism.consolidate_average") == "world"


def averaged_over(run: Run) -> str:
    """Over how many ranks a block's gradient is averaged per step: all of them (DDP's reducer; SDP where every rank
    holds every block) or a block's k holders (SDP: a block learns from k / n of the global batch); a consolidation
    averaged over the world names its phases."""
    world = int(run.summary.world_size)
    k = None if run.flat.get("parallelism.name") in DROPS else (run.summary.strategy_info or {}).get("plan", {}).get("k")
    holders = f"all {world} ranks" if k is None or int(k) == world else f"its {k} holders of {world} ranks"
    if not world_averaged(run) or holders.startswith("all"):
        return holders
    return f"all {world} ranks" if consolidation(run)[0] >= 1 else f"{holders}, then all {world} ranks"  # type: ignore[index]


def depth_rows(*, study: Study, also: Sequence[tuple[str, Row]] = ()) -> list[tuple[str, Row]]:
    """(name, row): the main table's drop, backward-masked and consolidated rows, the remedies section's fixed plan
    and re-draw rows, then ``also`` (the one-model section's consolidation rows, which its own module collects)."""
    out = [(name, row) for name, row in study.rows.items()
           if (run := next(iter(row.runs.values()))).flat.get("parallelism.name") in DROPS or consolidation(run)
           or _backward(run)]
    if (study.dir / "runs" / "remedies").is_dir():
        rem = remedies_of(study=study)
        out += [(name, rem.rows[name]) for name in rem.rows]
    return out + list(also)


def depth_lines(*, study: Study, also: Sequence[tuple[str, Row]] = ()) -> list[str]:
    """The table (none when the study has no drop, consolidated or re-draw row)."""
    rows = depth_rows(study=study, also=also)
    if not rows:
        return []
    records = []
    for name, row in rows:
        run = next(iter(row.runs.values()))
        records.append({"row": name, "blocks a training step ran": blocks_per_step(run), "chains re-composed": recomposed(run),
                        "branch scale (training; evaluation)": branch_scales(run),
                        "a block's gradient averaged over": averaged_over(run),
                        "full model − DDP": interval(paired_difference(row.values("eval_loss"), study.ddp.values("eval_loss"))),
                        "seeds": ",".join(map(str, sorted(row.runs)))})
    return ["Depth in training against depth at evaluation (every row evaluates the full model; the drop, "
            "backward-masked and consolidated rows from the main table, SDP's fixed plan and re-draws from the "
            "remedies section, consolidation from this section, paired by seed with DDP):", "", markdown_table(records), ""]
