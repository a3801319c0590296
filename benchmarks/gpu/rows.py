"""The rows and verdicts of ``benchmarks/gpu/h200_check.sh``, appended to its results file one at a time.

Why append-only and one call per run: the check runs on a lent GPU under a hard time limit; whatever
finished before a kill must already be in the file. Each sub-command appends and exits:

- ``plan``: ``sdp-plan``'s prediction (:func:`sdp.planning.planner.predict`, in process) for a run, before it
  runs, with the run's own overrides; written beside the run as ``NAME.plan.json``.
- ``floor``: from the DDP and SDP runs' plans, the model-state floor SDP at its coverage cannot go below,
  because every rank holds the parts outside the blocks (the LLaMA stem and head). Written to ``floor.json``.
- ``row``: one run's line of the table from its summary.json (or its exit code and last error line).
- ``verdict``: one of the checks from the runs it needs (``memory``, ``fsdp_setup``, ``device_figures``,
  ``tf32``, ``deterministic``, ``bn``, ``peaks``: measured against predicted peaks, ``mfu``: step time and MFU
  of the whole model and of one SDP worker's share of it, ``ac``: activation checkpointing's training-peak
  ratio, measured against predicted, ``groups``: the NCCL communicator life cycle of
  ``nccl_groups.py``).
- ``caveats``: which of the figures mean nothing when several ranks share one GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from checks import cmd_caveats, cmd_groups, cmd_verdict
from gpu_io import _max, _mib, _opt, append, backend, last_error, plan, state, summary, table_open

COLUMNS = ["run", "rc", "s", "ranks", "backend", "alloc peak MiB (train, max rank)", "max reserved MiB",
           "device used MiB (whole GPU)", "set-up peak MiB", "model state MiB", "activations MiB", "tokens/s",
           "step ms", "MFU", "tf32 matmul", "eval loss", "note"]


def cmd_header(a: argparse.Namespace) -> None:
    if not a.results.exists() or a.results.stat().st_size == 0:
        append(a.results, "# One-GPU check (benchmarks/gpu/h200_check.sh)\n\nWhat each section checks: the "
                          "script's header. Rows are appended as runs finish; a section without its verdicts was cut short.")
    append(a.results, f"\n## {a.title}\n\n" + "\n".join(a.line or []))


def cmd_row(a: argparse.Namespace) -> None:
    if not table_open(a.results):  # rows between two verdicts form a table of their own
        append(a.results, "\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    s = summary(a.runs, a.name)
    if s is None:
        cells = [a.name, a.rc, a.secs] + ["-"] * (len(COLUMNS) - 4) + [last_error(a.runs / f"{a.name}.log")]
    else:
        mem = s["memory"]["per_rank"]
        acts = _max(mem, "activation_bytes")
        cells = [a.name, a.rc, a.secs, s["world_size"], backend(a.runs, a.name), _mib(_max(mem, "cuda_max_allocated_bytes")),
                 _mib(_max(mem, "cuda_max_reserved_bytes")), _mib(_max(mem, "cuda_device_used_bytes")),
                 _mib(_max(mem, "setup_peak_bytes")), _mib(state(s)), _mib(acts),
                 "-" if not s["time"].get("tokens_per_s") else f"{s['time']['tokens_per_s']:.0f}",
                 _opt(s["time"].get("step_s_median"), ".1f", 1e3), _opt(s["time"].get("mfu"), ".3f"),
                 (s.get("backends") or {}).get("tf32_matmul", "not recorded"),
                 "-" if s["final"].get("eval_loss") is None else f"{s['final']['eval_loss']:.4f}", ""]
    append(a.results, "| " + " | ".join(str(c) for c in cells) + " |")


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from sdp.driver.train import CONF_DIR  # the package comes from the checkout: h200_check.sh puts it on PYTHONPATH

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def cmd_plan(a: argparse.Namespace) -> None:
    """The run's prediction, made before it runs from the same overrides (the planner the user runs)."""
    from sdp.planning.planner import predict

    (a.runs / f"{a.name}.plan.json").write_text(json.dumps(predict(_compose(list(a.overrides))), indent=1))


def cmd_floor(a: argparse.Namespace) -> None:
    """The plan's DDP and SDP model state for the check's config, and their ratio: the floor."""
    import torch

    from sdp.registry import build

    with torch.device("meta"):
        model = build(_compose(list(a.overrides)).model)
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    plans = {k: plan(a.runs, n) for k, n in (("ddp", a.ddp), ("sdp", a.sdp))}
    if None in plans.values():
        raise SystemExit(f"floor: no {a.ddp}.plan.json / {a.sdp}.plan.json in {a.runs}: run `rows.py plan` for both first")
    st = {k: state(p) for k, p in plans.items()}
    floor = st["sdp"] / st["ddp"]
    out = {"floor": floor, "ddp_state_bytes": st["ddp"], "sdp_state_bytes": st["sdp"], "params": total,
           "params_outside_blocks": total - blocks}
    (a.runs / "floor.json").write_text(json.dumps(out, indent=1))
    append(a.results, f"\nPlan floor ({a.sdp} vs {a.ddp}, from sdp-plan): largest rank's model state "
                      f"{_mib(st['sdp'])} / {_mib(st['ddp'])} MiB = **{floor:.3f}x**; {(total - blocks) / 1e6:.1f} M of "
                      f"{total / 1e6:.1f} M parameters are outside the blocks (stem, head) and held by every rank.\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--runs", type=Path, required=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("header")
    h.add_argument("--title", required=True)
    h.add_argument("--line", action="append")
    r = sub.add_parser("row")
    r.add_argument("--name", required=True)
    r.add_argument("--rc", required=True)
    r.add_argument("--secs", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--name", required=True)
    p.add_argument("overrides", nargs="*")
    f = sub.add_parser("floor")
    f.add_argument("--ddp", required=True, help="the DDP run's name (its NAME.plan.json)")
    f.add_argument("--sdp", required=True, help="the SDP run's name")
    f.add_argument("overrides", nargs="*")
    v = sub.add_parser("verdict")
    v.add_argument("kind", choices=["memory", "fsdp_setup", "device_figures", "tf32", "deterministic", "bn", "peaks", "mfu", "ac"])
    v.add_argument("need", nargs="*")
    g = sub.add_parser("groups")
    g.set_defaults(kind="groups")
    c = sub.add_parser("caveats")
    c.set_defaults(kind="caveats")
    a = ap.parse_args(argv)
    a.runs.mkdir(parents=True, exist_ok=True)
    {"header": cmd_header, "row": cmd_row, "plan": cmd_plan, "floor": cmd_floor, "verdict": cmd_verdict,
     "groups": cmd_groups, "caveats": cmd_caveats}[a.cmd](a)


if __name__ == "__main__":
    main()
