"""Checkpoint and resume: every rank continues bit for bit where it stopped.

Layout of ``<run_dir>/checkpoints/step_00000012/``:

- ``shared.pt`` (rank 0): the strategy's ``"shared"`` state (replicated parameters and optimizer
  state), the LR scheduler, the trainer's counters and the data-order key;
- ``rank00003.pt`` (every rank): the strategy's ``"local"`` state (rank-local buffers; SDP's held
  subnetwork; a pipeline stage) and the rank's RNG streams (torch CPU/CUDA, python, numpy);
- ``sharded/`` (strategies with DTensor state, FSDP2): ``torch.distributed.checkpoint`` files;
- ``meta.json``: step, world size, strategy, the data-order key and the LR schedule's keys
  (:data:`SCHEDULE_KEYS`), so a resume can be checked before anything is loaded.

Why no data-loader state: a global batch is a pure function of (seed, step) (``sdp.data.base``), so
the step *is* the data position; ``data_key`` records what that function depends on and a resume
with a different seed, batch or dataset size is refused. Why atomic: everything is written into
``step_N.tmp/`` and renamed by rank 0 after a barrier, so a crash mid-write never leaves a directory
that looks complete. Loading uses ``torch.load(weights_only=True)``: no arbitrary pickle.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdp import rng
from omegaconf import DictConfig, OmegaConf

from sdp.errors import ConfigError
from sdp.parallel.base import Strategy
from sdp.rundir import CHECKPOINT_PREFIX as PREFIX, CHECKPOINTS, RunDir, checkpoint_meta, run_of_checkpoint

# What the LR of every step depends on (sdp.trainer.lr_lambda over the resolved train.steps, which the
# budget sets): a resume with any of these changed would train on under a schedule it never started.
SCHEDULE_KEYS = ("train.steps", "train.budget", "optim.schedule", "optim.warmup_steps", "optim.min_lr_ratio",
                 "optim.optimizer.lr")


def step_dir(run_dir: Path, step: int) -> Path:
    return RunDir(run_dir).checkpoint(step)


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (a ``meta.json``, no ``.tmp`` suffix) of a run directory, by step."""
    root = RunDir(run_dir).checkpoints
    if not root.is_dir():
        return []
    found = [(int(p.name[len(PREFIX):]), p) for p in root.iterdir()
             if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and checkpoint_meta(p).exists()]
    return sorted(found)


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads(checkpoint_meta(path).read_text())


def resolve(*, resume: Any, run_dir: Path | None) -> Path | None:
    """``train.resume`` -> a checkpoint directory, or None for a fresh start.

    ``null``: fresh; ``auto``: the latest checkpoint of this run directory (fresh when there is none,
    so the same command line starts or resumes a job); a path: a checkpoint directory, or a run
    directory (this one re-used, or a previous run's) whose latest checkpoint is taken."""
    if resume is None or str(resume) in ("", "null", "none"):
        return None
    if str(resume) == "auto":
        found = checkpoints(run_dir) if run_dir is not None else []
        return found[-1][1] if found else None
    path = Path(str(resume)).expanduser().resolve()
    if checkpoint_meta(path).is_file():
        return path
    found = checkpoints(path)
    if found:
        return found[-1][1]
    why = "does not exist" if not path.exists() else "holds no complete checkpoint"
    raise ConfigError(
        f"train.resume={str(resume)!r} is invalid: {path} {why}; allowed: null, auto (latest checkpoint of "
        f"this run directory), a checkpoint directory (with meta.json) or a run directory with {CHECKPOINTS}/"
    )


def schedule_key(cfg: DictConfig) -> dict[str, Any]:
    """The values of :data:`SCHEDULE_KEYS` in ``cfg`` (recorded in ``meta.json``)."""
    return {key: OmegaConf.select(cfg, key) for key in SCHEDULE_KEYS}


def check_schedule(*, ckpt: Path, cfg: DictConfig) -> None:
    """Driver side of a resume: refuse a config whose LR schedule differs from the checkpoint's, naming the key.

    ``train.extend_steps=true`` is the one allowed change: a larger ``train.steps``, the LR following
    the schedule of the new ``train.steps`` from the checkpoint's step on (see :func:`restore_lr`)."""
    meta = read_meta(ckpt)
    then = meta.get("schedule")
    if then is None:
        return  # written before the schedule was recorded: nothing to compare with
    now, step, extend = schedule_key(cfg), int(meta["step"]), bool(cfg.train.extend_steps)
    for key in SCHEDULE_KEYS:
        if key == "train.steps" and extend:
            if not (isinstance(now[key], int) and now[key] > step):
                raise ConfigError(f"train.steps={now[key]!r} is invalid with train.extend_steps=true: {ckpt} is at step "
                                  f"{step}; allowed: more steps than that")
            continue
        if now[key] != then.get(key):
            more = (" or set train.extend_steps=true to train on to the new train.steps under its schedule"
                    if key == "train.steps" else "")
            raise ConfigError(
                f"{key}={now[key]!r} is invalid for resuming {ckpt}: the checkpoint was written with {key}={then.get(key)!r} "
                f"and the LR schedule depends on it; allowed: {key}={then.get(key)!r}{more}")


def restore_lr(scheduler: Any) -> None:
    """Set every group's LR (and ``get_last_lr``) to the schedule's value at the loaded step.

    After ``load_state_dict`` the optimizer and the scheduler hold the LR the checkpointed run
    computed with *its* lambda; under ``train.extend_steps`` the lambda is the new one, whose value
    at that step is what the next update must use (with an unchanged schedule it is the same number:
    ``LambdaLR`` computes exactly ``base_lr * lambda(last_epoch)``)."""
    lrs = [base * lam(scheduler.last_epoch) for lam, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)


def save(
    *, run_dir: Path, step: int, strategy: Strategy, scheduler: Any, train_state: dict[str, Any],
    data_key: dict[str, Any], keep: int, schedule: dict[str, Any] | None = None,
) -> Path:
    """Write this rank's part of the checkpoint of ``step``; collective (every rank calls it)."""
    ctx = strategy.ctx
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(ctx.world_size)
    state = strategy.checkpoint_state()
    if "sharded" in state:
        import torch.distributed.checkpoint as dcp

        dcp.save(state["sharded"], checkpoint_id=str(tmp / "sharded"))
    if ctx.rank == 0:
        torch.save({"shared": state.get("shared", {}), "scheduler": scheduler.state_dict(),
                    "train": train_state, "data_key": data_key}, tmp / "shared.pt")
    torch.save({"local": state.get("local", {}), "rng": rng.capture()}, tmp / f"rank{ctx.rank:05d}.pt")
    _barrier(ctx.world_size)
    if ctx.rank == 0:
        from sdp.loggers import stored_run_id

        meta = {"step": step, "world_size": ctx.world_size, "strategy": strategy.name, "data_key": data_key,
                "schedule": schedule, "wandb_run_id": stored_run_id(run_dir)}
        checkpoint_meta(tmp).write_text(json.dumps(meta, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load(*, path: Path, strategy: Strategy, scheduler: Any, data_key: dict[str, Any]) -> dict[str, Any]:
    """Restore strategy, scheduler and RNG streams from ``path``; returns the trainer's counters."""
    ctx = strategy.ctx
    meta = read_meta(path)
    for key, now, then in (("cluster.world_size", ctx.world_size, meta["world_size"]),
                           ("parallelism.name", strategy.name, meta["strategy"])):
        if now != then:
            raise ConfigError(f"{key}={now!r} is invalid for resuming {path}: the checkpoint was written with {then!r}")
    for key, now in data_key.items():
        if meta["data_key"].get(key) != now:
            raise ConfigError(f"{key}={now!r} is invalid for resuming {path}: the data order was "
                              f"{meta['data_key'].get(key)!r} when it was written (resume needs the same)")
    shared = torch.load(path / "shared.pt", map_location="cpu", weights_only=True)
    mine = torch.load(path / f"rank{ctx.rank:05d}.pt", map_location="cpu", weights_only=True)
    state: dict[str, Any] = {"shared": shared["shared"], "local": mine["local"]}
    if (path / "sharded").exists():
        import torch.distributed.checkpoint as dcp

        template = strategy.checkpoint_state()["sharded"]
        dcp.load(template, checkpoint_id=str(path / "sharded"))
        state["sharded"] = template
    strategy.load_checkpoint_state(state)
    scheduler.load_state_dict(shared["scheduler"])
    restore_lr(scheduler)
    rng.restore(mine["rng"])
    return shared["train"]


def prepare_run_dir(*, ckpt: Path, run_dir: Path) -> int:
    """Driver side of a resume: make ``run_dir/metrics.jsonl`` hold exactly the rows of steps up to
    the checkpoint (copied from the checkpoint's run when it is another one; rows a killed run logged
    after its checkpoint are dropped, so no step appears twice), and drop this run's checkpoints of
    later steps (a stale future). Returns the checkpoint's step."""
    step = int(read_meta(ckpt)["step"])
    rows = []
    src = run_of_checkpoint(ckpt).metrics
    if src.exists():
        for line in src.read_text().splitlines():
            try:
                if int(json.loads(line)["step"]) <= step:
                    rows.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a half-written last line of a killed run
    run_dir.mkdir(parents=True, exist_ok=True)
    dest = RunDir(run_dir).metrics
    tmp = dest.with_suffix(dest.suffix + ".tmp")
    tmp.write_text("".join(rows))
    os.replace(tmp, dest)
    for later, path in checkpoints(run_dir):
        if later > step:
            shutil.rmtree(path, ignore_errors=True)
    return step


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()
