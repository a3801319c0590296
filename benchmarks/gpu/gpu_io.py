"""What the GPU check's rows and verdicts read and write: run folders (summary, plan, log) and the results file,
appended to, never rewritten (a kill on the lent GPU must lose only what had not run)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any


MIB = 2**20


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


def _opt(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


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



def plan(runs: Path, name: str) -> dict[str, Any] | None:
    path = runs / f"{name}.plan.json"
    return json.loads(path.read_text()) if path.exists() else None



def _verdict(a: argparse.Namespace, ok: bool | None, text: str) -> None:
    mark = {True: "PASS", False: "FAIL", None: "n/a"}[ok]
    append(a.results, f"\n- **{a.kind}: {mark}** {text}")
