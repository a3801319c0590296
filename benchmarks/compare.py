"""Side-by-side strategy benchmark: each strategy is a real ``sdp-train`` job on the same model,
data and batch; one table of measured model-state bytes, communication and step time, with ratios
to the first run (DDP by default). Other strategies (FSDP, pipeline, DDP+AC) are added as run specs.

Run spec: ``label=preset[,override,...]`` (``preset`` is a ``conf/parallelism`` name), e.g.
``sdp_c25=sdp,parallelism.coverage=0.25``. ``--common`` overrides apply to every run.

Default = issue 3's benchmark: 4 ranks, resnet18_cifar width 64, batch 32 per rank, synthetic 32x32,
DDP vs sdp vs sdp_block_bwd vs sdp_neuron_fwd:

    PYTHONPATH=$PWD python benchmarks/compare.py --out outputs/bench/sdp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sdp.report.runs import run_figures  # noqa: E402
from sdp.report.stats import ratio  # noqa: E402
from sdp.summary import Summary, read_summary  # noqa: E402

DEFAULT_RUNS = ["ddp=ddp", "sdp=sdp", "sdp_block_bwd=sdp_block_bwd", "sdp_neuron_fwd=sdp_neuron_fwd"]
DEFAULT_COMMON = ["model=resnet18_cifar", "model.width=64", "dataset=synthetic", "dataset.image_size=32",
                  "train.batch_size=32", "cluster.world_size=4", "train.steps=12", "train.warmup_steps=3",
                  "train.eval_every=0", "logger.wandb.mode=disabled", "logger.progress=false"]


def run_one(*, label: str, spec: str, common: list[str], out: Path, root: Path = ROOT) -> Summary:
    """One ``sdp-train`` job into ``out/label``, its summary; ``root``: the source tree it runs (another checkout: an earlier commit)."""
    preset, *extra = spec.split(",")
    run_dir = Path(out).resolve() / label
    cmd = [sys.executable, "-m", "sdp.train", f"parallelism={preset}", *common, *extra, f"hydra.run.dir={run_dir}"]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": f"{root}:{os.environ.get('PYTHONPATH', '')}", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run {label} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    summary = read_summary(run_dir)
    assert summary is not None, f"run {label} exited 0 but wrote no readable summary.json in {run_dir}"
    return summary


ROW_FIGURES = ("model_state_bytes", "param_bytes", "grad_optim_bytes", "comm_bytes_per_step", "wire_bytes_per_step",
               "collectives_per_step", "straggler_spread", "peak_rss_delta_bytes")


def row(label: str, s: Summary) -> dict[str, Any]:
    """Per-rank maxima of what each rank really held and sent (the straggler rank decides):
    :func:`sdp.report.runs.run_figures`, the figures every report takes."""
    fig = run_figures(s)
    return {"run": label, "strategy": s.strategy, **{k: fig[k] for k in ROW_FIGURES}, "step_s_median": fig["step_s"],
            "eval_accuracy": s.final.eval_accuracy,  # a fraction here (run_figures: percent)
            "eval_assembled_bytes": s.strategy_info.get("eval_assembled_bytes", s.strategy_info.get("eval_full_copy_bytes"))}


RATIOS = ("model_state_bytes", "grad_optim_bytes", "comm_bytes_per_step", "wire_bytes_per_step", "step_s_median")


def add_ratios(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    for r in rows:
        for k in RATIOS:
            r[f"{k}_x"] = ratio(r[k], base[k])


def markdown(rows: list[dict[str, Any]]) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    ratio = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    head = ("| run | model state MiB (x) | grad+optim MiB (x) | comm MiB/step (x) | wire MiB/step (x) | "
            "collectives/step | step s (x) | straggler | accuracy |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        acc = "n/a" if r["eval_accuracy"] is None else f"{r['eval_accuracy']:.4f}"
        lines.append(
            f"| {r['run']} | {mib(r['model_state_bytes'])} ({ratio(r['model_state_bytes_x'])}) | "
            f"{mib(r['grad_optim_bytes'])} ({ratio(r['grad_optim_bytes_x'])}) | "
            f"{mib(r['comm_bytes_per_step'])} ({ratio(r['comm_bytes_per_step_x'])}) | "
            f"{mib(r['wire_bytes_per_step'])} ({ratio(r['wire_bytes_per_step_x'])}) | "
            f"{r['collectives_per_step']:.1f} | {r['step_s_median']:.4f} ({ratio(r['step_s_median_x'])}) | "
            f"{r['straggler_spread']:.3f} | {acc} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="label=preset[,override,...]; the first is the baseline")
    ap.add_argument("--common", nargs="*", default=DEFAULT_COMMON, help="overrides for every run")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides appended to --common (keeps the defaults)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "compare")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.runs:
        label, _, rest = spec.partition("=")
        rows.append(row(label, run_one(label=label, spec=rest or label, common=args.common + args.extra, out=args.out)))
    add_ratios(rows)
    table = markdown(rows)
    print(table, flush=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "table.json").write_text(json.dumps({"common": args.common + args.extra, "runs": args.runs, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
