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

from pathlib import Path
from typing import Any

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
