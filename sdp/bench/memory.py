"""Measured per-rank peaks, side by side: DDP vs forward block SDP at C = 0.5 (issue 14's targets),
plus the live-tensor tracker's cost (DDP and SDP with ``memory.tracker=false``: step time on vs off).

Each run is a real ``sdp-train`` job (:func:`sdp.bench.runs.run_one`) on the same model, data and
batch; figures are read from summary.json ``memory.per_rank[]`` (``setup_peak_bytes``,
``train_peak_bytes``, ``eval_peak_bytes``: live tensor bytes on CPU, the CUDA allocator on a GPU), each
on the rank where it is largest. Evaluation runs at the default ``train.eval_batch_size`` (larger than a
rank's validation shard here, so a rank evaluates its whole shard in one forward); ``--extra
train.eval_batch_size=N`` measures another.

    sdp-bench memory --out benchmarks/results/cpu-4ranks/memory
    sdp-bench memory --suite llama --extra cluster.device=cuda   # GPU figures
    sdp-bench memory --render-only --out benchmarks/results/cpu-4ranks/memory   # the tables again

``--render-only`` launches nothing: rows from the run directories under ``--out/SUITE``, the overrides
and provenance from the memory.json the runs left. The table: :func:`sdp.report.compare.memory_markdown`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sdp.bench.runs import ROOT, parser, recorded, run_one, split_spec
from sdp.report.compare import MEMORY_PEAKS, memory_markdown
from sdp.results.contract import provenance
from sdp.results.summary import Summary, read_summary

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
TARGETS = {"resnet18": {"train_peak_bytes": 0.65, "setup_peak_bytes": 0.60, "eval_peak_bytes": 1.0},
           "llama": {"train_peak_bytes": 0.60, "setup_peak_bytes": 0.60, "eval_peak_bytes": 1.0}}


def figures(s: Summary) -> dict[str, Any]:
    mem = s.memory_per_rank
    out: dict[str, Any] = {"strategy": s.strategy, "step_s": s.time["step_s_median"],
                           "peak_source": mem[0].get("peak_source")}
    for k in MEMORY_PEAKS:
        vals = [(m.get(k), m["rank"]) for m in mem if m.get(k) is not None]
        out[k], out[k.replace("_bytes", "_rank")] = max(vals) if vals else (None, None)
    full = max(mem, key=lambda m: m.get("train_peak_bytes") or 0)
    out["train_categories"] = (full.get("peak_categories") or {}).get("train")
    out["model_state_bytes"] = max(m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in mem)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(suite="memory", doc=__doc__)
    ap.add_argument("--suite", nargs="+", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--runs", nargs="+", default=RUNS, help="label=preset[,override,...]; needs ddp and sdp")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides appended to every run")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "memory")
    ap.add_argument("--render-only", action="store_true", help="re-render from the run directories under --out")
    args = ap.parse_args(argv)
    record = args.out / "memory.json"
    saved = recorded(record, render_only=args.render_only, what="the runs' overrides and provenance") or {}
    result: dict[str, Any] = {k: saved[k] for k in ("versions", "machine")} if saved else provenance()
    texts = []
    for suite in args.suite:
        common = saved[suite]["common"] if saved else SUITES[suite] + args.extra
        rows: dict[str, dict[str, Any]] = {}
        for label, run in map(split_spec, args.runs):
            s = read_summary(args.out / suite / label) if args.render_only else \
                run_one(label=label, spec=run, common=common, out=args.out / suite)
            assert s is not None, f"--render-only: no summary.json in {args.out / suite / label}"
            rows[label] = figures(s)
        text = memory_markdown(title=f"{suite}: {' '.join(SUITES[suite])}", rows=rows, targets=TARGETS[suite])
        print(text, flush=True)
        texts.append(text)
        result[suite] = {"common": common, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.md").write_text("\n\n".join(texts) + "\n")
    (args.out / "memory.json").write_text(json.dumps(result, indent=2))
    return result
