"""``sdp-plan``'s FLOPs and step time: per rank, compute from the model's own FLOP count and an assumed MFU,
communication from the predicted collectives and a link's bus bandwidth, minus what overlaps the compute.

Why a model this simple: what a user needs before booking a cluster is where a method's step is bound by
compute and where by the network, and so where SDP's smaller all-reduces turn into a shorter step. Every
input is one the suite already predicts or states: a step's FLOPs are the budget's count (the full model's
training FLOPs per sample, :meth:`sdp.models.base.SDPModel.flops_per_sample`, times the fraction of it the
strategy computes, :meth:`sdp.parallel.spec.StrategySpec.flops_fraction`, as ``train.budget=flops`` uses
them: :func:`sdp.driver.budget.resolve_steps`), a rank's collectives are the strategy's ``sdp-plan``
prediction (``comm.per_rank``: each kind's ring wire bytes), what they overlap is the strategy's own statement
(:class:`sdp.parallel.spec.Overlap`), and the device and link are a row each of ``conf/hardware.yaml``
(``cluster.gpu``, ``cluster.link``). The rule, one for every strategy:

- ``compute_s`` = the rank's FLOPs per step, plus what activation checkpointing recomputes (``train.ac``: one more
  forward of the checkpointed blocks, :func:`sdp.parallel.ac.recompute_share` of a forward, a forward being a third
  of the count: the budget's ``recompute_flops_per_step``, :mod:`sdp.driver.budget`),
  / (the GPU's dense peak for the run's matmul dtype x ``plan.mfu``);
- ``comm_s`` = the rank's ring wire bytes per step / the link's bus bandwidth (nccl-tests' busbw is defined so
  that this is a collective's time);
- ``exposed_comm_s`` = the kinds that do not overlap, plus, of those that do, ``max(tail, overlapping -
  window)``: ``window`` the compute they hide behind (backward = two thirds of ``compute_s``, the model's count
  taking backward as twice the forward; step = all of it), ``tail`` the collectives that cannot overlap (at the
  mean size of the overlapping ones);
- ``step_s`` = ``compute_s`` + ``exposed_comm_s``; the method's step is its slowest rank's (every step ends in
  a collective over the world); tokens/s/GPU = the tokens one rank trains per step / ``step_s``.

``flops_per_token`` and ``flops_per_step`` stay the useful FLOPs (as MFU counts them); ``recompute_flops_per_step``
is the overhead. Under SDP the recomputed share is the full model's, scaled by the fraction the worker computes
(its blocks' own shares are not weighed). Not modelled: collective latency (a per-call constant, small beside
bandwidth at these sizes), the optimizer step, data loading, and a strategy whose
step is not forward + backward + collectives (``overlap = None``: a pipeline schedule's bubble).
This module names no strategy.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from sdp.metrics.flops import matmul_dtype
from sdp.metrics.hardware import gpus, links
from sdp.parallel.spec import Overlap, StrategySpec
from sdp.driver.budget import resolve_steps

WINDOW_SHARE = {"none": 0.0, "backward": 2.0 / 3.0, "step": 1.0}  # share of compute_s a window spans
FIELDS = ("compute_s", "comm_s", "exposed_comm_s", "step_s")
NOTE = ("step time = compute ((FLOPs + train.ac's recomputation) / (peak x plan.mfu)) + exposed comm (wire bytes / bus bandwidth, less what "
        "overlaps compute as the strategy states); an assumed MFU and published link figures, not a measurement; "
        "no latency, optimizer step or data loading")


def comm_times(*, by_kind: dict[str, dict[str, float]], bus_bytes_per_s: float, overlap: Overlap,
               compute_s: float) -> tuple[float, float]:
    """(all comm seconds, exposed comm seconds) of one rank's step: ``by_kind`` its ``comm.per_rank`` entry's
    (``wire_bytes``, ``count`` per kind), the rule of this module's docstring."""
    over = [e for k, e in by_kind.items() if k in overlap.kinds]
    over_s = sum(e["wire_bytes"] for e in over) / bus_bytes_per_s
    rest_s = sum(e["wire_bytes"] for k, e in by_kind.items() if k not in overlap.kinds) / bus_bytes_per_s
    count = sum(e["count"] for e in over)
    tail_s = over_s * min(overlap.tail, count) / count if count else 0.0
    window_s = WINDOW_SHARE[overlap.window] * compute_s
    exposed = rest_s + (max(tail_s, over_s - window_s) if over_s > 0 else 0.0)
    assert 0 <= exposed <= over_s + rest_s + 1e-12, f"exposed {exposed} s outside [0, comm {over_s + rest_s} s]"
    return over_s + rest_s, exposed


def rank_times(*, flops_per_step: float, peak_flops: float | None, mfu: float, by_kind: dict[str, dict[str, float]],
               bus_bytes_per_s: float | None, overlap: Overlap) -> dict[str, float | None]:
    """One rank's :data:`FIELDS` (None where the device or the link is not given: ``cluster.gpu`` /
    ``cluster.link`` null; a rank without wire bytes needs no link)."""
    compute = flops_per_step / (peak_flops * mfu) if peak_flops else None
    wire = sum(e["wire_bytes"] for e in by_kind.values())
    if wire == 0:
        comm, exposed = 0.0, 0.0
    elif bus_bytes_per_s is None or compute is None:
        comm = wire / bus_bytes_per_s if bus_bytes_per_s else None
        exposed = None
    else:
        comm, exposed = comm_times(by_kind=by_kind, bus_bytes_per_s=bus_bytes_per_s, overlap=overlap, compute_s=compute)
    step = compute + exposed if compute is not None and exposed is not None else None
    return {"compute_s": compute, "comm_s": comm, "exposed_comm_s": exposed, "step_s": step}


def tokens_per_sample(model: Any) -> int | None:
    """Tokens in one sample of a language model (one ``max_seq_len`` sequence, as its FLOP count takes it);
    None for another task (its figures are per sample)."""
    return int(model.example_input(1).numel()) if getattr(model, "task", "") == "lm" else None


def predict(*, cfg: DictConfig, built: Any, spec: type[StrategySpec], comm: list[dict[str, Any]]) -> dict[str, Any]:
    """``throughput`` of ``sdp-plan``'s JSON for ``cfg``: the method's figures (its slowest rank's) and
    ``per_rank``; ``built``: the validation's :class:`sdp.driver.preflight.Preflight`; ``comm``: the prediction's
    ``comm.per_rank``."""
    _, budget = resolve_steps(cfg, preflight=built)
    per_sample, fraction = budget["flops_per_sample"], budget["fraction_computed"]
    tokens = tokens_per_sample(built.model)
    gpu_name, link_name = cfg.cluster.get("gpu"), cfg.cluster.get("link")
    gpu = gpus()[gpu_name] if gpu_name else None
    link = links()[link_name] if link_name else None
    dtype = matmul_dtype(precision=str(cfg.train.precision), tf32=bool(cfg.train.tf32))
    mfu, overlap, batch = float(cfg.plan.mfu), spec.comm_overlap(cfg=cfg.parallelism), built.job.batch_size
    flops_sample = per_sample * fraction if per_sample is not None and fraction is not None else None
    # train.ac's recomputation as a share of the step's useful (training) FLOPs: the budget's record of it, the fact
    # the frontier reads from a run's summary too (None where the FLOPs could not be counted)
    recompute = budget["recompute_flops_per_step"] / budget["flops_per_step"] if budget["flops_per_step"] else None
    out: dict[str, Any] = {
        "gpu": gpu_name, "link": link_name, "dtype": dtype, "mfu": mfu,
        "peak_flops": gpu.peak_flops[dtype] if gpu else None, "bus_bytes_per_s": link.bus_bytes_per_s if link else None,
        "overlap": overlap.summary() if overlap is not None else None, "tokens_per_sample": tokens,
        "model_flops_per_token": per_sample / tokens if per_sample is not None and tokens else None,
        "fraction_computed": fraction,
        "flops_per_token": flops_sample / tokens if flops_sample is not None and tokens else None,
        "flops_per_sample": flops_sample, "recompute_fraction": recompute, "note": NOTE if overlap is not None else
        f"{spec.method_label(cfg=cfg.parallelism)}: no step-time model (StrategySpec.overlap is None)",
    }
    rows = []
    for c in comm:
        row: dict[str, Any] = {"rank": c["rank"], "flops_per_step": flops_sample * batch if flops_sample is not None else None}
        row["recompute_flops_per_step"] = row["flops_per_step"] * recompute if row["flops_per_step"] is not None else None
        if overlap is None or row["flops_per_step"] is None:
            row |= dict.fromkeys(FIELDS)
        else:
            computed = row["flops_per_step"] + row["recompute_flops_per_step"]
            row |= rank_times(flops_per_step=computed, peak_flops=out["peak_flops"], mfu=mfu,
                              by_kind=c["by_kind"], bus_bytes_per_s=out["bus_bytes_per_s"], overlap=overlap)
        row |= rates(step_s=row["step_s"], batch=batch, tokens=tokens)
        rows.append(row)
    known = [r for r in rows if r["step_s"] is not None]
    slowest = max(known, key=lambda r: r["step_s"]) if len(known) == len(rows) and rows else None
    out |= {k: slowest[k] if slowest else None for k in FIELDS}
    out |= rates(step_s=out["step_s"], batch=batch, tokens=tokens)
    out["per_rank"] = rows
    return out


def rates(*, step_s: float | None, batch: int, tokens: int | None) -> dict[str, float | None]:
    """Samples and tokens (language models) one GPU trains per second at ``step_s`` with ``batch`` samples a rank."""
    samples = batch / step_s if step_s else None
    return {"samples_per_s_per_gpu": samples, "tokens_per_s_per_gpu": samples * tokens if samples and tokens else None}


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_throughput(th: dict[str, Any]) -> str:
    """The table ``sdp-plan`` prints after its memory table: per rank, then the method (its slowest rank)."""
    peak = f"{th['peak_flops'] / 1e12:.1f} TFLOP/s {th['dtype']}" if th["peak_flops"] else f"no peak ({th['dtype']})"
    bus = f"{th['bus_bytes_per_s'] / 1e9:.0f} GB/s bus" if th["bus_bytes_per_s"] else "no bandwidth"
    over = th["overlap"]
    how = (f"{'+'.join(over['kinds']) or 'nothing'} behind {over['window']}, last {over['tail']} exposed"
           if over else "not modelled")
    unit = "token" if th["tokens_per_sample"] else "sample"
    lines = [f"throughput: cluster.gpu={th['gpu']} ({peak}) x plan.mfu={th['mfu']:g}; cluster.link={th['link']} ({bus}); "
             f"overlap: {how}",
             f"| rank | GFLOP/{unit} | compute s | comm s | exposed comm s | step s | {unit}s/s/GPU |",
             "|---|---|---|---|---|---|---|"]
    per = th["flops_per_token"] if th["tokens_per_sample"] else th["flops_per_sample"]
    rate = "tokens_per_s_per_gpu" if th["tokens_per_sample"] else "samples_per_s_per_gpu"
    for r in [*th["per_rank"], {**th, "rank": "method"}]:
        lines.append(f"| {r['rank']} | {_num(per / 1e9 if per is not None else None, '.4g')} | {_num(r['compute_s'], '.4g')} | "
                     f"{_num(r['comm_s'], '.4g')} | {_num(r['exposed_comm_s'], '.4g')} | {_num(r['step_s'], '.4g')} | "
                     f"{_num(r[rate], ',.0f')} |")
    lines.append(th["note"])
    return "\n".join(lines)
