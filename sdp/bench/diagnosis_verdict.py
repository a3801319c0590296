"""Which explanation of the assembly gap a diagnosis supports (:mod:`sdp.bench.diagnose`), by a rule written here,
and the markdown that states it (one run: :func:`markdown`; a study's runs: :func:`section`).

The two explanations of issue 39 and what each predicts:

- **composition mismatch**: each block was trained on the residual stream of its holders' chains and at assembly
  sees another one (the blocks before it are a different set). Then its input drifts away from its holders' (1 - cos
  grows with depth: more blocks differ before a deep block), and averaging the workers' residual updates, which keeps
  every block in the chain it was trained in, recovers most of what the ensemble recovers;
- **branch magnitude**: the blocks' branches, summed at the factor evaluation uses, are too large or too small. Then
  another scale of every branch recovers most of the gap, at a multiplier of the factor away from 1.

The gap is the assembled model's loss over the ensemble's (what the one model loses against what the workers
know together). Both, one, or neither may hold; below :data:`GAP_FLOOR` there is nothing to explain.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from sdp.report.runs import load_run

DIAGNOSIS = "diagnosis.json"  # what sdp-bench diagnose writes into a run directory
GAP_FLOOR = 0.01  # nats: a smaller assembled - ensemble gap is not explained
RECOVERED = 0.5  # the share of the gap a remedy-like figure must recover to support its explanation
DRIFT_GROWTH = 2.0  # the deeper half's mean drift over the shallower half's that counts as growing with depth
DRIFT_FLOOR = 0.01  # and the deeper half's mean drift at least this (1 - cos), so rounding noise never grows


def halves(drift: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean drift (over holders, then blocks) of the shallower and the deeper half of the blocks (the middle block
    of an odd count in neither)."""
    means = [d["mean"] for d in sorted(drift, key=lambda d: d["block"])]
    half = len(means) // 2
    return statistics.fmean(means[:half] or [0.0]), statistics.fmean(means[len(means) - half:] or [0.0])


def verdict(diag: dict[str, Any]) -> dict[str, Any]:
    """The rule (module docstring) on a diagnosis' figures: the numbers it compared, the explanations supported and
    one sentence each, all from ``diag`` (``losses``, ``drift``, ``scale_sweep``)."""
    loss, sweep = diag["losses"], diag["scale_sweep"]
    gap = loss["assembled"] - loss["ensemble"]
    shallow, deep = halves(diag["drift"])
    at_factor = sweep["loss"][sweep["multipliers"].index(1.0)]
    out: dict[str, Any] = {
        "gap": gap, "gap_workers": loss["assembled"] - loss["workers_mean"],
        "recovered_by_residual_average": (loss["assembled"] - loss["residual_average"]) / gap if gap > 0 else None,
        "drift_shallow": shallow, "drift_deep": deep,
        "drift_grows": deep >= DRIFT_FLOOR and deep >= DRIFT_GROWTH * shallow,
        "best_multiplier": sweep["best_multiplier"],
        "recovered_by_scale": (at_factor - sweep["best_loss"]) / gap if gap > 0 else None,
        "explanations": [], "lines": []}
    if gap < GAP_FLOOR:
        out["lines"].append(f"No assembly gap to explain: assembled − ensemble {gap:+.4f} nats < {GAP_FLOOR}.")
        return out
    res, scl = out["recovered_by_residual_average"], out["recovered_by_scale"]
    if out["drift_grows"] and res >= RECOVERED:
        out["explanations"].append("composition mismatch")
        out["lines"].append(
            f"Composition mismatch: block inputs drift from their holders' with depth (1 − cos {shallow:.4f} in the "
            f"shallower half, {deep:.4f} in the deeper, ≥ {DRIFT_GROWTH:g}x) and the residual-stream average recovers "
            f"{res:.0%} of the assembled − ensemble gap of {gap:.4f} nats (≥ {RECOVERED:.0%}).")
    if sweep["best_multiplier"] != 1.0 and scl >= RECOVERED:
        out["explanations"].append("branch magnitude")
        out["lines"].append(
            f"Branch magnitude: every branch at {sweep['best_multiplier']:g}x the evaluation factor "
            f"({diag['eval_scale']:g}) recovers {scl:.0%} of the gap of {gap:.4f} nats (≥ {RECOVERED:.0%}).")
    if not out["explanations"]:
        out["lines"].append(
            f"Neither explanation: gap {gap:.4f} nats; drift {shallow:.4f} → {deep:.4f} (grows: {out['drift_grows']}), "
            f"residual average recovers {res:.0%}, the best branch scale ({sweep['best_multiplier']:g}x) {scl:.0%} "
            f"(each needs ≥ {RECOVERED:.0%}).")
    return out


def _f(v: float | None, spec: str = ".4f") -> str:
    return "–" if v is None else format(v, spec)


def markdown(diag: dict[str, Any]) -> list[str]:
    """One run's diagnosis as markdown lines: losses, drift by depth, the scale sweep, the verdict."""
    loss, sweep, v = diag["losses"], diag["scale_sweep"], diag["verdict"]
    run = diag.get("run_figures") or {}
    lines = [f"### Diagnosis of {diag['run_dir']}", "",
             f"Final weights after step {diag['step']} ({diag['dtype']}), {diag['world_size']} workers, {diag['blocks']} "
             f"blocks, evaluation factor {diag['eval_scale']:g} (rescale={diag['rescale']}), {diag['tokens']} validation "
             "tokens, the same batches for every figure.", "",
             "| model | eval loss | the run's own evaluation |", "|---|---|---|",
             f"| assembled | {_f(loss['assembled'])} | {_f(run.get('eval_loss'))} |",
             f"| ensemble (mean probability) | {_f(loss['ensemble'])} | {_f(run.get('eval_loss_ensemble'))} |",
             f"| workers' own (mean) | {_f(loss['workers_mean'])} | {_f(run.get('eval_loss_workers'))} |",
             f"| residual-stream average | {_f(loss['residual_average'])} | – |", "",
             "| block | holders | 1 − cos(assembled input, holder's input) per holder | mean |", "|---|---|---|---|"]
    for d in diag["drift"]:
        lines.append(f"| {d['block']} | {','.join(d['holders'])} | "
                     f"{', '.join(f'{w}: {_f(x)}' for w, x in d['holders'].items())} | {_f(d['mean'])} |")
    lines += ["", "| branch scale (x factor) | " + " | ".join(f"{m:g}" for m in sweep["multipliers"]) + " |",
              "|---|" + "---|" * len(sweep["multipliers"]),
              "| assembled loss | " + " | ".join(_f(x) for x in sweep["loss"]) + " |"]
    for d in diag.get("depth_sweep") or []:
        lines.append(f"| block {d['block']} alone | " + " | ".join(_f(x) for x in d["loss"]) + " |")
    lines += ["", f"Verdict ({', '.join(v['explanations']) or 'none'}): " + " ".join(v["lines"]), ""]
    return lines


def loss_at_scale(diag: dict[str, Any], *, scale: float) -> float | None:
    """The assembled model's loss the diagnosis measured with every branch at ``scale`` (its scale sweep's
    ``scales``: the factor itself, not a multiple of the run's), None where the sweep did not evaluate that scale."""
    sweep = diag.get("scale_sweep") or {}
    return next((float(loss) for s, loss in zip(sweep.get("scales", []), sweep.get("loss", []))
                 if math.isclose(float(s), scale)), None)


def at_scale(runs: dict[int, Any], *, scale: float) -> dict[int, float]:
    """Per seed, :func:`loss_at_scale` of each run (a :class:`sdp.report.runs.Run`, by seed) that was diagnosed
    (``diagnosis.json`` beside its kept final weights) and evaluated ``scale``: another evaluation-time scale rule
    read from the weights that were trained, without training them again."""
    out = {}
    for seed, run in runs.items():
        path = Path(run.path) / DIAGNOSIS
        loss = loss_at_scale(json.loads(path.read_text()), scale=scale) if path.is_file() else None
        if loss is not None:
            out[seed] = loss
    return out


def read_all(root: Path) -> list[dict[str, Any]]:
    """Every ``diagnosis.json`` below ``root`` (a study's runs), in path order: :func:`section`'s input. Each one's
    ``run_dir`` is where it was found, relative to ``root`` (the path it recorded is where it was written, which a
    moved or copied study no longer has), and ``seed`` its run's (its config beside it)."""
    return [{**json.loads(p.read_text()), "run_dir": str(p.parent.relative_to(root)), "seed": load_run(p.parent).seed}
            for p in sorted(Path(root).rglob(DIAGNOSIS))]


def section(diags: list[dict[str, Any]]) -> list[str]:
    """The study report's section over several runs' diagnoses (seeds): one row per run and the verdicts."""
    if not diags:
        return []
    lines = ["## Diagnosis of the assembly gap (issue 39)", "",
             "From each run's final weights on its validation set (`sdp-bench diagnose`): the gap is assembled − "
             "ensemble; 'recovered' is the share of it the residual-stream average, or the best common branch scale, "
             f"recovers; the rule (sdp/bench/diagnosis_verdict.py) needs ≥ {RECOVERED:.0%} and, for composition "
             f"mismatch, block-input drift (1 − cos) growing ≥ {DRIFT_GROWTH:g}x from the shallower to the deeper "
             "half of the blocks.", "",
             "| run (below runs/) | seed | assembled | ensemble | workers | residual avg | gap | drift shallow → deep | recovered by residual avg "
             "| best scale (x factor) | recovered by scale | verdict |", "|---|" + "---|" * 11]
    for d in diags:
        loss, v = d["losses"], d["verdict"]
        lines.append(f"| {d['run_dir']} | {d.get('seed', '–')} | {_f(loss['assembled'])} | {_f(loss['ensemble'])} | {_f(loss['workers_mean'])} "
                     f"| {_f(loss['residual_average'])} | {_f(v['gap'])} | {_f(v['drift_shallow'])} → {_f(v['drift_deep'])} "
                     f"| {_f(v['recovered_by_residual_average'], '.0%')} | {v['best_multiplier']:g} "
                     f"| {_f(v['recovered_by_scale'], '.0%')} | {', '.join(v['explanations']) or 'none'} |")
    counts = {e: sum(e in d["verdict"]["explanations"] for d in diags) for e in ("composition mismatch", "branch magnitude")}
    lines += ["", "Supported in " + ", ".join(f"{n} of {len(diags)} runs: {e}" for e, n in counts.items()) + ".", ""]
    return lines
