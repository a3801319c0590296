"""The driver's side of a resume: which checkpoint ``train.resume`` names, whether this config may
continue it, and the run directory made ready for it.

Why a module of its own: all of it runs in the driver, once, before any rank starts
(:func:`sdp.driver.train.run`; :func:`sdp.driver.config.validate_train` checks a path), and reads a checkpoint's
``meta.json`` and file list only, never its tensors; the ranks write and load checkpoints with
:mod:`sdp.rank.checkpoint` and call none of it (but :func:`sdp.rank.checkpoint.release_verdicts`, once all have
joined). A damaged
checkpoint is found here by its checksums (:func:`sdp.rank.checkpoint_io.damage`): ``train.resume=auto`` skips it
for the latest whole one, with a :class:`CheckpointWarning`, and nothing is ever deleted (a damaged later checkpoint
is moved aside). Under an external launcher every rank runs the driver, and rank 0 alone hashes: :func:`resolve_once`
hands its verdict on.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from sdp.rank import checkpoint_io
from sdp.rank.checkpoint import (RESUME_KEY, RESUME_KEYS, VERDICT_POLL_S, checkpoints, read_meta, resume_key,
                                 verdict_ack)
from sdp.errors import ConfigError
from sdp.results.contract import write_json
from sdp.results.rundir import CHECKPOINTS, RunDir, checkpoint_meta, run_of_checkpoint
from sdp.results.summary import read_json


class CheckpointWarning(UserWarning):
    """A resume that goes on, differently from what was asked: a damaged checkpoint skipped, one unverified."""


def resolve(*, resume: Any, run_dir: Path | None, verify: bool = True) -> Path | None:
    """``train.resume`` -> a checkpoint directory, or None for a fresh start.

    ``null``: fresh; ``auto``: the latest whole checkpoint of this run directory (fresh when there is
    none, so the same command line starts or resumes a job; a damaged later one is skipped with a
    :class:`CheckpointWarning` naming it); a path: a checkpoint directory, or a run directory (this one
    re-used, or a previous run's) whose latest checkpoint is taken, refused when it is damaged.
    ``verify=False`` checks existence only (the config pass; the driver resolves again, verifying)."""
    if resume is None or str(resume) in ("", "null", "none"):
        return None
    if str(resume) == "auto":
        found = [p for _, p in checkpoints(run_dir)] if run_dir is not None else []
        return _latest_whole(found, verify=verify) if found else None
    path = Path(str(resume)).expanduser().resolve()
    found = [path] if checkpoint_meta(path).is_file() else [p for _, p in checkpoints(path)]
    if not found:
        why = "does not exist" if not path.exists() else "holds no complete checkpoint"
        raise ConfigError(
            f"train.resume={str(resume)!r} is invalid: {path} {why}; allowed: null, auto (latest checkpoint of "
            f"this run directory), a checkpoint directory (with meta.json) or a run directory with {CHECKPOINTS}/")
    chosen = found[-1]
    problem = checkpoint_io.damage(chosen) if verify else None
    if problem is not None:
        siblings = [p for _, p in checkpoints(chosen.parent.parent)]  # <run_dir>/checkpoints/step_N
        before = siblings[:siblings.index(chosen)] if chosen in siblings else []
        hint = f", e.g. the one before it, {before[-1]} (not verified yet)" if before else ""
        raise ConfigError(f"train.resume={str(resume)!r} is invalid: checkpoint {chosen} is damaged: {problem}; "
                          f"allowed: a whole checkpoint{hint}. Nothing was deleted")
    if verify:
        _note_unverified(chosen)
    return chosen


def resolve_once(*, resume: Any, run_dir: Path, rank: int | None, attempt: str, timeout_s: float) -> Path | None:
    """:func:`resolve` with the checkpoint's files hashed once per job, not in every process.

    Why: under Slurm tasks or torchrun every rank is a driver process of its own (``rank``: its RANK; None when
    this process is the job's only driver and starts the ranks itself, then this is :func:`resolve`). Hashing
    in each of them reads a checkpoint once per rank (8 ranks x 13 GB for LLaMA-1B with AdamW, per node) while
    their peers wait. So rank 0 resolves and verifies, and writes its verdict (the checkpoint, or the error
    that refused it) to :meth:`~sdp.results.rundir.RunDir.resume_verdict` of this ``attempt``; every other rank
    checks existence only and, where that finds a checkpoint, takes rank 0's verdict, waiting for it up to
    ``timeout_s`` (``train.checkpoint_timeout_s``: the time a checkpoint may take to be read). The worker removes
    the verdict once every rank has joined the process group and checks that every rank resumes rank 0's choice."""
    if rank is None:
        return resolve(resume=resume, run_dir=run_dir)
    if resolve(resume=resume, run_dir=run_dir, verify=False) is None:
        return None  # nothing to verify: no verdict is needed (the worker checks that every rank agrees)
    path = RunDir(run_dir).resume_verdict(attempt)
    if rank == 0:
        try:
            ckpt = resolve(resume=resume, run_dir=run_dir)
        except ConfigError as exc:
            _write_verdict(path, {"checkpoint": None, "error": str(exc)})
            raise
        _write_verdict(path, {"checkpoint": None if ckpt is None else str(ckpt), "error": None})
        return ckpt
    deadline = time.monotonic() + timeout_s
    while (verdict := read_json(path)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank} waited train.checkpoint_timeout_s={timeout_s:g} s for rank 0's verdict on "
                               f"train.resume={str(resume)!r} ({path}) and none came: rank 0 failed before writing it, "
                               "or hashes the checkpoint more slowly than that (then raise train.checkpoint_timeout_s)")
        time.sleep(VERDICT_POLL_S)
    _write_verdict(verdict_ack(path, rank), {"rank": rank})  # read: rank 0 may remove the verdict once every rank has
    if verdict["error"] is not None:
        raise ConfigError(verdict["error"])
    return None if verdict["checkpoint"] is None else Path(verdict["checkpoint"])


def _write_verdict(path: Path, verdict: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, verdict)


def _latest_whole(found: list[Path], *, verify: bool) -> Path:
    """The latest of ``found`` (by step) that is whole, warning about each later one that is not."""
    damaged: list[str] = []
    for path in reversed(found):
        problem = checkpoint_io.damage(path) if verify else None
        if problem is None:
            if damaged:
                warnings.warn(f"train.resume=auto: resuming from {path}, the latest whole checkpoint, instead of "
                              f"the damaged later one(s): {'; '.join(damaged)}. Nothing was deleted",
                              CheckpointWarning, stacklevel=3)
            if verify:
                _note_unverified(path)
            return path
        damaged.append(f"{path} ({problem})")
    raise ConfigError(f"train.resume='auto' is invalid: every checkpoint of {found[0].parent} is damaged: "
                      f"{'; '.join(damaged)}; allowed: null (a fresh start, in a new run directory), or repair "
                      "or move away the damaged checkpoints. Nothing was deleted")


def _note_unverified(path: Path) -> None:
    if not checkpoint_io.checksummed(read_meta(path)):
        warnings.warn(f"{path} was written before checkpoints recorded checksums: its files were checked for "
                      "presence only, not content", CheckpointWarning, stacklevel=3)


def check_resume(*, ckpt: Path, cfg: DictConfig) -> None:
    """Driver side of a resume: refuse a config that differs from the checkpoint's in a key of
    :data:`RESUME_KEYS` (LR schedule, optimizer, model), naming the first and why it must match.

    ``train.extend_steps=true`` is the one allowed change: a larger ``train.steps``, the LR following
    the schedule of the new ``train.steps`` from the checkpoint's step on (see :func:`sdp.rank.checkpoint.restore_lr`).
    A checkpoint written before the optimizer and model were recorded (``schedule`` in its meta.json)
    is compared on the keys it recorded."""
    meta = read_meta(ckpt)
    now = resume_key(cfg)
    then = meta.get(RESUME_KEY)
    if then is None:
        then = meta.get("schedule")
        if then is None:
            return  # written before the schedule was recorded: nothing to compare with
        keys = [k for k in now if k in then]
    else:
        keys = list(now) + [k for k in then if k not in now]
    step, extend, absent = int(meta["step"]), bool(cfg.train.extend_steps), "<absent>"
    for key in keys:
        if key == "train.steps" and extend:
            if not (isinstance(now[key], int) and now[key] > step):
                raise ConfigError(f"train.steps={now[key]!r} is invalid with train.extend_steps=true: {ckpt} is at step "
                                  f"{step}; allowed: more steps than that")
            continue
        value, old = now.get(key, absent), then.get(key, absent)
        if value != old:
            why = next(RESUME_KEYS[k] for k in RESUME_KEYS if key == k or key.startswith(k + "."))
            more = (" or set train.extend_steps=true to train on to the new train.steps under its schedule"
                    if key == "train.steps" else "")
            raise ConfigError(f"{key}={value!r} is invalid for resuming {ckpt}: the checkpoint was written with "
                              f"{key}={old!r} and {why}; allowed: {key}={old!r}{more}")


def prepare_run_dir(*, ckpt: Path, run_dir: Path) -> int:
    """Driver side of a resume: make ``run_dir/metrics.jsonl`` hold exactly the rows of steps up to
    the checkpoint (copied from the checkpoint's run when it is another one; rows a killed run logged
    after its checkpoint are dropped, so no step appears twice), and drop this run's checkpoints of
    later steps (a stale future); a damaged one (which ``train.resume=auto`` skipped) is moved aside to
    ``step_N.damaged``, not deleted, where the resumed run would overwrite it. Returns the checkpoint's step."""
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
        if later <= step:
            continue
        problem = checkpoint_io.damage(path)
        if problem is None:
            shutil.rmtree(path, ignore_errors=True)
            continue
        aside = path.with_name(f"{path.name}.damaged")
        n = 0
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.damaged.{n}")
        os.replace(path, aside)
        warnings.warn(f"the damaged checkpoint {path} ({problem}) is moved aside to {aside}, not deleted: the resumed "
                      f"run writes step {later} anew", CheckpointWarning, stacklevel=2)
    return step
