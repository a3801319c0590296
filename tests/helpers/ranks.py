"""Spawned gloo ranks for tests below the job level: a free port, the launcher variables, one thread,
a process group with a timeout, every rank's return value (or its traceback) back in the test, and
inside a rank the strategy and batches exactly as ``sdp.rank.worker`` and the trainer make them.

Why ``torch.multiprocessing`` spawn rather than a whole job: these tests drive a strategy step by
step and look at its gradients, pieces and groups, which a job does not return.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from tests.helpers.jobs import PG_TIMEOUT_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def rank_process_group(rank: int, world: int, port: int) -> Iterator[None]:
    """Inside a spawned test rank: its launcher variables, one thread, a gloo group with a timeout."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="disabled")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    with rank_process_group(rank, world, port):
        try:
            buf = io.BytesIO()  # torch.save, not the queue's pickler: shared-memory tensors die with the child
            torch.save(fn(rank, world, *args), buf)
            queue.put((rank, buf.getvalue(), None))
        except Exception:  # noqa: BLE001 - the parent re-raises with the rank's traceback
            queue.put((rank, None, traceback.format_exc()))


def spawn(fn: Callable[..., Any], *, world: int, args: tuple = (), timeout_s: float = 240) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks (process group initialised) and
    return the ranks' return values in rank order; the first failing rank's traceback is raised, and
    a rank that answers nothing within ``timeout_s`` fails the test."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value, err = queue.get(timeout=timeout_s)
            if err is not None:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def make_strategy(config: dict[str, Any], rank: int, world_size: int) -> tuple[Any, Any, DictConfig]:
    """(strategy after setup, data bundle, cfg) for this rank, built exactly as sdp.rank.worker does."""
    from sdp.parallel import STRATEGIES, DistContext, JobFacts
    from sdp.registry import build
    from sdp.rank.worker import build_model

    cfg = OmegaConf.create(config)
    data = build(cfg.dataset)
    ctx = DistContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    strategy = STRATEGIES.get(str(cfg.parallelism.name)).runtime(cfg=cfg.parallelism, job=JobFacts.of(cfg), ctx=ctx)
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
