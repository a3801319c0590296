"""Helpers for the multi-rank (gloo) tests: spawn ranks on a free port, run whole jobs through the
real worker, and capture the gradients an optimizer sees.

Why spawn with ``torch.multiprocessing`` rather than the elastic launcher: the same code path below
``run_rank`` is exercised (the worker, the trainer, summary.json), one rank's exception reaches the
test as ``ProcessRaisedException`` within seconds, and a process-group timeout of 60 s (plus
pytest-timeout on every test) turns a hang into a failure.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf
from tests.hydra_cfg import compose_config

PG_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set_env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="disabled")


@contextmanager
def rank_process_group(rank: int, world: int, port: int) -> Iterator[None]:
    """Inside a spawned test rank: its launcher variables, one thread, a gloo group with a timeout."""
    _set_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    with rank_process_group(rank, world, port):
        fn(rank, world, *args)


def spawn(fn: Callable[..., None], *, world: int, args: tuple = ()) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (process group already initialised)."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def compose_cfg(overrides: list[str]) -> DictConfig:
    """The config ``sdp-train`` would compose for these overrides (W&B and progress bar off)."""
    base = ["logger.wandb.mode=disabled", "logger.progress=false", "cluster.timeout_s=60"]
    return compose_config(*base, *overrides)


def _job(rank: int, world: int, port: int, config: dict, run_dir: str) -> None:
    _set_env(rank, world, port)
    from sdp.worker import run_rank

    run_rank(config, run_dir)


def run_job(overrides: list[str], *, world: int, run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Validate and run one training job on ``world`` ranks; returns (summary.json, metrics rows)."""
    from sdp.config import validate

    cfg = compose_cfg([*overrides, f"cluster.world_size={world}"])
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    mp.spawn(_job, args=(world, free_port(), config, str(run_dir)), nprocs=world, join=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return summary, rows


def train_losses(rows: list[dict[str, Any]]) -> list[float]:
    return [r["loss"] for r in rows if "loss" in r]


class CapturingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of every gradient it is asked to apply (the synchronised ones)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.captured: list[torch.Tensor | None] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.captured = [None if p.grad is None else p.grad.detach().clone()
                         for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def reference_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the mean cross-entropy over the whole batch in one process (the ground truth)."""
    from sdp.trainer import loss_fn

    model.zero_grad()
    loss_fn(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def small_mlp(*, depth: int) -> torch.nn.Module:
    """The tiny residual MLP the strategy gradient tests use (seeded: identical on every rank)."""
    from sdp.models.mlp import MLP

    torch.manual_seed(0)
    return MLP(num_classes=10, input_shape=(1, 4, 4), dim=16, hidden=24, depth=depth)


def global_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` seeded 1x4x4 inputs with labels: the global batch every rank slices."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 10, (n,), generator=g)

