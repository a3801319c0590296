"""What every benchmark suite runs through: the repository, the config ``sdp-train`` composes, an
``sdp-train`` job (or multirun) in a child process, and a function on ranks started by torch elastic.

Why one module: each suite used to carry its own copy (three rank spawners with their own port
picking, a job runner imported under two spellings, a ``sys.path`` edit per script). A suite that
measures a training job runs :func:`run_one`, the real ``sdp-train`` with its launcher, so what it
measures is what a user runs; a suite that must drive a strategy step by step inside the ranks
(capacity, evaluation protocols, the hand-written DDP loop) runs :func:`spawn_ranks`, started by the
same torch elastic agent as ``sdp-train``'s local launcher (:mod:`sdp.driver.launch`), failures reported the
same way (:func:`sdp.driver.launch.root_cause`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from sdp.results.summary import Summary, read_summary

ROOT = Path(__file__).resolve().parents[2]  # the checkout: conf/, benchmarks/results/, outputs/
PG_TIMEOUT_S = 1800.0  # torch's own default for gloo: a rank that waits longer than this is stuck


def parser(*, suite: str, doc: str | None) -> argparse.ArgumentParser:
    """A suite's argument parser, named as it is called (``sdp-bench SUITE``), its help the module docstring."""
    return argparse.ArgumentParser(prog=f"sdp-bench {suite}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def compose(overrides: list[str]) -> DictConfig:
    """The job config ``sdp-train`` composes from ``conf/`` with ``overrides`` (no ``hydra:`` node)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from sdp.driver.train import CONF_DIR  # also registers the resolvers the config uses

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def sdp_train(args: list[str], *, root: Path = ROOT, capture: bool = False,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m sdp.driver.train ARGS`` in ``root`` (another checkout runs an earlier commit's code), its
    output captured or streamed; the caller decides what a non-zero exit means."""
    pythonpath = f"{root}:{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else str(root)
    return subprocess.run([sys.executable, "-m", "sdp.driver.train", *args], cwd=root, capture_output=capture, text=True,
                          env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})})


def recorded(path: Path, *, render_only: bool, what: str) -> dict[str, Any] | None:
    """Under ``--render-only`` the JSON a suite wrote at ``path`` (``what`` it holds), else None; a missing
    file stops with its path, so a re-render never silently measures again."""
    if not render_only:
        return None
    if not path.exists():
        raise SystemExit(f"--render-only: no {path} ({what}) under --out {path.parent}")
    return json.loads(path.read_text())


def split_spec(spec: str) -> tuple[str, str]:
    """``label=preset[,override,...]`` -> (label, ``preset[,override,...]``); a bare label names its preset."""
    label, _, rest = spec.partition("=")
    return label, rest or label


def run_one(*, label: str, spec: str, common: list[str], out: Path, root: Path = ROOT) -> Summary:
    """One ``sdp-train`` job into ``out/label`` and its summary; ``spec``: ``preset[,override,...]``
    (a ``conf/parallelism`` name and the overrides of this run only), after the ``common`` ones. A suite measures
    again: the label's previous run in ``out`` is replaced (``sdp-train`` refuses a fresh start into a directory
    holding a run, :func:`sdp.driver.sweep.refuse_used_dir`; committed results stay in git)."""
    preset, *extra = spec.split(",")
    run_dir = Path(out).resolve() / label
    if run_dir.exists():
        shutil.rmtree(run_dir)
    args = [f"parallelism={preset}", *common, *extra, f"hydra.run.dir={run_dir}"]
    print("$", sys.executable, "-m sdp.driver.train", " ".join(args), flush=True)
    proc = sdp_train(args, root=root, capture=True, env={"WANDB_MODE": "disabled"})
    if proc.returncode != 0:
        raise SystemExit(f"run {label} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    summary = read_summary(run_dir)
    assert summary is not None, f"run {label} exited 0 but wrote no readable summary.json in {run_dir}"
    return summary


@record  # a rank's exception is written where the agent reads it: the traceback comes back to the caller
def _rank_entry(fn: Callable[..., Any], threads: int, timeout_s: float, args: tuple) -> Any:
    """Inside a rank: ``threads`` intra-op threads, a gloo group over the agent's rendezvous, ``fn``."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        return fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], *, world: int, args: tuple = (), threads: int = 1,
                timeout_s: float = PG_TIMEOUT_S) -> dict[int, Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks (a gloo group initialised, ``threads``
    threads each) and return every rank's value by rank. ``fn`` must be importable (a module-level
    function). When a rank fails, the others are stopped and the first failure's traceback is raised."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from sdp.driver.launch import root_cause

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"sdp-bench-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn", logs_specs=DefaultLogsSpecs())
    try:
        return dict(elastic_launch(config, _rank_entry)(fn, threads, timeout_s, args))
    except ChildFailedError as exc:
        rank, failure, message = root_cause(exc.failures)
        raise RuntimeError(f"rank {rank} of {world} failed (exit code {failure.exitcode}):\n{message}") from None
