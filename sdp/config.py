"""One validation pass over the resolved config, run in the driver before any rank starts.

Why up front: a typo must cost seconds, not a cluster allocation. Every error names the key, the
value and what is allowed (torchtitan's ``ParallelDims`` validation is the model).
"""

from __future__ import annotations

from typing import Any, Iterable

from omegaconf import DictConfig


class ConfigError(ValueError):
    """A config value that cannot work; the message names key, value and what is allowed."""


def fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        fail(key, value, allowed)


def one_of(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    require(value in allowed, key, value, f"allowed: {', '.join(map(str, allowed))}")


def positive_int(key: str, value: Any, *, minimum: int = 1) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key, value,
            f"must be an integer >= {minimum}")


def positive_float(key: str, value: Any) -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, key, value,
            "must be a number > 0")


def validate(cfg: DictConfig) -> None:
    """Check everything that can be checked without starting a rank."""
    from sdp.launch import external_launcher
    from sdp.parallel import STRATEGIES

    one_of("parallelism.name", cfg.parallelism.name, STRATEGIES.names())
    cl = cfg.cluster
    positive_int("cluster.world_size", cl.world_size)
    one_of("cluster.device", cl.device, ("cpu", "cuda"))
    one_of("cluster.backend", cl.backend, ("auto", "gloo", "nccl"))
    positive_float("cluster.timeout_s", cl.timeout_s)
    if external_launcher():
        import os

        env_world = int(os.environ["WORLD_SIZE"])
        require(env_world == cl.world_size, "cluster.world_size", cl.world_size,
                f"the external launcher started WORLD_SIZE={env_world} ranks; set cluster.world_size={env_world}")
    if cl.device == "cuda":
        import torch

        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        require(n_gpu > 0, "cluster.device", cl.device, "no CUDA device is visible on this machine; use cluster.device=cpu")
        if not external_launcher():
            require(cl.backend != "nccl" or cl.world_size <= n_gpu, "cluster.world_size", cl.world_size,
                    f"NCCL needs one GPU per rank and {n_gpu} are visible; use cluster.backend=gloo to share a GPU")
    if cl.device == "cpu":
        require(cl.backend != "nccl", "cluster.backend", cl.backend, "NCCL needs cluster.device=cuda; use gloo or auto on CPU")
    tc = cfg.train
    positive_int("train.steps", tc.steps)
    positive_int("train.batch_size", tc.batch_size)
    positive_int("train.eval_batch_size", tc.eval_batch_size)
    positive_int("train.eval_every", tc.eval_every, minimum=0)
    positive_int("train.log_every", tc.log_every)
    positive_int("train.warmup_steps", tc.warmup_steps, minimum=0)
    positive_int("train.num_workers", tc.num_workers, minimum=0)
    positive_int("train.checkpoint_every", tc.checkpoint_every, minimum=0)
    one_of("train.resume", tc.resume, ("never", "auto"))
    positive_int("seed", cfg.seed, minimum=0)
    positive_float("optim.optimizer.lr", cfg.optim.optimizer.lr)
    one_of("optim.schedule", cfg.optim.schedule, ("constant", "cosine", "linear"))
    positive_int("optim.warmup_steps", cfg.optim.warmup_steps, minimum=0)
    one_of("logger.wandb.mode", cfg.logger.wandb.mode, ("online", "offline", "disabled"))
    STRATEGIES.get(cfg.parallelism.name).validate(cfg=cfg.parallelism, world_size=int(cl.world_size))
    from sdp.data.common import preflight

    preflight(cfg.dataset)  # dataset files: a missing root or a bad shard fails here, named, before any rank
