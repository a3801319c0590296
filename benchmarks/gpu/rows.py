"""The rows and verdicts of ``benchmarks/gpu/h200_check.sh``, appended to its results file one at a time.

Why append-only and one call per run: the check runs on a lent GPU under a hard time limit; whatever
finished before a kill must already be in the file. Each sub-command appends and exits:

- ``floor``: ``sdp-plan``'s prediction (:func:`sdp.planning.planner.predict`, in process) of DDP's and SDP's
  model state for the run's config, and the floor SDP at its coverage cannot go below there, because
  every rank holds the parts outside the blocks (the LLaMA stem and head). Written to ``floor.json``.
- ``row``: one run's line of the table from its summary.json (or its exit code and last error line).
- ``verdict``: one of the issue's checks from the runs it needs (``memory``, ``fsdp_setup``,
  ``device_figures``, ``tf32``, ``deterministic``, ``bn``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

MIB = 2**20
COLUMNS = ["run", "rc", "s", "ranks", "backend", "alloc peak MiB (train, max rank)", "max reserved MiB",
           "device used MiB (whole GPU)", "set-up peak MiB", "model state MiB", "activations MiB", "tokens/s",
           "tf32 matmul", "eval loss", "note"]


def append(results: Path, text: str) -> None:
    with results.open("a") as f:
        f.write(text.rstrip("\n") + "\n")


def summary(runs: Path, name: str) -> dict[str, Any] | None:
    path = runs / name / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def _max(per_rank: list[dict[str, Any]], key: str) -> int | None:
    vals = [m[key] for m in per_rank if m.get(key) is not None]
    return max(vals) if vals else None


def state(s: dict[str, Any]) -> int:
    """The largest rank's model state: parameters, gradients, optimizer state."""
    return max(m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in s["memory"]["per_rank"])


def _mib(v: int | float | None) -> str:
    return "-" if v is None else f"{v / MIB:.0f}" if v >= 100 * MIB else f"{v / MIB:.2f}"


def backend(runs: Path, name: str) -> str:
    """The run's process-group backend as its recorded config says (cluster.backend, auto resolved by device)."""
    from omegaconf import OmegaConf

    path = runs / name / "config.yaml"
    if not path.exists():
        return "-"
    c = OmegaConf.load(path).cluster
    return str(c.backend) if str(c.backend) != "auto" else ("nccl" if str(c.device) == "cuda" else "gloo")


def table_open(results: Path) -> bool:
    """Whether the file ends inside a table (a verdict or note since the last row closes it)."""
    lines = results.read_text().rstrip("\n").splitlines() if results.exists() else []
    return bool(lines) and lines[-1].startswith("|")


def last_error(log: Path) -> str:
    """The last line of the log that names an error (what a row says when there is no summary)."""
    if not log.exists():
        return "no log"
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"Error|error:|refused|Killed|Traceback", ln)]
    return (errs or lines or ["empty log"])[-1][:200].replace("|", "/")


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
                 "-" if not s["time"].get("tokens_per_s") else f"{s['time']['tokens_per_s']:.0f}", (s.get("backends") or {}).get("tf32_matmul", "not recorded"),
                 "-" if s["final"].get("eval_loss") is None else f"{s['final']['eval_loss']:.4f}", ""]
    append(a.results, "| " + " | ".join(str(c) for c in cells) + " |")


def cmd_floor(a: argparse.Namespace) -> None:
    """The plan's DDP and SDP model state for the check's config, and their ratio: the floor."""
    import torch  # the package comes from the checkout: h200_check.sh puts it on PYTHONPATH
    from hydra import compose, initialize_config_dir

    from sdp.planning.planner import predict
    from sdp.registry import build
    from sdp.driver.train import CONF_DIR

    def plan(extra: list[str]) -> dict[str, Any]:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return predict(compose(config_name="config", overrides=[*a.overrides, *extra]))

    ddp, sdp = plan(a.ddp), plan(a.sdp)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(a.overrides))
    with torch.device("meta"):
        model = build(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    st = {k: max(m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in p["memory"]["per_rank"])
          for k, p in (("ddp", ddp), ("sdp", sdp))}
    floor = st["sdp"] / st["ddp"]
    out = {"floor": floor, "ddp_state_bytes": st["ddp"], "sdp_state_bytes": st["sdp"], "params": total,
           "params_outside_blocks": total - blocks}
    (a.runs / "floor.json").write_text(json.dumps(out, indent=1))
    append(a.results, f"\nPlan floor ({' '.join(a.sdp)} vs DDP, from sdp-plan): largest rank's model state "
                      f"{_mib(st['sdp'])} / {_mib(st['ddp'])} MiB = **{floor:.3f}x**; {(total - blocks) / 1e6:.1f} M of "
                      f"{total / 1e6:.1f} M parameters are outside the blocks (stem, head) and held by every rank.\n")


def _verdict(a: argparse.Namespace, ok: bool | None, text: str) -> None:
    mark = {True: "PASS", False: "FAIL", None: "n/a"}[ok]
    append(a.results, f"\n- **{a.kind}: {mark}** {text}")


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
        peak = [_max(s["memory"]["per_rank"], "cuda_max_allocated_bytes") or _max(s["memory"]["per_rank"], "train_peak_bytes")
                for s in (sdp, ddp)]
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
        return _verdict(a, gap < 0.01, f"eval.bn=average at C=1: {need[1]} eval loss {sdp:.4f} vs {need[0]} {ddp:.4f} "
                                       f"(relative gap {gap:.2e}; stale statistics after the move to the GPU show as a large gap)")
    raise SystemExit(f"unknown verdict {a.kind!r}")


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
    f = sub.add_parser("floor")
    f.add_argument("--ddp", nargs="+", required=True)
    f.add_argument("--sdp", nargs="+", required=True)
    f.add_argument("overrides", nargs="*")
    v = sub.add_parser("verdict")
    v.add_argument("kind", choices=["memory", "fsdp_setup", "device_figures", "tf32", "deterministic", "bn"])
    v.add_argument("need", nargs="*")
    a = ap.parse_args(argv)
    a.runs.mkdir(parents=True, exist_ok=True)
    {"header": cmd_header, "row": cmd_row, "floor": cmd_floor, "verdict": cmd_verdict}[a.cmd](a)


if __name__ == "__main__":
    main()
