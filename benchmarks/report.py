"""The measurement report: run a set of strategies on one model/dataset/batch (via
``benchmarks/compare.py``'s ``run_one``, each a real ``sdp-train`` job), then write ``report.md``
(table with ratios to DDP, every figure on the rank where it is largest), ``report.json``,
``machine.json`` and PNG plots: stacked memory by category, comm bytes per step by kind, the step-time
split, and loss against step and against wall-clock.

    PYTHONPATH=$PWD python benchmarks/report.py --suite resnet18 --out benchmarks/results/cpu-4ranks/resnet18
    PYTHONPATH=$PWD python benchmarks/report.py --suite llama --out benchmarks/results/cpu-4ranks/llama
    PYTHONPATH=$PWD python benchmarks/report.py --render-only --out DIR     # re-render existing run dirs

Per-run figures come from :func:`sdp.report.runs.run_figures` (shared with the paper tables).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compare import ROOT, run_one  # noqa: E402
from sdp.report.plots import plot_row as row  # noqa: E402
from sdp.report.plots import plots  # noqa: E402
from sdp.report.runs import load_run, run_figures  # noqa: E402
from sdp.report.stats import ratio  # noqa: E402
from sdp.results import machine, versions  # noqa: E402
from sdp.rundir import RunDir  # noqa: E402

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
RATIO_KEYS = ("model_state_bytes", "activation_bytes", "peak_bytes", "comm_bytes_per_step", "wire_bytes_per_step", "step_s",
              "model_state_mean_bytes", "activation_mean_bytes")


def add_ratios(rows: list[dict[str, Any]], *, reference: str = "ddp") -> None:
    base = next((r for r in rows if r["strategy"] == reference), rows[0])
    for r in rows:
        r["x_ddp"] = {k: ratio(r.get(k), base.get(k)) for k in RATIO_KEYS}


def markdown(rows: list[dict[str, Any]], *, title: str) -> str:
    mib = lambda b: "" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    x = lambda r, k: "" if r["x_ddp"].get(k) is None else f" ({r['x_ddp'][k]:.3f}x)"  # noqa: E731
    opt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    head = ("| run | model state MiB | activations MiB | peak MiB | comm MiB/step | wire MiB/step | step s (median) | "
            "straggler | samples/s | tokens/s | MFU | eval loss |")
    lines = [f"### {title}", "", head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['run']} | {mib(r['model_state_bytes'])}{x(r, 'model_state_bytes')} | {mib(r['activation_bytes'])}{x(r, 'activation_bytes')} | "
            f"{mib(r['peak_bytes'])}{x(r, 'peak_bytes')} | {mib(r['comm_bytes_per_step'])}{x(r, 'comm_bytes_per_step')} | "
            f"{mib(r['wire_bytes_per_step'])}{x(r, 'wire_bytes_per_step')} | {opt(r['step_s'], '.4f')}{x(r, 'step_s')} | "
            f"{opt(r['straggler_spread'], '.3f')} | {opt(r['samples_per_s'], '.1f')} | {opt(r['tokens_per_s'], '.0f')} | "
            f"{opt(r['mfu'], '.3f')} | {opt(r['eval_loss'], '.4f')} |")
    kind = rows[0]["peak_kind"] if rows else ""
    lines += ["", f"Every figure on the rank where it is largest; ratios to DDP in parentheses. Model state = params + "
              f"grads + optimizer state; activations = bytes saved for backward in the first measured step; peak = {kind}; "
              "step s = the slowest rank's median step time (warm-up excluded; with --repeat, the median over the "
              "repeats); straggler = max/min of per-rank medians. "
              "SDP's transient evaluation assembly (its largest part) is reported apart (report.json: eval_assembled_bytes)."]
    if rows and len(rows[0]["step_s_repeats"]) > 1:
        base = next((r for r in rows if r["strategy"] == "ddp"), rows[0])
        lines += ["", "| run | step s per interleaved repeat | ratio to the same repeat's DDP |", "|---|---|---|"]
        lines += [f"| {r['run']} | {', '.join(f'{v:.4f}' for v in r['step_s_repeats'])} | "
                  f"{', '.join(f'{ratio(v, b):.3f}x' for v, b in zip(r['step_s_repeats'], base['step_s_repeats']))} |" for r in rows]
    lines += ["", "| run | model state MiB: fullest rank | mean over ranks | activations MiB: fullest rank | mean over ranks |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {mib(r['model_state_bytes'])}{x(r, 'model_state_bytes')} | {mib(r['model_state_mean_bytes'])}"
              f"{x(r, 'model_state_mean_bytes')} | {mib(r['activation_bytes'])}{x(r, 'activation_bytes')} | "
              f"{mib(r['activation_mean_bytes'])}{x(r, 'activation_mean_bytes')} |" for r in rows]
    lines += ["", "The mean over ranks is the floor of the fullest rank: when every unit is held by the same number of "
              "workers, the sum over ranks does not depend on which worker holds which unit (exactly for model state; "
              "for activations up to how neighbouring dropped blocks interact), so no assignment puts the fullest "
              "rank below the mean. `sdp-plan parallelism=sdp plan.frontier=true ...` scores every "
              "assignment and prints the frontier between the two figures."]
    return "\n".join(lines)


def frontiers(rows: list[dict[str, Any]]) -> str:
    """For each forward-masked block-level SDP run, its plan's floor and frontier from its own config
    (``sdp-plan plan.frontier=true``): how far the measured fullest rank is from what any plan reaches."""
    from omegaconf import OmegaConf

    from sdp.planner import frontier as sdp_frontier

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
        info["load_average"] = list(__import__("os").getloadavg())
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    started = time.time()
    seconds: dict[str, float] = {}
    labels = [spec.partition("=")[0] for spec in specs]
    for rep in range(args.repeat):  # interleaved: a drift in the machine's load hits every strategy alike
        for spec, label in zip(specs, labels):
            name = label if rep == 0 else f"{label}.rep{rep}"
            t0 = time.time()
            if not args.render_only:
                run_one(label=name, spec=spec.partition("=")[2] or label, common=common, out=out / "runs")
            seconds[name] = time.time() - t0
    rows = [row(label, out / "runs" / label) for label in labels]
    for r in rows:
        repeats = sorted((out / "runs").glob(f"{r['run']}.rep*"), key=lambda d: int(d.name.rsplit("rep", 1)[1]))
        r["step_s_repeats"] = [r["step_s"], *(run_figures(load_run(d).summary)["step_s"] for d in repeats)]
        r["step_s"] = statistics.median(r["step_s_repeats"])
    add_ratios(rows)
    title = f"{args.suite}: " + " ".join(o for o in common if o.split("=")[0] in (
        "model", "model.width", "dataset", "train.batch_size", "cluster.world_size", "train.steps", "cluster.device"))
    table = markdown(rows, title=title) + frontiers(rows)
    files = plots(rows, out=out, title=args.suite)
    total = time.time() - started
    mach = machine_description()
    (out / "machine.json").write_text(json.dumps(mach, indent=2, default=str))
    text = (table + f"\n\nPlots: {', '.join(f.name for f in files)}. Machine: {mach.get('cpu_model', mach.get('processor'))}, "
            f"{mach.get('cpu_count')} CPUs, gpus {mach.get('gpus', [])}, load average at the end {mach.get('load_average')}. "
            + ("" if args.render_only else f"Whole report: {total:.0f} s (per run: {', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}).")
            + f"\n\nCommand: `python benchmarks/report.py --suite {args.suite} {' '.join(args.extra)}"
            + (f" --repeat {args.repeat}" if args.repeat > 1 else "") + f" --out {out}`\n")
    (out / "report.md").write_text(text)
    report = {"suite": args.suite, "common": common, "runs": specs, "rows": rows, "seconds": seconds, "total_s": total,
              "machine": mach}
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(text, flush=True)
    return report


if __name__ == "__main__":
    main()
