"""Frontier figures of a CPU study (issue 38, item 3): every method as a point, its final quality with its 95 %
interval over seeds, against each resource it spends, so that which method wins is read per resource.

Why one panel per resource: a method that trades quality for memory (SDP) and one that trades it for time (a drop
baseline) each win on their own axis; one column of the table (the loss) hides that. Panels (``frontier.png``):

- the measured training peak / DDP's (``runs/peaks``, fullest rank);
- wire bytes per trained token (the main runs' ring-model wire bytes per step on the fullest rank / the tokens
  (samples) one step trains over all ranks);
- the predicted training time on two links (:data:`LINKS`): the run's steps x ``sdp-plan``'s step time
  (:func:`sdp.planning.throughput.rank_times`: the run's counted FLOPs per rank and step, with ``train.ac``'s
  recomputation (``budget.recompute_flops_per_step``), on :data:`GPU` at the
  run's ``plan.mfu`` (conf/config.yaml's for runs recorded before the ``plan`` node), its measured wire bytes per collective kind, the strategy's stated overlap), slowest rank.
  The study's own shape (its model, batch, FLOPs and measured bytes), not a paper-scale one: the point is each
  method's cost from the very runs its quality comes from; at this tiny shape a step is microseconds on a GPU,
  so the absolute seconds mean little, the order and the ratios between methods are what the panel shows (comm
  bound on the slow link, compute bound on NVLink). A whole run's time, not one step's: under FLOP matching SDP
  runs 1/C more steps, so a step-time axis alone would credit it with steps it must take more of.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from sdp.metrics.flops import matmul_dtype
from sdp.metrics.hardware import gpus, links
from sdp.parallel import STRATEGIES
from sdp.parallel.job import ac_every
from sdp.planning.throughput import rank_times
from sdp.bench.runs import ROOT
from sdp.bench.study_report import _order
from sdp.report.runs import Run, run_figures
from sdp.report.stats import t_half_width

GPU = "h100_80gb"
LINKS = ("nvlink", "eth_100g")


def _wire_by_kind(rank: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A rank's ``by_kind`` with each kind's ring wire bytes: recorded, or (runs that predate the per-kind record) the
    kind's payload x the rank's wire / payload ratio, exact where one kind (or one group size) makes the step."""
    factor = rank["wire_bytes_per_step"] / rank["bytes_per_step"] if rank.get("bytes_per_step") else 0.0
    return {k: {"wire_bytes": e.get("wire_bytes", e["bytes"] * factor), "count": e["count"]}
            for k, e in (rank.get("by_kind") or {}).items()}


@functools.cache
def default_mfu() -> float:
    """``plan.mfu`` of conf/config.yaml: the MFU ``sdp-plan`` assumes, for runs recorded before the ``plan`` node."""
    return float(OmegaConf.load(ROOT / "conf" / "config.yaml").plan.mfu)


def predicted_run_s(run: Run, *, link: str) -> float | None:
    """The run's steps x the predicted step time of its slowest rank on ``link`` (this module's docstring)."""
    budget = run.summary.budget or {}
    cfg = OmegaConf.create(run.config)
    if budget.get("flops_per_step") is None or OmegaConf.select(cfg, "train.precision") is None:
        return None  # a config or budget that does not record what the model needs
    spec = STRATEGIES.get(str(cfg.parallelism.name))
    overlap = spec.comm_overlap(cfg=cfg.parallelism)
    if overlap is None:
        return None
    dtype = matmul_dtype(precision=str(cfg.train.precision), tf32=bool(cfg.train.get("tf32", False)))
    recompute = budget.get("recompute_flops_per_step")  # the step computes train.ac's recomputation too
    if recompute is None and ac_every(cfg):
        return None  # checkpointed, recorded before the budget kept its recomputation: not guessed
    per_rank = (float(budget["flops_per_step"]) + float(recompute or 0.0)) / int(cfg.cluster.world_size)
    mfu = float(OmegaConf.select(cfg, "plan.mfu", default=None) or default_mfu())
    steps = [rank_times(flops_per_step=per_rank, peak_flops=gpus()[GPU].peak_flops[dtype], mfu=mfu,
                        by_kind=_wire_by_kind(r), bus_bytes_per_s=links()[link].bus_bytes_per_s, overlap=overlap)["step_s"]
             for r in run.summary.comm_per_rank]
    return None if not steps or None in steps else max(steps) * int(run.summary.steps)


def traffic_unit(study: Any) -> str:
    """What the wire bytes are per: a token where the study's runs train sequences, else a sample."""
    return "token" if any(r.tokens_per_sample() for r in study.runs) else "sample"


def _per_token(run: Run) -> float | None:
    wire, tokens = run_figures(run.summary)["wire_bytes_per_step"], run.tokens_per_step()
    return None if wire is None or not tokens else wire / tokens


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def frontier_points(study: Any) -> dict[str, dict[str, float | None]]:
    """Per row of ``study`` (:class:`sdp.bench.study_report.Study`): its quality (mean, 95 % t half-width over
    seeds) and each resource of the panels (None where not measured); computed once per study (the plot, its
    table and the baselines' verdicts read the same points)."""
    return study.once("frontier_points", lambda: _points(study))


def _points(study: Any) -> dict[str, dict[str, float | None]]:
    key = study.metric or "eval_loss"
    out = {}
    for name, row in study.rows.items():
        vals = row.present(key)
        if not vals:
            continue
        runs = list(row.runs.values())
        out[name] = {
            "quality": statistics.fmean(vals), "half_width": t_half_width(vals),
            "peak": study.ratio(name, "train_peak_bytes", source="peaks"),
            "wire_per_token": _mean([_per_token(r) for r in runs]),
            **{f"time_{link}": _mean([predicted_run_s(r, link=link) for r in runs]) for link in LINKS},
        }
    return out


def plot_frontier(study: Any, *, path: Path) -> Path:
    """``frontier.png``: one panel per resource (this module's docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = frontier_points(study)
    unit = traffic_unit(study)
    panels = [("peak", "training peak / DDP's (measured, fullest rank)"),
              ("wire_per_token", f"wire bytes per trained {unit} (fullest rank)"),
              *((f"time_{link}", f"predicted training time, s ({GPU}, {link})") for link in LINKS)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 5), sharey=True)
    for ax, (key, xlabel) in zip(axes, panels):
        for i, (name, p) in enumerate(sorted(points.items(), key=lambda kv: _order(kv[0]))):
            if p[key] is None:
                continue
            color, marker = f"C{i % 10}", "osD^v<>pX*h"[i % 11]  # (colour, marker) differs for up to 110 methods
            ax.errorbar([p[key]], [p["quality"]], yerr=[p["half_width"] or 0.0], fmt=marker, color=color, capsize=3,
                        label=name)
        ax.set_xlabel(xlabel)
        if key.startswith("time_"):
            ax.set_xscale("log")
    axes[0].set_ylabel(f"final {'accuracy %' if study.metric else 'evaluation loss'} (mean ± 95 % t over seeds)")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"Frontier: quality against each resource ({study.study})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def frontier_lines(study: Any) -> list[str]:
    """The figures behind the panels, as a table (so that the plot's points can be read exactly)."""
    points = frontier_points(study)
    links_head = " | ".join(f"predicted training s, {link}" for link in LINKS)
    lines = [f"| method | quality (95 % t) | train peak x DDP | wire bytes / {traffic_unit(study)} | " + links_head + " |",
             "|" + "---|" * (4 + len(LINKS))]
    for name, p in sorted(points.items(), key=lambda kv: _order(kv[0])):
        cells = [f"{p['quality']:.3f}" + ("" if p["half_width"] is None else f" ± {p['half_width']:.3f}"),
                 "–" if p["peak"] is None else f"{p['peak']:.3f}",
                 "–" if p["wire_per_token"] is None else f"{p['wire_per_token']:,.0f}",
                 *("–" if p[f"time_{link}"] is None else f"{p[f'time_{link}']:.3g}" for link in LINKS)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
