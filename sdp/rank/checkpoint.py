"""Checkpoint and resume: every rank continues bit for bit where it stopped.

Layout of ``<run_dir>/checkpoints/step_00000012/``:

- ``shared.pt`` (rank 0): the strategy's ``"shared"`` state (parameters and optimizer state of a strategy
  whose replicas are identical, ``Strategy.replicas_identical``), the LR scheduler, the trainer's counters
  and the data-order key;
- ``rank00003.pt`` (every rank): the strategy's ``"local"`` state (rank-local buffers; a replica that may
  differ from the others; SDP's held subnetwork; a pipeline stage), the rank's RNG streams (torch CPU/CUDA,
  python, numpy) and its ``record``: what the rank has measured so far (comm records, memory peaks,
  activation bytes), which a resumed run continues, so its summary counts the whole run as the
  uninterrupted run's does;
- ``sharded/`` (strategies with DTensor state, FSDP2): ``torch.distributed.checkpoint`` files;
- ``meta.json``: step, world size, strategy, the data-order key, the values of :data:`RESUME_KEYS`
  (LR schedule, optimizer and model hyper-parameters), the trainer's counters (``train``: step, last loss,
  last evaluation, samples seen, skipped steps), rank 0's ``strategy_info`` (what its summary would write: a
  summary rebuilt from the final checkpoint reads it) and every file's size and SHA-256
  (:mod:`sdp.rank.checkpoint_io`), so a resume can be checked, and the checkpoint found whole, before anything
  is loaded.

Why no data-loader state: a global batch is a pure function of (seed, step) (``sdp.data.base``), so
the step *is* the data position; ``data_key`` records what that function depends on and a resume
with a different seed, batch or dataset size is refused. Why atomic: everything is written into
``step_N.tmp/`` and renamed by rank 0 after a barrier, so a crash mid-write never leaves a directory
that looks complete; a file damaged afterwards is found by its checksum before a resume, and
``train.resume=auto`` falls back to the previous whole checkpoint (:mod:`sdp.driver.checkpoint_resume`, the
driver's side of a resume). Every wait of a save is on a gloo group of its own with
``train.checkpoint_timeout_s`` (:mod:`sdp.rank.checkpoint_io` says why). Loading uses
``torch.load(weights_only=True)``: no arbitrary pickle.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from sdp.rank import checkpoint_io, rng
from omegaconf import DictConfig, OmegaConf

from sdp.errors import ConfigError
from sdp.parallel.base import Strategy
from sdp.results.rundir import CHECKPOINT_PREFIX as PREFIX, SHARED_FILE, RunDir, checkpoint_meta, rank_file

# What a resume must share with the checkpoint it continues, each with why: recorded in meta.json
# (resume_key) and compared by the driver before any rank starts (sdp.driver.checkpoint_resume.check_resume), which
# names the first key that differs. A node (model, optim.optimizer) stands for every key under it.
_SCHEDULE = "the LR schedule depends on it (sdp.rank.schedule.lr_lambda over the resolved train.steps, which the budget sets)"
RESUME_KEYS: dict[str, str] = {
    **dict.fromkeys(("train.steps", "train.budget", "optim.schedule", "optim.warmup_steps", "optim.min_lr_ratio",
                     "optim.optimizer.lr"), _SCHEDULE),
    "optim.optimizer": "the resumed optimizer takes its hyper-parameters from the checkpoint (load_state_dict "
                       "restores param_groups), so a new value would be recorded in config.yaml and never used",
    "model": "the checkpoint's weights and optimizer state are those of that model",
}
RESUME_KEY = "resume_key"  # meta.json: {key: value} of RESUME_KEYS, nodes flattened (a leaf per key)
STRATEGY_INFO = "strategy_info"  # meta.json: Strategy.info() of rank 0 at the checkpoint (sdp.driver.finished)
TRAIN = "train"  # meta.json (and shared.pt): the trainer's counters, readable without loading a tensor (sdp.driver.finished)


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


def resume_key(cfg: DictConfig) -> dict[str, Any]:
    """The values of :data:`RESUME_KEYS` in ``cfg``, resolved, a node as one entry per leaf (lists are
    leaves), in that order (recorded in ``meta.json``)."""
    out: dict[str, Any] = {}

    def leaves(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for sub, v in value.items():
                leaves(f"{key}.{sub}", v)
        else:
            out.setdefault(key, value)  # optim.optimizer.lr: listed on its own and under optim.optimizer

    for key in RESUME_KEYS:
        value = OmegaConf.select(cfg, key)
        leaves(key, OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)
    return out


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
    data_key: dict[str, Any], keep: int, resume_key: dict[str, Any] | None = None, timeout_s: float | None = None,
    record: dict[str, Any] | None = None,
) -> Path:
    """Write this rank's part of the checkpoint of ``step``; collective (every rank calls it). ``record``: this
    rank's measurements so far (the trainer's :meth:`~sdp.rank.trainer.Trainer.record`), handed back by :func:`load`.

    Every rank hashes what it writes; rank 0 gathers the hashes into meta.json. ``timeout_s``
    (``train.checkpoint_timeout_s``): every wait of the save is on :func:`sdp.rank.checkpoint_io.io_group`;
    None waits on the default group (its ``cluster.timeout_s``), see :class:`sdp.rank.checkpoint_io.Waits`."""
    ctx = strategy.ctx
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    waits = checkpoint_io.Waits(world_size=ctx.world_size, rank=ctx.rank, step=step, timeout_s=timeout_s)
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    waits.barrier()
    state = strategy.checkpoint_state()
    if "sharded" in state:
        import torch.distributed.checkpoint as dcp

        with waits.naming():  # each rank writes its shards; DCP's own waits are on the checkpoint group
            dcp.save(state["sharded"], checkpoint_id=str(tmp / "sharded"), process_group=waits.group)
    written: dict[str, dict[str, Any]] = {}
    if ctx.rank == 0:
        written[SHARED_FILE] = checkpoint_io.save_hashed(
            obj={"shared": state.get("shared", {}), "scheduler": scheduler.state_dict(), "train": train_state,
                 "data_key": data_key}, path=tmp / SHARED_FILE)
    mine = rank_file(ctx.rank)
    written[mine] = checkpoint_io.save_hashed(
        obj={"local": state.get("local", {}), "rng": rng.capture(device=ctx.device), "record": record}, path=tmp / mine)
    written = waits.gather(mine=written)  # rank 0 gets every rank's hashes; the others wait here for rank 0's write
    if ctx.rank == 0:
        from sdp.results.loggers import stored_run_id

        meta = {"step": step, "world_size": ctx.world_size, "strategy": strategy.name, "data_key": data_key,
                RESUME_KEY: resume_key, "wandb_run_id": stored_run_id(run_dir), TRAIN: train_state,
                STRATEGY_INFO: strategy.info(), checkpoint_io.FILES: checkpoint_io.record(root=tmp, known=written)}
        checkpoint_meta(tmp).write_text(json.dumps(meta, indent=2, default=str))  # default: as summary.json writes it
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    waits.barrier()  # no rank runs ahead into a training collective (cluster.timeout_s) while rank 0 finishes
    return final


def load(*, path: Path, strategy: Strategy, scheduler: Any,
         data_key: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore strategy, scheduler and RNG streams from ``path``; returns the trainer's counters and this rank's
    ``record`` (None from a checkpoint written before records were kept)."""
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
    shared = torch.load(path / SHARED_FILE, map_location="cpu", weights_only=True)
    mine = torch.load(path / rank_file(ctx.rank), map_location="cpu", weights_only=True)
    state: dict[str, Any] = {"shared": shared["shared"], "local": mine["local"]}
    if (path / "sharded").exists():
        import torch.distributed.checkpoint as dcp

        template = strategy.checkpoint_state()["sharded"]
        dcp.load(template, checkpoint_id=str(path / "sharded"))
        state["sharded"] = template
    strategy.load_checkpoint_state(state)
    scheduler.load_state_dict(shared["scheduler"])
    restore_lr(scheduler)
    rng.restore(mine["rng"], device=ctx.device)
    return shared["train"], mine.get("record")


def io_timeout_s(cfg: DictConfig) -> Any:
    """``train.checkpoint_timeout_s`` as set (:func:`sdp.driver.config.validate_train` checks it is a number > 0); a
    config written before the key (a re-run of a recorded run) waits ``cluster.timeout_s``, as its checkpoints did."""
    return cfg.train.get("checkpoint_timeout_s", cfg.cluster.timeout_s)


VERDICT_POLL_S = 0.5  # how often a process waiting for the resume verdict looks for it


def release_verdicts(*, run_dir: Path, attempt: str, world_size: int, timeout_s: float) -> None:
    """Rank 0: remove the resume verdicts (written by :func:`sdp.driver.checkpoint_resume.resolve_once`) once the
    job's other ``world_size - 1`` processes have read this attempt's (up to ``timeout_s``; the worker calls it with
    0 once every rank has joined the process group, the driver when a finished run starts no worker), so a finished
    or resumed run directory keeps none of them (a job that fails before leaves them; another attempt of the job
    reads its own, :func:`sdp.rank.rankenv.attempt_id`)."""
    path = RunDir(run_dir).resume_verdict(attempt)
    if not path.parent.exists():
        return
    deadline = time.monotonic() + timeout_s
    while path.exists() and not all(verdict_ack(path, r).exists() for r in range(1, world_size)) and time.monotonic() < deadline:
        time.sleep(VERDICT_POLL_S)
    shutil.rmtree(path.parent, ignore_errors=True)


def verdict_ack(path: Path, rank: int) -> Path:
    """The file a rank other than 0 writes once it has read the resume verdict at ``path``."""
    return path.with_name(f"{path.stem}.read{rank}")
