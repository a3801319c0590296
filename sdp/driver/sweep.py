"""Resumable multiruns: ``train.skip_done=true`` makes the same ``sdp-train -m ...`` command, run again
with the same ``hydra.sweep.dir``, finish a sweep instead of redoing it.

Hydra cannot resume a multirun (it re-runs every job), so each job decides for itself, in the driver,
before any rank starts (:func:`job_plan`), from what its run directory holds:

- a complete ``summary.json`` under the same resolved config: *done*, the job is skipped (one line)
  and returns that summary, so the multirun-end report covers it like any other job;
- a checkpoint: *resume* (``train.skip_done`` implies ``train.resume=auto``; one at ``train.steps`` is a finished
  run whose summary is missing: :mod:`sdp.driver.finished` rebuilds it, no rank starts);
- nothing yet, or only the rows of a run killed before its first checkpoint: *start* (leftover
  ``metrics.jsonl`` (or its compressed form) and failure files are cleared, so no step appears twice);
- a ``config.yaml`` that differs: refused, naming the first key that differs.

The comparison is of the resolved config as ``config.yaml`` records it (after the budget has set
``train.steps``), minus :data:`RUN_CONTROL_KEYS`, which say how a job is run, not what it computes.
Under ``cluster=slurm`` every task of a job makes the same decision from the same shared files.
"""

from __future__ import annotations

import atexit
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from sdp.rank import checkpoint
from sdp.errors import ConfigError
from sdp.results.contract import RUN_CONTROL_KEYS, scrub
from sdp.results.rundir import FAILURE, METRICS, METRICS_GZ, SUMMARY, RunDir
from sdp.results.summary import Summary, read_json

LEFTOVERS = (METRICS, METRICS_GZ, FAILURE)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.steps": 10, ...}`` for a nested dict (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


# Keys added to the config after runs were recorded, with the value that computes what a run recorded without
# the key computed (a recorded run without ``plugins`` imported none; evaluation part by part with one batch
# per pass is the protocol ``eval.part_batches`` was introduced with, and the default; a run from before the
# holder-set cap ran uncapped, ``parallelism.max_holder_sets=null``): re-using such a run
# under ``train.skip_done`` is the same job, not another config. A callable instead of a value decides from the
# current (flattened) config: ``train.tf32`` acts on CUDA only, so a CPU run computes the same at any value,
# while a CUDA run from before the key ran on PyTorch's own TF32 defaults, which no value of the key gives.
ADDED_KEYS: dict[str, Any] = {"plugins": [], "eval.part_batches": 1, "parallelism.max_holder_sets": None,
                              "train.tf32": lambda now: now.get("cluster.device") != "cuda",
                              "cluster.comm_bytes_per_group": lambda now: True,  # read by sdp-plan only
                              "train.save_final": "none",  # a run without the key kept no final weights
                              # a run without the key evaluated no ensemble: the same job where none is evaluated now
                              # (the key off, or workers that train one model: only forward masking has subnetworks)
                              "eval.ensemble": lambda now: not now.get("eval.ensemble")
                              or now.get("parallelism.masking") != "forward"}


def first_difference(*, now: dict[str, Any], then: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """(key, value now, value recorded) of the first key (in the current config's order) that differs."""
    def keep(key: str) -> bool:
        return not any(key == k or key.startswith(k + ".") for k in RUN_CONTROL_KEYS)

    a, b = flatten(now), flatten(then)
    missing = object()
    for key in [k for k in a if keep(k)] + [k for k in b if keep(k) and k not in a]:
        added = ADDED_KEYS.get(key, missing)
        if key not in b and key in ADDED_KEYS and (added(a) if callable(added) else a[key] == added):
            continue  # a key added after the run was recorded, at the value that computes what the run computed
        if a.get(key, missing) != b.get(key, missing):
            return key, a.get(key, "<absent>"), b.get(key, "<absent>")
    return None


def complete_summary(run_dir: Path) -> Summary | None:
    """The run's summary.json when it is complete (written atomically at the end of a run), else None."""
    obj = read_json(RunDir(run_dir).summary)
    return Summary.from_json(obj) if obj is not None and "final" in obj else None


def job_plan(*, cfg: DictConfig, run_dir: Path) -> tuple[str, Summary | None]:
    """``("skip", summary)``, ``("resume", None)`` or ``("start", None)`` for this job under ``train.skip_done``;
    raises :class:`ConfigError` when ``run_dir`` holds another config."""
    recorded = RunDir(run_dir).config
    if recorded.exists():
        now = scrub(OmegaConf.to_container(cfg, resolve=True))
        then = OmegaConf.to_container(OmegaConf.load(recorded), resolve=False)
        diff = first_difference(now=now, then=then)  # type: ignore[arg-type]
        if diff is not None:
            key, value, old = diff
            raise ConfigError(
                f"{key}={value!r} is invalid for re-using {run_dir} (train.skip_done=true): its config.yaml has "
                f"{key}={old!r}; allowed: the same value, or a new hydra.sweep.dir for a different sweep")
        summary = complete_summary(run_dir)
        if summary is not None:
            return "skip", summary
    if checkpoint.checkpoints(run_dir):
        return "resume", None
    return "start", None


def clear_leftovers(run_dir: Path) -> list[str]:
    """Remove what a run killed before its first checkpoint left (a fresh start must not append to it)."""
    removed = []
    for name in LEFTOVERS:
        if (run_dir / name).exists():
            (run_dir / name).unlink()
            removed.append(name)
    return removed


def refuse_used_dir(run_dir: Path) -> None:
    """A fresh start (no checkpoint to continue) into a directory that holds another run's results is refused
    before any rank starts, and nothing is removed: the metrics logger appends, so the rows of two runs would read
    as one run (a second 5-step run left 12 rows), and beside a slimmed run's ``metrics.jsonl.gz`` the directory
    could not be read at all. ``train.skip_done`` clears what a run killed before its first checkpoint left."""
    held = [name for name in (METRICS, METRICS_GZ, SUMMARY) if (run_dir / name).exists()]
    if held:
        raise ConfigError(
            f"hydra.run.dir={str(run_dir)!r} is invalid for a fresh start: it holds another run's {', '.join(held)}; "
            "allowed: a new directory, train.resume=auto to continue its checkpoint, or train.skip_done=true "
            "(a complete run with the same config is skipped, one killed before its first checkpoint starts afresh)")


class SweepRecord(Callback):
    """Hydra callback (``hydra.callbacks.record``): a multirun launched into a sweep directory that already holds a
    ``multirun.yaml`` keeps it. Hydra's sweeper rewrites that file at every launch, so re-running one failed job of a
    sweep (``hydra.sweep.dir=<sweep> hydra.sweep.subdir=<j>``) or finishing it with ``train.skip_done`` used to leave
    a record of a one-job sweep where the sweep's own had been. The earlier file is restored and this launch's config,
    when it differs, is written beside it as ``multirun.launch-<UTC time>.yaml``: nothing already written is lost and
    every launch stays on record (each job's ``config.yaml`` also records what that job ran). Restored at the first
    job's start, at the multirun's end and at interpreter exit (a sweep stopped by a failed job)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.before: bytes | None = None
        self.stamp = ""
        self.launch: Path | None = None  # this launch's record, once written
        self.driver: tuple[str, int] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.path = Path(str(config.hydra.sweep.dir)) / "multirun.yaml"
        self.before = self.path.read_bytes() if self.path.is_file() else None
        self.stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        self.driver = (socket.gethostname(), os.getpid())
        if self.before is not None:
            atexit.register(self.settle)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.driver == (socket.gethostname(), os.getpid()):  # a local launcher's job: the sweeper has just saved
            self.settle()  # (a Slurm task runs elsewhere, beside its array siblings: the driver settles at the end)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.settle()

    def settle(self) -> Path | None:
        """Put the earlier ``multirun.yaml`` back if this launch rewrote it; the launch record's path, if written."""
        if self.before is None or self.path is None or not self.path.is_file():
            return None
        now = self.path.read_bytes()
        if now == self.before:
            return None
        for n in range(1000):  # exclusive create: two launches in one second keep two records
            self.launch = self.path.with_name(f"multirun.launch-{self.stamp}{f'-{n}' if n else ''}.yaml")
            try:
                with self.launch.open("xb") as f:
                    f.write(now)
                break
            except FileExistsError:
                continue
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_bytes(self.before)
        os.replace(tmp, self.path)  # a reader never sees half a file
        print(f"sweep record: kept {self.path} (the sweep's earlier launch); this launch's: {self.launch.name}",
              flush=True)
        return self.launch
