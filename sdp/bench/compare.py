"""Side-by-side strategy benchmark, the table alone: each strategy is a real ``sdp-train`` job on the
same model, data and batch; one table of measured model-state bytes, communication and step time,
with ratios to the first run (DDP by default). ``sdp-bench report`` adds plots, the memory split and
the plan's floor for the same runs.

Run spec: ``label=preset[,override,...]`` (``preset`` is a ``conf/parallelism`` name), e.g.
``sdp_c25=sdp,parallelism.coverage=0.25``. ``--common`` overrides apply to every run.

Default = issue 3's benchmark: 4 ranks, resnet18_cifar width 64, batch 32 per rank, synthetic 32x32,
DDP vs sdp vs sdp_block_bwd vs sdp_neuron_fwd:

    sdp-bench compare --out outputs/bench/sdp
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sdp.bench.runs import ROOT, parser, run_one, split_spec
from sdp.report.compare import COMPARE_RATIOS, add_ratios, compare_markdown
from sdp.report.runs import run_figures
from sdp.results.summary import Summary

DEFAULT_RUNS = ["ddp=ddp", "sdp=sdp", "sdp_block_bwd=sdp_block_bwd", "sdp_neuron_fwd=sdp_neuron_fwd"]
DEFAULT_COMMON = ["model=resnet18_cifar", "model.width=64", "dataset=synthetic", "dataset.image_size=32",
                  "train.batch_size=32", "cluster.world_size=4", "train.steps=12", "train.warmup_steps=3",
                  "train.eval_every=0", "logger.wandb.mode=disabled", "logger.progress=false"]
ROW_FIGURES = ("model_state_bytes", "param_bytes", "grad_optim_bytes", "comm_bytes_per_step", "wire_bytes_per_step",
               "collectives_per_step", "straggler_spread", "peak_rss_delta_bytes")


def row(label: str, s: Summary) -> dict[str, Any]:
    """Per-rank maxima of what each rank really held and sent (the straggler rank decides):
    :func:`sdp.report.runs.run_figures`, the figures every report takes."""
    fig = run_figures(s)
    return {"run": label, "strategy": s.strategy, **{k: fig[k] for k in ROW_FIGURES}, "step_s_median": fig["step_s"],
            "eval_accuracy": s.final.eval_accuracy,  # a fraction here (run_figures: percent)
            "eval_assembled_bytes": s.strategy_info.get("eval_assembled_bytes", s.strategy_info.get("eval_full_copy_bytes"))}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = parser(suite="compare", doc=__doc__)
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="label=preset[,override,...]; the first is the baseline")
    ap.add_argument("--common", nargs="*", default=DEFAULT_COMMON, help="overrides for every run")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides appended to --common (keeps the defaults)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "compare")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.runs:
        label, run = split_spec(spec)
        rows.append(row(label, run_one(label=label, spec=run, common=args.common + args.extra, out=args.out)))
    add_ratios(rows, keys=COMPARE_RATIOS, base=rows[0])
    table = compare_markdown(rows)
    print(table, flush=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "table.json").write_text(json.dumps({"common": args.common + args.extra, "runs": args.runs, "rows": rows}, indent=2))
    return rows
