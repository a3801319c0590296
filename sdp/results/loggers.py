"""Loggers: JSONL files (always, the results contract), Weights & Biases (a mirror, rank 0 only) and
a null logger for other ranks; plus a rank-0 progress bar that stays quiet when not on a TTY, and a
Hydra callback that puts a multirun's progress (runs done of all) into that bar.

Why JSONL first: W&B is a mirror and must never be the only copy. Every row is flushed as it is
written, so a killed run keeps every logged step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any, Protocol

from hydra.experimental.callback import Callback

from sdp.errors import ConfigError
from sdp.results.rundir import RunDir, checkpoint_meta

# Set by SweepProgress in the driver for each job of a multirun, read by rank 0's ProgressBar (the
# ranks are spawned below the driver and inherit its environment): "1/3 runs done · parallelism=sdp".
SWEEP_PROGRESS_ENV = "SDP_SWEEP_PROGRESS"


WANDB_MODES = ("online", "offline", "disabled")
WANDB_ALIASES = {"dryrun": "offline", "run": "online"}  # W&B's older names, which WANDB_MODE may still hold
WANDB_FALLBACK = "offline"  # neither the key nor WANDB_MODE says: write <run_dir>/wandb, no network (sync later)


def wandb_mode(mode: str | None) -> str:
    """The W&B mode of a job: ``logger.wandb.mode`` where the config sets it (it wins, as an argument to
    ``wandb.init`` does); null: ``WANDB_MODE`` from the environment when set (W&B's own variable, which passing
    ``mode=`` to ``wandb.init`` would silently override), else :data:`WANDB_FALLBACK`. Raises ConfigError naming the
    key or the variable for a value outside :data:`WANDB_MODES`; the driver asks it before any rank starts."""
    if mode is not None:
        if str(mode) not in WANDB_MODES:
            raise ConfigError(f"logger.wandb.mode={mode!r} is invalid: allowed: null, {', '.join(WANDB_MODES)}")
        return str(mode)
    env = os.environ.get("WANDB_MODE", "").strip()
    if not env:
        return WANDB_FALLBACK
    value = WANDB_ALIASES.get(env.lower(), env.lower())
    if value not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={env!r} (the environment, read because logger.wandb.mode is null) is invalid: "
                          f"allowed: {', '.join(WANDB_MODES)} (or W&B's older {', '.join(WANDB_ALIASES)}); "
                          "or set logger.wandb.mode, which wins over it")
    return value


def wandb_run_id(*, run_dir: Path, ckpt: Path | None) -> str:
    """The job's W&B run id: the one its run directory already holds (a requeued or rerun job), else
    the one of the checkpoint it resumes from (``meta.json``, a resume into another directory), else a
    new one; written to ``run_dir/wandb_run_id`` so every later attempt finds it."""
    found = stored_run_id(run_dir)
    if found:
        return found
    run_id = None
    if ckpt is not None and checkpoint_meta(ckpt).exists():
        run_id = json.loads(checkpoint_meta(ckpt).read_text()).get("wandb_run_id")
    run_id = run_id or uuid.uuid4().hex[:16]
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).wandb_run_id.write_text(run_id + "\n")
    return run_id


def stored_run_id(run_dir: Path) -> str | None:
    """The id in ``run_dir/wandb_run_id``, or None when the job has none (W&B disabled)."""
    path = RunDir(run_dir).wandb_run_id
    return (path.read_text().strip() or None) if path.exists() else None


class Logger(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...
    def finish(self) -> None: ...


def _clean(v: Any) -> Any:
    """JSON-safe value: NaN/inf become strings so the file stays valid JSON for every reader."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class NullLogger:
    """What every rank but rank 0 gets: logging calls are free and do nothing."""

    def log(self, row: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per row to ``metrics.jsonl``, flushed and fsynced per row."""

    def __init__(self, *, path: Path) -> None:
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def finish(self) -> None:
        if not self._f.closed:
            self._f.close()


class WandbLogger:
    """Mirrors rows to W&B. If W&B cannot start (no network, bad key, online mode on an offline node)
    the run goes on: online falls back to offline (sync later with ``wandb sync``), offline to
    disabled, each said on stderr; ``mode_used`` records what it ended up as. The mode tried first is
    :func:`wandb_mode`'s (``logger.wandb.mode``, else ``WANDB_MODE``, else offline). ``init_timeout_s``
    bounds how long a start may take, so an unreachable server costs seconds, not the run.

    One W&B run per job: the id comes from ``run_dir/wandb_run_id`` (:func:`wandb_run_id`, set by the
    driver) with ``resume="allow"``, so a resumed or requeued job continues the same run; rows carry
    their training step, so its history goes on from the checkpoint's step, not from 0. Offline, each
    attempt writes its own ``wandb/offline-run-<time>-<id>`` directory; ``wandb sync`` of all of them
    uploads them in order into the one run (slurm/README.md). An offline run also writes its config to
    ``files/config.yaml`` at start (W&B itself only writes it when it syncs), flushes its transaction
    log every second, and finishes the run on SIGTERM (:func:`finish_on_sigterm`), so a stopped attempt
    keeps all it logged and a SIGKILLed one all but its last second."""

    def __init__(self, *, cfg: Any, run_dir: Path, config: dict[str, Any], group: str, job_type: str, name: str) -> None:
        self.run = None
        mode = wandb_mode(cfg.get("mode"))  # the key, else WANDB_MODE, else offline
        self.mode_used = "disabled"
        self.run_id = stored_run_id(run_dir)
        self._sigterm = False  # whether this logger installed the SIGTERM handler (removed at finish)
        for attempt in (("online", "offline") if mode == "online" else (mode,)) if mode != "disabled" else ():
            try:
                import wandb

                self.run = wandb.init(
                    project=cfg.project, entity=cfg.get("entity"), group=cfg.get("group") or group,
                    job_type=job_type, name=name, tags=list(cfg.get("tags") or []), config=config,
                    dir=str(run_dir), mode=attempt, reinit="create_new", id=self.run_id,
                    resume="allow" if self.run_id else None,
                    settings=wandb.Settings(init_timeout=float(cfg.get("init_timeout_s") or 30),
                                            x_transaction_log_flush_interval=1.0),
                )
                self.mode_used = attempt
                if attempt == "offline":
                    write_wandb_config(Path(self.run.dir) / "config.yaml", config)
                self._sigterm = finish_on_sigterm()
                return
            except Exception as exc:  # noqa: BLE001 - any W&B failure must not cost the run
                then = "trying offline" if attempt == "online" else "continuing with W&B disabled"
                msg = f"W&B ({attempt}) could not start, {then}; metrics.jsonl is unaffected: {type(exc).__name__}: {exc}"
                print(f"[sdp] {msg}", file=sys.stderr, flush=True)
                warnings.warn(msg)
                self.run = None

    def log(self, row: dict[str, Any]) -> None:
        if self.run is not None:
            step = row.get("step")
            self.run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = v

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
        if self._sigterm:
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm = False


def finish_on_sigterm() -> bool:
    """Turn SIGTERM into ``SystemExit`` on this rank, so its ``finally`` finishes the W&B run (which
    flushes the transaction log) before the process ends. SIGTERM is how a job is stopped: torch
    elastic stops the surviving ranks when one fails, Slurm at preemption, ``scancel`` and the time
    limit. Only where nothing else handles it (submitit installs its own) and on the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    return True


def write_wandb_config(path: Path, config: dict[str, Any]) -> None:
    """``config.yaml`` in W&B's own layout (``key: {value: ...}``), as an online run's files hold it."""
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml({k: {"value": v} for k, v in config.items()}))


class MultiLogger:
    """Fans rows out to several loggers; ``finish`` always reaches every one of them."""

    def __init__(self, *loggers: Logger) -> None:
        self.loggers = loggers

    def log(self, row: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log(row)

    def finish(self) -> None:
        errors = []
        for lg in self.loggers:
            try:
                lg.finish()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]


class ProgressBar:
    """tqdm bar with loss and throughput on rank 0; disabled when stderr is not a TTY. Inside a
    multirun its label says how many runs of the sweep are done and which one this is."""

    def __init__(self, *, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, dynamic_ncols=True, desc=os.environ.get(SWEEP_PROGRESS_ENV) or "train")

    def update(self, step: int, *, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.0f}", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def sweep_size(*, params: dict[str, Any], overrides: list[str]) -> tuple[int, list[str]]:
    """(number of jobs, swept keys) of a basic-sweeper multirun: the product of the discrete sweeps in
    ``hydra.sweeper.params`` and on the command line (a command-line override replaces the param of its key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides))
    sizes = {o.get_key_element(): len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1 for o in parsed}
    return math.prod(sizes.values()), [k for k, n in sizes.items() if n > 1]


class SweepProgress(Callback):
    """Hydra callback (``hydra.callbacks.progress``): before each job of a multirun launched from this
    process, say in :data:`SWEEP_PROGRESS_ENV` how many runs are done of how many and what this run
    sweeps, so the step bar of that run reads ``1/3 runs done · parallelism=sdp: 45%|####  | 90/200``.
    A sweep it cannot count (not the basic sweeper) shows the run's number instead."""

    def __init__(self) -> None:
        self.in_sweep = False
        self.total: int | None = None
        self.swept: list[str] = []
        self.done = 0

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.in_sweep, self.done = True, 0
        sweeper = config.hydra.sweeper
        if str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
            try:
                self.total, self.swept = sweep_size(params=dict(sweeper.get("params") or {}),
                                                    overrides=list(config.hydra.overrides.task))
            except Exception:  # noqa: BLE001 - a progress label must never stop a sweep
                self.total = None

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if not self.in_sweep:  # a single run: the bar says "train"
            return
        task = [o for o in config.hydra.overrides.task if o.split("=", 1)[0].lstrip("+~") in self.swept]
        count = f"{self.done}/{self.total} runs done" if self.total else f"run {int(config.hydra.job.num) + 1}"
        os.environ[SWEEP_PROGRESS_ENV] = " · ".join([count, *([" ".join(task)] if task else [])])

    def on_job_end(self, config: Any, **kwargs: Any) -> None:
        self.done += 1
        os.environ.pop(SWEEP_PROGRESS_ENV, None)
