"""The GPU check's verdicts: each reads the runs it needs (summary.json, NAME.plan.json, nccl_groups.json) and
appends one line, PASS, FAIL or n/a with the figures it judged (``rows.py verdict KIND RUN...``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpu_io import _max, _mib, _opt, _verdict, append, last_error, plan, state, summary


def cmd_verdict(a: argparse.Namespace) -> None:  # noqa: C901 - one branch per check, each short
    runs, need = a.runs, a.need or []
    got = {n: summary(runs, n) for n in need}
    missing = [n for n, s in got.items() if s is None]
    if a.kind == "deterministic":  # a refusal has no summary by design
        name = need[0]
        s, log = got[name], runs / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if s is not None:
            return _verdict(a, True, f"{name} trained with train.deterministic=true (backends: {s.get('backends')})")
        refused = "ConfigError: train.deterministic" in text and "RankFailure" not in text  # the driver's, not a rank's
        return _verdict(a, refused, f"{name}: {'refused before any rank started' if refused else 'failed'}: {last_error(log)}")
    if missing:
        return _verdict(a, None, f"missing runs: {', '.join(missing)}")
    if a.kind == "memory":
        ddp, sdp = got[need[0]], got[need[1]]
        floor = json.loads((runs / "floor.json").read_text())["floor"]
        ratio = state(sdp) / state(ddp)
        peak = [_train_peak(s) for s in (sdp, ddp)]
        pr = f"{peak[0] / peak[1]:.3f}x" if all(peak) else "n/a"
        return _verdict(a, abs(ratio - floor) <= 0.03 * floor,
                        f"{need[1]} / {need[0]} model state {ratio:.3f}x against the plan's floor {floor:.3f}x (within 3%); "
                        f"train allocator peak {pr} (state + activations + transients)")
    if a.kind == "fsdp_setup":
        ddp, fsdp = got[need[0]], got[need[1]]
        full = max(m["param_bytes"] for m in ddp["memory"]["per_rank"])
        setup = _max(fsdp["memory"]["per_rank"], "setup_peak_bytes") or 0
        return _verdict(a, setup < full, f"{need[1]} set-up peak {_mib(setup)} MiB (largest rank) = {setup / full:.2f}x the "
                                         f"full fp32 model ({_mib(full)} MiB, {need[0]}'s parameters); one rank's shards "
                                         f"plus one module are expected, never the whole model")
    if a.kind == "device_figures":
        bad = []
        for n, s in got.items():
            for m in s["memory"]["per_rank"]:
                alloc, res, used = (m.get(k) for k in ("cuda_max_allocated_bytes", "cuda_max_reserved_bytes",
                                                       "cuda_device_used_bytes"))
                if None in (alloc, res, used) or not (alloc <= res <= used):
                    bad.append(f"{n} rank {m['rank']}: allocated {_mib(alloc)}, reserved {_mib(res)}, used {_mib(used)}")
        return _verdict(a, not bad, "max allocated <= max reserved (over the run) <= device used (largest seen) on every "
                                    "rank" + (": " + "; ".join(bad) if bad else ""))
    if a.kind == "tf32":
        rec = {n: s.get("backends") or {} for n, s in got.items()}
        if all(b.get("device_type") == "cpu" for b in rec.values()):
            return _verdict(a, None, f"CPU run (TF32 does not exist there): backends {rec}")
        tf32 = {n: b.get("tf32_matmul") for n, b in rec.items()}
        return _verdict(a, all(v is not None for v in tf32.values()), f"summary.json backends.tf32_matmul: {tf32}")
    if a.kind == "bn":
        ddp, sdp = (got[n]["final"]["eval_loss"] for n in need)
        gap = abs(sdp - ddp) / max(abs(ddp), 1e-12)
        first = [_first_loss(runs / n) for n in need]  # identical weights and batch: equal unless the
        same = "equal" if first[0] == first[1] else "differ: the arithmetic differs before any statistics do"  # kernels differ
        return _verdict(a, gap < 0.01, f"eval.bn=average at C=1: {need[1]} eval loss {sdp:.4f} vs {need[0]} {ddp:.4f} "
                                       f"(relative gap {gap:.2e}; stale statistics after the move to the GPU show as a large gap); "
                                       f"step-1 training losses {first[1]} vs {first[0]} ({same})")
    if a.kind == "peaks":
        return _verdict_peaks(a, got)
    if a.kind == "ac":
        return _verdict_ac(a, got)
    if a.kind == "mfu":
        return _verdict_mfu(a, got)
    raise SystemExit(f"unknown verdict {a.kind!r}")


def _first_loss(run_dir: Path) -> float | None:
    """The first training step's loss in a run's metrics (None: no such row)."""
    from sdp.results.contract import read_metrics  # the package from the checkout (PYTHONPATH), as rows.py's imports

    return next((float(r["loss"]) for r in read_metrics(run_dir) if r.get("step") == 1 and "loss" in r), None)


PEAKS = ("setup_peak_bytes", "train_peak_bytes", "eval_peak_bytes")


def _verdict_peaks(a: argparse.Namespace, got: dict[str, dict[str, Any]]) -> None:
    """Measured (the allocator's on CUDA, the live-tensor tracker's on CPU) over predicted, per phase, largest rank.
    PASS within 10 %, the bound the CPU tests hold the planner to (tests/test_plan_peaks.py)."""
    parts, ok = [], True
    for name, s in got.items():
        p = plan(a.runs, name)
        if p is None:
            parts.append(f"{name}: no plan")
            ok = False
            continue
        ratios = []
        for key in PEAKS:
            meas, pred = _max(s["memory"]["per_rank"], key), _max(p["memory"]["per_rank"], key)
            if meas is None or not pred:
                ratios.append(f"{key.split('_')[0]} -")
                continue
            ok = ok and abs(meas / pred - 1) <= 0.10
            ratios.append(f"{key.split('_')[0]} {_mib(meas)}/{_mib(pred)} MiB = {meas / pred:.2f}x")
        parts.append(f"{name}: " + ", ".join(ratios))
    _verdict(a, ok, "measured / predicted peak (largest rank; within 10 %): " + "; ".join(parts))


def _train_peak(s: dict[str, Any]) -> int | None:
    """The largest rank's training peak: the allocator's on CUDA, the live-tensor tracker's on CPU."""
    per_rank = s["memory"]["per_rank"]
    return _max(per_rank, "cuda_max_allocated_bytes") or _max(per_rank, "train_peak_bytes")


def _verdict_ac(a: argparse.Namespace, got: dict[str, dict[str, Any]]) -> None:
    """Activation checkpointing's saving under bf16 autocast, measured against the plan: the training peak with AC
    over the one without, each measured, beside the same ratio of sdp-plan's predictions for the two runs. PASS
    when the two ratios agree within 10 % (the plan emulates autocast's weight-cast cache, which checkpointed blocks
    run without: sdp.core.precision.weight_cache_off, so that a recomputed block's bf16 weight copies are not kept)."""
    (off_n, off), (on_n, on) = got.items()
    meas = [_train_peak(s) for s in (off, on)]
    plans = [plan(a.runs, n) for n in (off_n, on_n)]
    pred = [_max(p["memory"]["per_rank"], "train_peak_bytes") if p else None for p in plans]
    if None in meas or not all(pred):
        return _verdict(a, None, f"train peaks measured {meas}, predicted {pred} ({off_n}, {on_n}): one is missing")
    m, p = meas[1] / meas[0], pred[1] / pred[0]
    loss = [s.get("final", {}).get("eval_loss") for s in (off, on)]
    _verdict(a, abs(m / p - 1) <= 0.10,
             f"train peak {on_n} / {off_n}: measured {_mib(meas[1])}/{_mib(meas[0])} MiB = {m:.3f}x, predicted "
             f"{_mib(pred[1])}/{_mib(pred[0])} MiB = {p:.3f}x (agree within 10 %); eval loss {loss[1]} vs {loss[0]} "
             f"(checkpointing changes no arithmetic: equal up to kernel nondeterminism)")


def _verdict_mfu(a: argparse.Namespace, got: dict[str, dict[str, Any]]) -> None:
    """The whole model's step against one SDP worker's compute (the same model with half its blocks, alone on
    the GPU): what SDP's per-worker compute costs where nothing else shares the device."""
    (full_n, full), (half_n, half) = got.items()
    t = {n: s["time"] for n, s in got.items()}
    cells = [f"{n}: step {_opt(x.get('step_s_median'), '.1f', 1e3)} ms, {_opt(x.get('tokens_per_s'), '.0f')} tokens/s, "
             f"MFU {_opt(x.get('mfu'), '.3f')} ({x.get('mfu_dtype') or '-'})" for n, x in t.items()]
    steps = [x.get("step_s_median") for x in t.values()]
    ratio = f"; step time {half_n} / {full_n} = {steps[1] / steps[0]:.3f}x" if all(steps) else ""
    mfu = [x.get("mfu") for x in t.values()]
    _verdict(a, None if None in mfu else True, "; ".join(cells) + ratio + (" (no MFU: no known device peak)" if None in mfu else ""))


def cmd_groups(a: argparse.Namespace) -> None:
    """The verdict on nccl_groups.py's JSON: every step passed (a step torch lacks is n/a, not a failure)."""
    path = a.runs / "nccl_groups.json"
    if not path.exists():
        return _verdict(a, False, f"no {path.name} (the script did not finish)")
    r = json.loads(path.read_text())
    failed = [f"{x['step']}: {x['error']}" for x in r.get("steps", []) if x["ok"] is False]
    if r.get("error"):
        failed.insert(0, f"init: {r['error']}")
    done = ", ".join(f"{x['step']} {'ok' if x['ok'] else x.get('note', 'FAILED')}" for x in r.get("steps", []))
    _verdict(a, not failed and bool(r.get("steps")), f"{r['backend']} on {r['device']} (torch {r['torch']}"
             f"{', NCCL ' + r['nccl_version'] if r.get('nccl_version') else ''}): {done}" + (": " + "; ".join(failed) if failed else ""))


SHARED_GPU = [
    "step time, tokens/s and MFU of the runs with several ranks on one GPU: the ranks take turns on one device, so "
    "none of them measures a worker with a GPU of its own (only the world-size-1 runs do)",
    "communication time and overlap of those runs: gloo moves every tensor through host memory, not NVLink or "
    "InfiniBand; SDP's and DDP's comm time there says nothing of NCCL's",
    "device used MiB (whole GPU): mem_get_info counts every process on the device, so each rank sees the others' memory",
    "NCCL sub-communicators of several ranks (SDP's holder sets): never made here, because NCCL refuses two ranks on "
    "one GPU; the groups check splits a one-rank communicator only",
]


def cmd_caveats(a: argparse.Namespace) -> None:
    append(a.results, "\n### Figures above that mean nothing on a shared GPU\n\n" + "\n".join(f"- {c}" for c in SHARED_GPU)
           + "\n\nWhat does mean something with 4 ranks on one GPU: each rank's allocator peaks and model state "
             "(the allocator is per process), the measured-vs-predicted peaks, and every world-size-1 figure.")
