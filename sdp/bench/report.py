"""The measurement report: run a set of strategies on one model/dataset/batch (each a real ``sdp-train``
job, :func:`sdp.bench.runs.run_one`), then write ``report.md`` (table with ratios to DDP, every figure
on the rank where it is largest), ``report.json``, ``machine.json`` and PNG plots: stacked memory by
category, comm bytes per step by kind, the step-time split, and loss against step and against wall-clock.

    sdp-bench report --suite resnet18 --out benchmarks/results/cpu-4ranks/resnet18
    sdp-bench report --suite llama --out benchmarks/results/cpu-4ranks/llama
    sdp-bench report --suite llama --render-only --out DIR     # re-render existing run dirs

``--render-only`` launches nothing: the figures come from the run directories, and the machine and
wall times from the report.json the runs left (when there is one), so a re-render of a committed
report is byte-identical. Per-run figures: :func:`sdp.report.runs.run_figures` (shared with the paper
tables); the table: :func:`sdp.report.compare.report_markdown`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from sdp.bench.runs import ROOT, parser, run_one, split_spec
from sdp.report.compare import REPORT_RATIOS, add_ratios, report_markdown
from sdp.report.plots import plot_row as row
from sdp.report.plots import plots
from sdp.report.runs import load_run, run_figures
from sdp.results.contract import machine, versions
from sdp.results.rundir import RunDir

# The command a report records: committed reports name the script path, which still runs this suite
# (benchmarks/report.py is a shim for ``sdp-bench report``); kept so that they re-render byte-identical.
COMMAND = "python benchmarks/report.py"
BASE = ["logger.wandb.mode=disabled", "logger.progress=false", "train.eval_every=0", "train.warmup_steps=3",
        "cluster.world_size=4"]
SUITES: dict[str, dict[str, list[str]]] = {
    "resnet18": {
        "common": [*BASE, "model=resnet18_cifar", "model.width=64", "dataset=synthetic", "dataset.image_size=32",
                   "train.batch_size=32", "train.steps=10"],
        "runs": ["ddp=ddp", "ddp_ac=ddp_ac", "fsdp=fsdp", "pipeline_1f1b=pipeline,parallelism.schedule=1f1b,parallelism.microbatches=4",
                 "sdp=sdp", "sdp_block_bwd=sdp_block_bwd", "sdp_neuron_fwd=sdp_neuron_fwd"],
    },
    "llama": {
        "common": [*BASE, "model=llama_tiny", "dataset=synthetic_text", "optim=adamw", "train.batch_size=16",
                   "train.steps=10"],
        "runs": ["ddp=ddp", "fsdp=fsdp", "sdp=sdp"],
    },
}
TITLE_KEYS = ("model", "model.width", "dataset", "train.batch_size", "cluster.world_size", "train.steps", "cluster.device")


def frontiers(rows: list[dict[str, Any]]) -> str:
    """For each forward-masked block-level SDP run, its plan's floor and frontier from its own config
    (``sdp-plan plan.frontier=true``): how far the measured fullest rank is from what any plan reaches."""
    from omegaconf import OmegaConf

    from sdp.planning.planner import frontier as sdp_frontier

    out = []
    for r in rows:
        cfg = OmegaConf.load(RunDir(Path(r["run_dir"])).config)
        if r["strategy"] == "sdp" and cfg.parallelism.masking == "forward" and cfg.parallelism.level == "block":
            out.append(f"\n\nRun {r['run']}: " + sdp_frontier(cfg)["text"])
    return "".join(out)


def machine_description() -> dict[str, Any]:
    info = {**machine(), "versions": versions(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(suite="report", doc=__doc__)
    ap.add_argument("--suite", choices=sorted(SUITES), default="resnet18")
    ap.add_argument("--runs", nargs="+", default=None, help="label=preset[,override,...] (default: the suite's)")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides added to the suite's common ones")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "report")
    ap.add_argument("--render-only", action="store_true", help="re-render from the run directories under --out")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole set N times, interleaved; step time is then "
                    "the median over the repeats (the other figures are exact and taken from the first)")
    args = ap.parse_args(argv)
    suite = SUITES[args.suite]
    specs = args.runs or suite["runs"]
    common = suite["common"] + args.extra
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    recorded = json.loads((out / "report.json").read_text()) if args.render_only and (out / "report.json").exists() else None
    started = time.time()
    seconds: dict[str, float] = {}
    labels = [split_spec(spec)[0] for spec in specs]
    for rep in range(args.repeat):  # interleaved: a drift in the machine's load hits every strategy alike
        for label, run in map(split_spec, specs):
            name = label if rep == 0 else f"{label}.rep{rep}"
            t0 = time.time()
            if not args.render_only:
                run_one(label=name, spec=run, common=common, out=out / "runs")
            seconds[name] = time.time() - t0
    rows = [row(label, out / "runs" / label) for label in labels]
    for r in rows:
        repeats = sorted((out / "runs").glob(f"{r['run']}.rep*"), key=lambda d: int(d.name.rsplit("rep", 1)[1]))
        r["step_s_repeats"] = [r["step_s"], *(run_figures(load_run(d).summary)["step_s"] for d in repeats)]
        r["step_s"] = statistics.median(r["step_s_repeats"])
    add_ratios(rows, keys=REPORT_RATIOS)
    title = f"{args.suite}: " + " ".join(o for o in common if o.split("=")[0] in TITLE_KEYS)
    table = report_markdown(rows, title=title) + frontiers(rows)
    files = plots(rows, out=out, title=args.suite)
    total = time.time() - started
    mach = machine_description()
    if recorded is not None:  # the machine and wall times of the runs, not of this re-render
        seconds, total, mach = recorded["seconds"], recorded["total_s"], recorded["machine"]
    (out / "machine.json").write_text(json.dumps(mach, indent=2, default=str))
    timed = not args.render_only or recorded is not None
    text = (table + f"\n\nPlots: {', '.join(f.name for f in files)}. Machine: {mach.get('cpu_model', mach.get('processor'))}, "
            f"{mach.get('cpu_count')} CPUs, gpus {mach.get('gpus', [])}, load average at the end {mach.get('load_average')}. "
            + (f"Whole report: {total:.0f} s (per run: {', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())})." if timed else "")
            + f"\n\nCommand: `{COMMAND} --suite {args.suite} {' '.join(args.extra)}"
            + (f" --repeat {args.repeat}" if args.repeat > 1 else "") + f" --out {out}`\n")
    (out / "report.md").write_text(text)
    report = {"suite": args.suite, "common": common, "runs": specs, "rows": rows, "seconds": seconds, "total_s": total,
              "machine": mach}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(text, flush=True)
    return report
