"""Committed results can be reproduced: ``sdp-rerun`` re-runs a recorded run from its own config.yaml,
and on CPU a committed reference run comes back bit for bit (if this fails after a change of the
numerics, re-run the committed results: ``python benchmarks/report.py --suite llama --out
benchmarks/results/cpu-4ranks/llama``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sdp.rerun import rerun_argv
from tests.helpers import CORE, REPO, sdp_env

COMMITTED = REPO / "benchmarks" / "results" / "cpu-4ranks" / "llama" / "runs" / "ddp"


def test_rerun_puts_the_budget_base_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 20, "budget": "flops"}}))
    (run / "summary.json").write_text(json.dumps({"budget": {"budget": "flops", "base_steps": 10, "steps": 20}}))
    args = rerun_argv(run_dir=run, out=tmp_path / "again", overrides=["seed=1"])
    assert args[:2] == [f"--config-path={run.resolve()}", "--config-name=config"]
    assert "train.steps=10" in args and "train.resume=null" in args and args[-1] == "seed=1", args
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        rerun_argv(run_dir=tmp_path, out=tmp_path / "x", overrides=[])


@pytest.mark.dist
@CORE  # committed results match the code (issue 17)
@pytest.mark.timeout(300)
def test_committed_run_reruns_bit_for_bit(tmp_path: Path) -> None:
    recorded = json.loads((COMMITTED / "summary.json").read_text())
    out = tmp_path / "rerun"
    proc = subprocess.run([sys.executable, "-m", "sdp.rerun", str(COMMITTED), "--out", str(out),
                           "logger.wandb.mode=disabled", "logger.progress=false"],
                          cwd=REPO, env=sdp_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads((out / "summary.json").read_text())
    assert again["final"] == recorded["final"], (again["final"], recorded["final"], recorded["versions"])
    losses = lambda d: [r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "loss" in r]  # noqa: E731
    assert losses(out) == losses(COMMITTED)
