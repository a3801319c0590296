"""Issue 38's verdicts against the baselines a reviewer asks for, in a CPU study's report: SDP read per resource
against what a user could run instead, each comparison paired by seed (same data, initial weights and FLOP budget).

Why a section of its own: the parity verdicts compare every method with DDP, which spends more memory and traffic
than SDP; a reviewer's question is whether SDP buys its saving more cheaply than the field's answers to the same
constraint. Two kinds of alternative, each from the study's own runs:

- **the small dense model at one worker's depth** (DDP on the blocks a block-level worker holds, FLOP-matched to
  the full model: :func:`small_dense`): the same training peak without SDP, so SDP's assembled model, its workers'
  own subnetworks and their ensemble are each paired with it;
- **the memory and traffic baselines** (activation checkpointing on DDP and FSDP, local SGD, DiLoCo, PowerSGD:
  :data:`BASELINES`, rows of the main table where they were run): each one's measured training peak and wire bytes
  per token beside B-SDP C = 0.5's, and B-SDP C = 0.5 minus it. A baseline that is another row's method with
  activation checkpointing on and has no main runs of its own takes that row's losses and wire bytes by
  construction (:func:`loss_twin`): checkpointing recomputes the same forward, so every loss is unchanged bit for
  bit (tests/test_ac.py) and the collectives are the base's; main runs of it would re-measure the base's figures.

The closing lines name, per resource, the methods that spend no more than B-SDP C = 0.5 (within
:data:`SAME_WITHIN`, the grain of a measured peak) and are resolved better in quality: the methods that dominate it
on that axis. Last, the FSDP check (:func:`fsdp_lines`): FSDP (or FSDP+AC) against DDP of the same seed. Nothing
here is a new measurement: peaks come from ``runs/peaks``, bytes from the main runs
(:func:`sdp.bench.frontier.frontier_points`), losses from the main table's runs.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from sdp.bench.frontier import frontier_points, traffic_unit
from sdp.bench.study_report import Study, verdict
from sdp.parallel.job import ac_every
from sdp.report.runs import Run, run_figures
from sdp.results.contract import read_metrics

HEADLINE = "B-SDP C=0.5"
BASELINES = ("DDP+AC", "FSDP+AC", "LocalSGD", "DiLoCo", "PowerSGD")  # row-name prefixes (H, r follow in the name)
AC_KEYS = ("train.ac", "train.ac_every", "parallelism.ac_every")  # what turns checkpointing on (sdp.parallel.job.ac_every)
SAME_WITHIN = 0.01  # a resource within 1 % of the headline's counts as the same spend (peaks differ by bytes)


def block_plan(run: Run) -> dict[str, Any]:
    """A block-level SDP run's recorded plan (units, k holders per unit, world_size); empty otherwise."""
    plan = ((run.summary.strategy_info or {}).get("plan") or {}) if run.summary is not None else {}
    return plan if plan.get("level") == "block" else {}


def worker_depth(run: Run) -> int | None:
    """The blocks one worker of a block-level SDP run holds, from its recorded plan (units x k / n); None for
    another level or a run without a plan."""
    plan = block_plan(run)
    return round(plan["units"] * plan["k"] / plan["world_size"]) if plan else None


def ensemble_cost(run: Run) -> str:
    """What the workers' ensemble runs at inference: every worker's subnetwork (n of them, units x k / n blocks
    each), so k times the blocks of the assembled model (embedding and head once per worker besides)."""
    plan = block_plan(run)
    return (f"{plan['world_size']} subnetworks of {worker_depth(run)} blocks: {plan['k']}x the assembled "
            f"model's blocks at inference") if plan else "every worker's subnetwork at inference"


def small_dense(st: Study, run: Run) -> str | None:
    """The study's DDP row at ``run``'s worker depth (:func:`worker_depth`), FLOP-matched to the full model (the
    gate's DDP-4 for B-SDP C = 0.5 of 8 blocks): what a user trains at SDP's peak without SDP; None without one."""
    depth = worker_depth(run)
    if depth is None:
        return None
    return next((name for name, row in st.rows.items() if name.startswith("DDP ")
                 and int(row.runs[min(row.runs)].flat.get("model.n_layers", 0)) == depth), None)


def _peak(st: Study, name: str) -> str:
    p = st.ratio(name, "train_peak_bytes", source="peaks")
    return "peak not measured" if p is None else f"peak {p:.3f}x"


def dense_lines(st: Study, *, unit: str) -> list[str]:
    """Each block-level SDP row against the small dense model at its worker depth (same training peak)."""
    out = []
    for name, row in st.rows.items():
        if not name.startswith("B-SDP C=") or " " in name[len("B-SDP C="):]:
            continue  # the plain rows only (no rescale, same-iterations or remedy variants)
        first = row.runs[min(row.runs)]
        dense = small_dense(st, first)
        if dense is None:
            continue
        out.append(f"- {name} ({_peak(st, name)}) against {dense} ({_peak(st, dense)}, the dense model of one "
                   f"worker's depth):")
        out.append(f"  - {verdict(st.paired(name, reference=dense), what='assembled model − dense', unit=unit)}")
        workers = st.paired(name, "eval_loss_workers", reference=dense, ref_key="eval_loss")
        own = "workers' own subnetworks − dense"
        out.append(f"  - {verdict(workers, what=own, unit=unit)}")
        ensemble = st.paired(name, "eval_loss_ensemble", reference=dense, ref_key="eval_loss")
        if ensemble.mean is not None:
            what = f"their ensemble ({ensemble_cost(first)}) − dense"
            out.append(f"  - {verdict(ensemble, what=what, unit=unit)}")
    return out or ["- no block-level SDP row with a DDP row at its worker depth"]


def _ratio(points: dict[str, dict[str, Any]], name: str, key: str) -> float | None:
    mine, ddp = points.get(name, {}).get(key), points.get("DDP", {}).get(key)
    if key == "peak":
        return mine
    return None if mine is None or not ddp else mine / ddp


def _checkpointing(run: Run) -> bool:
    return ac_every(OmegaConf.create(run.config)) > 0  # the job's own reading of its checkpointing keys


def _without_ac(run: Run) -> dict[str, Any]:
    """``run``'s config without what turns checkpointing on (an ``*_ac`` preset's name read as its base's)."""
    flat = {k: v for k, v in run.flat.items() if k not in AC_KEYS}
    flat["parallelism.name"] = str(flat.get("parallelism.name", "")).removesuffix("_ac")
    return flat


def loss_twin(st: Study, name: str) -> str | None:
    """The main row whose losses ``name`` has by construction (module docstring): ``name`` has no main runs, its peak
    run checkpoints, and another peak run, without checkpointing, has the same config but for :data:`AC_KEYS` (and
    the preset's ``_ac`` suffix) and a main row of its name. None otherwise."""
    if name in st.rows or name not in st.peaks:
        return None
    mine = st.peaks[name].runs[min(st.peaks[name].runs)]
    if not _checkpointing(mine):
        return None
    for base, row in st.peaks.items():
        run = row.runs[min(row.runs)]
        if base != name and base in st.rows and not _checkpointing(run) and _without_ac(run) == _without_ac(mine):
            return base
    return None


def twin_points(st: Study, points: dict[str, dict[str, Any]], baselines: list[str]) -> dict[str, str]:
    """Adds to ``points`` each of ``baselines`` that has a :func:`loss_twin` (its twin's quality and wire bytes, its
    own measured peak; no predicted time: its recomputation is not in the twin's runs); returns {baseline: twin}."""
    twins = {n: t for n in baselines if (t := loss_twin(st, n)) is not None and t in points}
    for name, twin in twins.items():
        points[name] = {**points[twin], "peak": st.ratio(name, "train_peak_bytes", source="peaks"),
                        **{k: None for k in points[twin] if k.startswith("time_")}}
    return twins


def baseline_rows(st: Study) -> list[str]:
    """The baselines' names, as rows of the main table or, not run yet, of the peak runs."""
    names = [*st.rows, *(n for n in st.peaks if n not in st.rows)]
    return [n for n in names if n.startswith(BASELINES)]


def dominance_lines(st: Study, points: dict[str, dict[str, Any]], *, unit: str, per: str,
                    twins: dict[str, str] | None = None) -> list[str]:
    """Per resource, the rows that spend no more than the headline (within SAME_WITHIN) and are resolved better;
    a baseline in ``twins`` is paired through its twin's runs. ``per``: what the wire bytes are per
    (:func:`traffic_unit`, computed once by the section)."""
    twins = twins or {}
    out = []
    for key, what in (("peak", "training peak"), ("wire_per_token", f"wire bytes per {per}")):
        mine = _ratio(points, HEADLINE, key)
        if mine is None:
            continue
        better = []
        for name in points:
            theirs, p = _ratio(points, name, key), st.paired(twins.get(name, name), reference=HEADLINE)
            if name != HEADLINE and theirs is not None and theirs <= mine * (1 + SAME_WITHIN) and p.resolved and p.mean < 0:
                better.append(f"{name} ({theirs:.3f}x DDP's, lower by {-p.mean:.3f} ± {p.half_width:.3f} {unit}, n = {p.n})")
        out.append(f"- at or below {HEADLINE}'s {what} ({mine:.3f}x DDP's) and resolved better than its assembled model: "
                   + ("; ".join(better) if better else "none among the rows run"))
    return out


def baseline_lines(st: Study, *, unit: str) -> list[str]:
    """The section: the small dense models, each baseline per resource, and which methods dominate B-SDP C = 0.5."""
    # a copy: twin_points adds the AC twins to this section's points, not to the frontier's (computed once per study)
    points, baselines = dict(frontier_points(st)), baseline_rows(st)
    twins, per = twin_points(st, points, baselines), traffic_unit(st)
    out = ["### Against the baselines a reviewer asks for (issue 38; FLOP-matched, paired by seed)", "",
           "Same training peak without SDP: the dense model of one worker's depth.", "", *dense_lines(st, unit=unit),
           "", f"Memory and traffic baselines (training peak: runs/peaks; wire bytes per {per}: the main runs), "
           f"each against {HEADLINE}:", ""]
    for name in baselines:
        peak, wire = st.ratio(name, "train_peak_bytes", source="peaks"), _ratio(points, name, "wire_per_token")
        spend = "; ".join([f"peak {peak:.3f}x DDP's" if peak is not None else "peak not measured",
                           f"wire bytes per {per} {wire:.3f}x DDP's" if wire is not None else "no main runs yet"])
        twin = twins.get(name)
        spend += "" if twin is None else (f"; its losses and wire bytes: {twin}'s runs, by construction (checkpointing "
                                          "changes no loss, bit for bit: tests/test_ac.py), its recomputation not charged to the budget")
        pair = st.paired(HEADLINE, reference=twin or name)
        out.append(f"- {name} ({spend}): {verdict(pair, what=f'{HEADLINE} − {name}', unit=unit)}")
    if not baselines:
        out.append(f"- no baseline row (looked for names starting {', '.join(BASELINES)})")
    return [*out, "", "Which methods dominate it, per resource:", "",
            *dominance_lines(st, points, unit=unit, per=per, twins=twins)]


def fsdp_lines(st: Study, *, tol: float = 1e-6) -> list[str]:
    """FSDP is DDP with sharded state: the same seed takes the same updates, only the float summation order differs
    (reduce-scatter vs all-reduce). Training amplifies those ~1e-8 differences, so final losses of long runs differ
    by the run-to-run spread; the check therefore prints the step up to which both training losses agree to ``tol``
    and the final differences themselves, not an interval. Without FSDP runs, FSDP+AC's: checkpointing recomputes
    the same forward, FSDP's losses bit for bit (tests/test_ac.py)."""
    name = "FSDP" if "FSDP" in st.rows else "FSDP+AC"
    out = []
    for seed, run in sorted(st.rows[name].runs.items()):
        ddp = st.ddp.runs.get(seed)
        if ddp is None:
            continue
        f, d = run_figures(run.summary), run_figures(ddp.summary)
        diffs = ", ".join(f"{k} {f[k] - d[k]:+.2e} ({f[k]:.5f} vs {d[k]:.5f})" for k in ("eval_loss", "train_loss")
                          if f.get(k) is not None and d.get(k) is not None)
        out.append(f"- seed {seed}, {name} − DDP: {agreement(run, ddp, tol=tol)}; final {diffs}")
    return out or ["- no FSDP run with a DDP run of the same seed"]


def agreement(a: Run, b: Run, *, tol: float) -> str:
    """Up to which logged step two runs' training losses agree within ``tol`` (the first step they do not, if any)."""
    la = {r["step"]: r["loss"] for r in read_metrics(a.path) if r.get("loss") is not None}
    lb = {r["step"]: r["loss"] for r in read_metrics(b.path) if r.get("loss") is not None}
    steps = sorted(la.keys() & lb.keys())
    if not steps:
        return "no training loss logged at a common step"
    apart = next((s for s in steps if abs(la[s] - lb[s]) > tol), None)
    if apart is None:
        return f"training losses within {tol:.0e} at all {len(steps)} common steps"
    before = steps.index(apart)  # the common steps logged before the first that parts
    return (f"training losses within {tol:.0e} through step {steps[before - 1] if before else 0} of {steps[-1]}, first apart "
            f"at step {apart} by {la[apart] - lb[apart]:+.1e}")
