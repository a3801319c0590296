"""Measured per-rank peaks, side by side: DDP vs forward block SDP at C = 0.5 (issue 14's targets),
plus the live-tensor tracker's cost (DDP and SDP with ``memory.tracker=false``: step time on vs off).

Each run is a real ``sdp-train`` job (``benchmarks/compare.py``'s ``run_one``) on the same model, data
and batch; figures are read from summary.json ``memory.per_rank[]`` (``setup_peak_bytes``,
``train_peak_bytes``, ``eval_peak_bytes``: live tensor bytes on CPU, the CUDA allocator on a GPU), each
on the rank where it is largest. Evaluation runs at the default ``train.eval_batch_size`` (larger than a
rank's validation shard here, so a rank evaluates its whole shard in one forward); ``--extra
train.eval_batch_size=N`` measures another.

    PYTHONPATH=$PWD python benchmarks/memory.py --out benchmarks/results/cpu-4ranks/memory
    PYTHONPATH=$PWD python benchmarks/memory.py --suite llama --extra cluster.device=cuda   # GPU figures
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compare import ROOT, run_one  # noqa: E402
from sdp.results import provenance  # noqa: E402
from sdp.summary import Summary  # noqa: E402

BASE = ["logger.wandb.mode=disabled", "logger.progress=false", "train.eval_every=0", "train.warmup_steps=2",
        "cluster.world_size=4", "train.steps=6"]
SUITES: dict[str, list[str]] = {
    "resnet18": [*BASE, "model=resnet18_cifar", "model.width=64", "dataset=synthetic", "dataset.image_size=32",
                 "train.batch_size=32"],
    "llama": [*BASE, "model=llama_tiny", "model.n_layers=8", "model.dim=128", "model.hidden=352", "model.n_heads=4",
              "model.n_kv_heads=null", "dataset=synthetic_text", "dataset.seq_len=128", "optim=adamw",
              "train.batch_size=16"],
}
RUNS = ["ddp=ddp", "sdp=sdp,parallelism.coverage=0.5", "ddp_untracked=ddp,memory.tracker=false",
        "sdp_untracked=sdp,parallelism.coverage=0.5,memory.tracker=false"]
PEAKS = ("setup_peak_bytes", "train_peak_bytes", "eval_peak_bytes")
TARGETS = {"resnet18": {"train_peak_bytes": 0.65, "setup_peak_bytes": 0.60, "eval_peak_bytes": 1.0},
           "llama": {"train_peak_bytes": 0.60, "setup_peak_bytes": 0.60, "eval_peak_bytes": 1.0}}


def figures(s: Summary) -> dict[str, Any]:
    mem = s.memory_per_rank
    out: dict[str, Any] = {"strategy": s.strategy, "step_s": s.time["step_s_median"],
                           "peak_source": mem[0].get("peak_source")}
    for k in PEAKS:
        vals = [(m.get(k), m["rank"]) for m in mem if m.get(k) is not None]
        out[k], out[k.replace("_bytes", "_rank")] = max(vals) if vals else (None, None)
    full = max(mem, key=lambda m: m.get("train_peak_bytes") or 0)
    out["train_categories"] = (full.get("peak_categories") or {}).get("train")
    out["model_state_bytes"] = max(m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in mem)
    return out


def table(suite: str, rows: dict[str, dict[str, Any]]) -> str:
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    base = rows["ddp"]
    lines = [f"### {suite}: {' '.join(SUITES[suite])}", "",
             "| run | set-up peak MiB (x) | train peak MiB (x) | eval peak MiB (x) | model state MiB | step s |",
             "|---|---|---|---|---|---|"]
    for label, r in rows.items():
        cells = []
        for k in PEAKS:
            x = r[k] / base[k] if r.get(k) and base.get(k) else None
            cells.append(f"{mib(r.get(k))} ({'n/a' if x is None else f'{x:.3f}x'})")
        lines.append(f"| {label} | {' | '.join(cells)} | {mib(r['model_state_bytes'])} | {r['step_s']:.4f} |")
    lines.append("")
    for k, bound in TARGETS[suite].items():
        x = rows["sdp"][k] / base[k] if rows["sdp"].get(k) and base.get(k) else None
        verdict = "n/a" if x is None else ("HIT" if x <= bound else "MISSED")
        lines.append(f"- {k}: sdp/ddp = {'n/a' if x is None else f'{x:.3f}'} (target <= {bound}) {verdict}")
    for name in ("ddp", "sdp"):
        off = rows.get(f"{name}_untracked")
        if off and off["step_s"]:
            lines.append(f"- tracker cost, {name}: step time on/off = {rows[name]['step_s'] / off['step_s']:.3f}")
    cats = rows["sdp"].get("train_categories")
    if cats:
        lines.append("- at the train peak (MiB), ddp: " + ", ".join(f"{k} {mib(v)}" for k, v in (base["train_categories"] or {}).items())
                     + "; sdp: " + ", ".join(f"{k} {mib(v)}" for k, v in cats.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", nargs="+", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--runs", nargs="+", default=RUNS, help="label=preset[,override,...]; needs ddp and sdp")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides appended to every run")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "memory")
    args = ap.parse_args(argv)
    result: dict[str, Any] = provenance()  # the tree the runs start from
    texts = []
    for suite in args.suite:
        rows: dict[str, dict[str, Any]] = {}
        for spec in args.runs:
            label, _, rest = spec.partition("=")
            rows[label] = figures(run_one(label=label, spec=rest, common=SUITES[suite] + args.extra, out=args.out / suite))
        text = table(suite, rows)
        print(text, flush=True)
        texts.append(text)
        result[suite] = {"common": SUITES[suite] + args.extra, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.md").write_text("\n\n".join(texts) + "\n")
    (args.out / "memory.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
