"""Generic multi-rank test harness (not SDP-specific, despite the name).

- ``compose(overrides)``: the job config exactly as ``sdp-train`` composes it (Hydra compose API).
- ``run_job(overrides, run_dir)``: what ``sdp.train.run`` does (validate, write config, launch the
  ranks with the real elastic launcher) into ``run_dir``; returns (summary, metrics rows).
- ``spawn(fn, world_size, *args)``: runs ``fn(rank, world_size, *args)`` in ``world_size`` spawned
  gloo ranks (free port, 60 s collective timeout) and returns the ranks' return values in rank order.
- ``make_strategy(config, rank, world_size)``: inside a rank, the strategy set up as the worker does it.
"""

from __future__ import annotations

import io
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from sdp import results
from tests.dist_helpers import free_port, rank_process_group
from tests.hydra_cfg import compose_config

FAST = ["logger.wandb.mode=disabled", "logger.progress=false"]


def compose(overrides: list[str]) -> DictConfig:
    return compose_config(*FAST, *overrides)


def run_job(overrides: list[str], run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from sdp.config import validate
    from sdp.launch import launch

    cfg = compose(overrides)
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    results.write_config(cfg=cfg, run_dir=run_dir)
    summary = launch(cfg=cfg, run_dir=run_dir)
    assert summary is not None, f"no summary from rank 0 for {overrides}"
    return summary, results.read_metrics(run_dir)


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    with rank_process_group(rank, world, port):
        try:
            buf = io.BytesIO()  # torch.save, not the queue's pickler: shared-memory tensors die with the child
            torch.save(fn(rank, world, *args), buf)
            queue.put((rank, buf.getvalue(), None))
        except Exception:  # noqa: BLE001 - the parent re-raises with the rank's traceback
            queue.put((rank, None, traceback.format_exc()))


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, value, err = queue.get(timeout=timeout_s)
            if err is not None:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def make_strategy(config: dict[str, Any], rank: int, world_size: int) -> tuple[Any, Any, DictConfig]:
    """(strategy after setup, data bundle, cfg) for this rank, built exactly as sdp.worker does."""
    from sdp.parallel import STRATEGIES, DistContext
    from sdp.worker import build, build_model

    cfg = OmegaConf.create(config)
    data = build(cfg.dataset)
    ctx = DistContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    strategy = STRATEGIES.get(str(cfg.parallelism.name))(cfg=cfg.parallelism, full_cfg=cfg, ctx=ctx)
    model = build_model(cfg, data, meta=strategy.materialises_held)
    strategy.setup(model=model, optimizer_factory=lambda params: build(cfg.optim.optimizer)(params))
    return strategy, data, cfg


def batch(data: Any, cfg: DictConfig, *, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (the trainer's data order)."""
    from sdp.data.base import GlobalBatchSampler

    x_all, y_all = data.train.tensors
    sampler = GlobalBatchSampler(num_samples=len(data.train), global_batch=int(cfg.train.batch_size) * world_size, seed=int(cfg.seed))
    idx = sampler.shard(step, replica=rank, replicas=world_size)
    return x_all[idx], y_all[idx]


def config_dict(overrides: list[str]) -> dict[str, Any]:
    return OmegaConf.to_container(compose(overrides), resolve=True)  # type: ignore[return-value]
