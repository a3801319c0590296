"""Whole jobs through the real driver: in this process (``run_job``) or as ``python -m sdp.driver.train``
(``run_train``), and the config ``sdp-train`` composes (``compose``, ``config_dict``).

Why both: ``run_job`` calls :func:`sdp.driver.train.run`, what the Hydra app calls once Hydra has composed the
config, so the slurm environment, validation with its preflight, the budget, ``skip_done``, resume,
``config.yaml``, the elastic launcher and ``failure.json`` all run, without a second interpreter
importing torch for the driver. ``run_train`` is the whole command line (Hydra's app and launchers,
multirun sweeps, callbacks, exit codes and output) for tests about those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tests.hydra_cfg import compose_config

REPO = Path(__file__).resolve().parents[2]
QUIET = ["logger.wandb.mode=disabled", "logger.progress=false"]  # no W&B files, no progress bar
PG_TIMEOUT_S = 60  # process-group timeout of in-process jobs and spawned ranks: a hang fails within a minute
TOKEN_ENV = "SDP_TEST_TOKEN"  # set in every subprocess job: finds its processes still alive afterwards


def compose(overrides: list[str], *, hydra: bool = False) -> DictConfig:
    """The config ``sdp-train`` composes for ``overrides`` (W&B and progress bar off, 60 s collective
    timeout); ``hydra=True`` keeps the ``hydra:`` node."""
    return compose_config(*QUIET, f"cluster.timeout_s={PG_TIMEOUT_S}", *overrides, hydra=hydra)


def config_dict(overrides: list[str]) -> dict[str, Any]:
    """``compose`` resolved to plain containers: what a rank receives (``sdp.rank.worker.run_rank``)."""
    return OmegaConf.to_container(compose(overrides), resolve=True)  # type: ignore[return-value]


def run_job(overrides: list[str], *, run_dir: Path, world: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One job through :func:`sdp.driver.train.run` into ``run_dir`` (``world``: ``cluster.world_size``): the
    driver as ``sdp-train`` runs it (validation, preflight, budget, resume, config.yaml, the elastic
    launcher) with the config ``sdp-train`` composes; returns (summary.json, metrics.jsonl rows). A
    failing rank raises ``sdp.driver.launch.RankFailure``."""
    from sdp.driver.train import run

    cfg = compose([*overrides, *([f"cluster.world_size={world}"] if world is not None else [])])
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = run(cfg, run_dir=run_dir)
    assert summary is not None, f"no summary from rank 0 for {overrides} in {run_dir}"
    return json.loads((run_dir / "summary.json").read_text()), read_rows(run_dir)


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def train_losses(rows: list[dict[str, Any]]) -> list[float]:
    """The training loss of every logged step (metrics rows that have one)."""
    return [r["loss"] for r in rows if "loss" in r]


@dataclass
class TrainProcess:
    """A finished ``python -m sdp.driver.train`` process and the directory its results went to."""

    proc: subprocess.CompletedProcess
    run_dir: Path
    token: str  # the job's TOKEN_ENV value: ``survivors(job.token)`` lists its processes still alive
    ended: float  # time.time() when the process had exited

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        return read_rows(self.run_dir)

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def sdp_env(*, token: str | None = None) -> dict[str, str]:
    """This environment for a child ``sdp`` process: this checkout first on the path, W&B off, no rank
    variables of an enclosing launcher, unbuffered output (and ``TOKEN_ENV`` if given)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["WANDB_MODE"] = "disabled"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    if token is not None:
        env[TOKEN_ENV] = token
    return env


def run_train(run_dir: Path, *overrides: str, timeout: float = 240, check: bool = True, multirun: bool = False) -> TrainProcess:
    """``python -m sdp.driver.train`` with ``overrides`` writing into ``run_dir`` (the sweep dir for multirun);
    ``check``: raise, with the output's tail, unless it exits 0."""
    dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    cmd = [sys.executable, "-m", "sdp.driver.train", *(["-m"] if multirun else []), f"{dir_key}={run_dir}", *QUIET, *overrides]
    token = uuid.uuid4().hex
    proc = subprocess.run(cmd, cwd=REPO, env=sdp_env(token=token), capture_output=True, text=True, timeout=timeout)
    ended = time.time()
    if check and proc.returncode != 0:
        raise AssertionError(f"sdp.driver.train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return TrainProcess(proc=proc, run_dir=Path(run_dir), token=token, ended=ended)


def survivors(token: str) -> list[str]:
    """The processes (``pid: cmdline``) whose environment holds ``TOKEN_ENV=token``: what a job left alive,
    wherever it was re-parented."""
    import psutil

    time.sleep(1.0)  # the agent reaps asynchronously; give a killed tree a moment to vanish
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get(TOKEN_ENV) == token:
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found
