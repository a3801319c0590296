"""Loggers: JSONL files (always, the results contract), Weights & Biases (a mirror, rank 0 only) and
a null logger for other ranks; plus a rank-0 progress bar that stays quiet when not on a TTY.

Why JSONL first: W&B is a mirror and must never be the only copy. Every row is flushed as it is
written, so a killed run keeps every logged step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Protocol


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
    disabled, each said on stderr; ``mode_used`` records what it ended up as. ``init_timeout_s``
    bounds how long a start may take, so an unreachable server costs seconds, not the run."""

    def __init__(self, *, cfg: Any, run_dir: Path, config: dict[str, Any], group: str, job_type: str, name: str) -> None:
        self.run = None
        mode = str(cfg.mode)
        if mode not in ("online", "offline", "disabled"):
            raise ValueError(f"logger.wandb.mode={mode!r} not in ('online', 'offline', 'disabled')")
        self.mode_used = "disabled"
        for attempt in (("online", "offline") if mode == "online" else (mode,)) if mode != "disabled" else ():
            try:
                import wandb

                self.run = wandb.init(
                    project=cfg.project, entity=cfg.get("entity"), group=cfg.get("group") or group,
                    job_type=job_type, name=name, tags=list(cfg.get("tags") or []), config=config,
                    dir=str(run_dir), mode=attempt, reinit="create_new",
                    settings=wandb.Settings(init_timeout=float(cfg.get("init_timeout_s") or 30)),
                )
                self.mode_used = attempt
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
    """tqdm bar with loss and throughput on rank 0; disabled when stderr is not a TTY."""

    def __init__(self, *, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, dynamic_ncols=True, desc="train")

    def update(self, step: int, *, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.0f}", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
