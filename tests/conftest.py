"""Shared test helpers: run ``sdp-train`` as a real subprocess (the real Hydra app and launcher) into a
temporary directory and read back the results contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    """A finished ``sdp-train`` process and the directory its results went to."""

    proc: subprocess.CompletedProcess
    run_dir: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def sdp_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["WANDB_MODE"] = "disabled"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_train(run_dir: Path, *overrides: str, timeout: float = 240, check: bool = True, multirun: bool = False) -> Job:
    """``python -m sdp.train`` with ``overrides`` writing into ``run_dir`` (sweep dir for multirun)."""
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    cmd = [sys.executable, "-m", "sdp.train", *(["-m"] if multirun else []), f"{dir_key}={run_dir}",
           "logger.wandb.mode=disabled", "logger.progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=sdp_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"sdp.train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return Job(proc=proc, run_dir=run_dir)


@pytest.fixture
def train_job(tmp_path: Path):
    """Factory fixture: ``train_job("parallelism=ddp", ...)`` runs a job into a fresh tmp dir."""
    counter = iter(range(1000))

    def make(*overrides: str, **kw) -> Job:
        return run_train(tmp_path / f"run{next(counter)}", *overrides, **kw)

    return make

