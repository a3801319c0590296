"""``sdp-bench one-model-scale``: issue 39's memory target (every training phase <= 0.60x DDP's peak) at the scale
users run, predicted by ``sdp-plan``: LLaMA 1B as the paper trains it and Llama-3.1-8B's shape (stepped by torch's
default foreach AdamW and by torchtitan's fused one), bf16 under AdamW on 8 GPUs, each phase of the one-model
remedies beside the same-memory alternatives; and the LM study's own shape, whose measured peaks check the planner.

Why: the CPU study measures the phases on a tiny model whose activations are most of DDP's peak, so there DDP with
activation checkpointing is far below 0.60x and every checkpointed phase with it. At paper scale the model state
(fp32 master weights, gradients and AdamW's two moments) is a larger share, so both the target and the order of the
methods can change; a verdict on memory must be read at the shapes it is about. Nothing runs: every figure is
``sdp-plan``'s (live tensors, CUDA rules; anchored against torchtitan's measured Llama-3.1-8B by
``sdp-bench memory-anchor``), the fullest rank's, the same as ``sdp-plan <SHAPE> <METHOD> cluster.device=cuda`` prints.
Predicted, not measured: the measured CPU peaks are the LM study's report.

    sdp-bench one-model-scale --out benchmarks/results/one-model-scale                # predict, then write both files
    sdp-bench one-model-scale --out benchmarks/results/one-model-scale --render-only  # the markdown again from the JSON
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sdp.bench.memory_anchor import LLAMA3_8B, predicted_phase
from sdp.bench.remedies import MOONSHOT_PEAK
from sdp.bench.runs import compose
from sdp.results.contract import provenance

RESULT = Path("one-model-scale") / "one_model_scale.json"  # under benchmarks/results, where --out puts it
GPU = ["optim=adamw", "train.precision=bf16", "cluster.world_size=8", "cluster.device=cuda", "dataset=synthetic_text"]
CPU_SHAPE = "CPU study"
# the LM study's own model and run (fp32, 4 gloo ranks: the shape whose peaks the study measures, so the planner is
# checked against them), the paper's LLaMA run (conf/experiment/paper_llama_fineweb.yaml: GPT-2 vocabulary, 1024
# tokens, 8 sequences per worker) and Llama-3.1-8B's shape (torchtitan's llama3 8B flavor, as
# sdp.bench.memory_anchor) at the same batch
SHAPES = {
    CPU_SHAPE: ["experiment=cpu_study_lm_automaton"],
    "LLaMA 1B": [*GPU, "model=llama_1b", "dataset.vocab_size=50257", "dataset.seq_len=1024", "train.batch_size=8"],
    "Llama-3.1-8B": [*GPU, *LLAMA3_8B, "dataset.vocab_size=128256", "dataset.seq_len=1024", "train.batch_size=8"],
}
# torchtitan steps AdamW with the fused kernel (its optimizer.implementation default); torch's default, foreach,
# holds a gradient-sized float32 temporary per step, which at 8B without sharding is a visible share of the peak
SHAPES["Llama-3.1-8B, fused AdamW"] = [*SHAPES["Llama-3.1-8B"], "+optim.optimizer.fused=true"]
WORKER_DEPTH = "DDP at a worker's depth (half the blocks)"  # the row whose shape has half its blocks (half_depth)
# (row, overrides, the phase's memory key): the remedies' phases (B-SDP C = 0.5), then what a user could run instead
PHASES = [
    ("B-SDP C=0.5 (fixed plan; phase 1 of every remedy)", ["variant=b_sdp_c50"], "train_peak_bytes"),
    ("consolidation phase (backward masking + AC)", ["variant=b_sdp_c50_cons30"], "consolidate_peak_bytes"),
    ("consolidation phase + distillation", ["variant=b_sdp_c50_cons20_kd50"], "consolidate_peak_bytes"),
    (WORLD := "consolidation phase, world-averaged gradients", ["variant=b_sdp_c50_cons50_wavg"], "consolidate_peak_bytes"),
    (CALIBRATION := "calibration phase", ["variant=b_sdp_c50_cal"], "calibrate_peak_bytes"),
    ("B-SDP C=0.5 + AC", ["variant=b_sdp_c50_ac"], "train_peak_bytes"),
    ("B_β-SDP C=0.5 (one model, no AC)", ["variant=bb_sdp_c50"], "train_peak_bytes"),
    ("DDP", ["variant=ddp"], "train_peak_bytes"),
    ("DDP+AC", ["variant=ddp_ac"], "train_peak_bytes"),
    ("FSDP+AC", ["variant=fsdp_ac"], "train_peak_bytes"),
    (WORKER_DEPTH, ["variant=ddp"], "train_peak_bytes"),
]


def predicted(overrides: list[str], key: str) -> dict[str, float]:
    """The fullest rank's predicted peak of the phase ``key`` and its model state (GiB), from ``sdp-plan``."""
    peak, state = predicted_phase(overrides, key=key)
    return {"peak_gib": peak, "model_state_gib": state}


def half_depth(shape: list[str]) -> list[str]:
    """``shape`` with half its blocks (one B-SDP C = 0.5 worker's depth), read from the composed model."""
    return [*shape, f"model.n_layers={int(compose(shape).model.n_layers) // 2}"]


def grid() -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for shape, shape_over in SHAPES.items():
        out[shape] = {}
        for row, over, key in PHASES:
            base = half_depth(shape_over) if row == WORKER_DEPTH else shape_over
            out[shape][row] = predicted([*base, *over], key)
        for row in out[shape].values():  # each phase over DDP's peak at the same shape, computed here once
            row["x_ddp"] = row["peak_gib"] / out[shape]["DDP"]["peak_gib"]
    return out


def size(gib: float) -> str:
    """GiB, or MiB below one GiB (the CPU study's model is a few MiB)."""
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"


def render(results: dict[str, Any]) -> str:
    lines = ["# Issue 39's memory target at paper scale (predicted by sdp-plan, not measured)", "",
             f"Each row: the fullest rank's predicted training peak of one phase (`sdp-plan`, CUDA rules, live tensors), "
             f"over DDP's at the same shape; the target is ≤ {MOONSHOT_PEAK:.2f}x in every phase. Shapes: "
             + "; ".join(f"{s}: `{' '.join(o)}`" for s, o in SHAPES.items())
             + f" ({CPU_SHAPE}: the LM study's own, whose peaks its report measures)"
             + ". Written by `sdp-bench one-model-scale --out benchmarks/results/one-model-scale` "
             "(sdp/bench/one_model_scale.py says why).", ""]
    shapes = list(results["grid"])
    lines += ["| phase or method | " + " | ".join(f"{s}: peak | {s}: x DDP | {s}: ≤ {MOONSHOT_PEAK:.2f}x"
                                                   for s in shapes) + " |",
              "|---|" + "---|---|---|" * len(shapes)]
    for row, _, _ in PHASES:
        cells = []
        for s in shapes:
            cell = results["grid"][s][row]
            cells += [size(cell["peak_gib"]), f"{cell['x_ddp']:.3f}", "yes" if cell["x_ddp"] <= MOONSHOT_PEAK else "no"]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += ["", "Model state (fp32 weights, gradients, AdamW moments; the fullest rank): "
              + "; ".join(f"{s}: DDP {size(results['grid'][s]['DDP']['model_state_gib'])}, B-SDP C=0.5 "
                          f"{size(results['grid'][s][PHASES[0][0]]['model_state_gib'])}" for s in shapes) + ".",
              "", f"Commit: {results['provenance']['versions'].get('git_commit')}"
              + (" with uncommitted changes" if results["provenance"]["versions"].get("git_dirty") else "") + "."]
    return "\n".join(lines) + "\n"


def context_line(*, results_root: Path) -> list[str]:
    """The LM study report's lines on this suite (none before it was run): the planner's phases at the study's own
    shape (beside the measured ones), and each paper shape's consolidation phase, DDP+AC and FSDP+AC, so that the
    CPU verdict's memory half is read beside the shapes it is about."""
    path = results_root / RESULT
    if not path.is_file():
        return []
    g, link = json.loads(path.read_text())["grid"], f"[{RESULT.with_suffix('.md').name}](../../{RESULT.with_suffix('.md').as_posix()})"
    x = lambda s, row: f"{g[s][row]['x_ddp']:.3f}x" if row in g[s] else "not predicted"  # noqa: E731  (a row added later)
    own = [f"sdp-plan's prediction at this study's own shape ({link}), x DDP's predicted peak, beside the measured "
           f"columns above: phase 1 {x(CPU_SHAPE, PHASES[0][0])}, consolidation {x(CPU_SHAPE, PHASES[1][0])}, with "
           f"distillation {x(CPU_SHAPE, PHASES[2][0])}, with world-averaged gradients {x(CPU_SHAPE, WORLD)}, calibration "
           f"{x(CPU_SHAPE, CALIBRATION)}; DDP+AC {x(CPU_SHAPE, 'DDP+AC')}."] if CPU_SHAPE in g else []
    parts = [f"{s}: consolidation phase {x(s, PHASES[1][0])} (world-averaged {x(s, WORLD)}), DDP+AC {x(s, 'DDP+AC')}, "
             f"FSDP+AC {x(s, 'FSDP+AC')}" for s in g if s != CPU_SHAPE]
    return [*own, *([""] if own and parts else []),
            *([f"At paper scale, predicted by sdp-plan (not measured; bf16, AdamW, 8 GPUs, every phase: {link}): "
               + "; ".join(parts) + "."] if parts else [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sdp-bench one-model-scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for one_model_scale.md and one_model_scale.json")
    ap.add_argument("--render-only", action="store_true", help="write one_model_scale.md again from its JSON")
    args = ap.parse_args(argv)
    if args.render_only:
        results = json.loads((args.out / RESULT.name).read_text())
    else:
        results = {"shapes": SHAPES, "grid": grid(), "provenance": provenance()}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULT.name).write_text(json.dumps(results, indent=1, default=str))
    (args.out / "one_model_scale.md").write_text(render(results))
    print(render(results))
    return 0
