"""Where a run's outputs live: one object names every path of a run directory.

Why one object: the file names are the results contract (:mod:`sdp.results.contract`, :mod:`sdp.results.summary`),
read back by the report, the sweep's skip/resume logic, ``sdp-rerun`` and the benchmarks long after
the run; spelled in one place, a reader and the writer can never disagree on a name. Imports nothing
from ``sdp`` (the checkpoint, logger and sweep modules all use it).

Layout of ``<root>/`` (Hydra's job output directory):

- ``config.yaml``: the resolved, scrubbed config (:func:`sdp.results.contract.write_config`);
- ``metrics.jsonl``: one JSON row per logged step from rank 0 (``metrics.jsonl.gz`` in a committed run that
  ``sdp-bench slim-runs`` compressed; :func:`sdp.results.contract.read_metrics` reads either);
- ``summary.json``: rank 0's :class:`sdp.results.summary.Summary`, written once at the end;
- ``plan.json``: SDP's coverage plan (which worker holds which unit);
- ``checkpoints/step_00000012/`` with ``meta.json`` (:mod:`sdp.rank.checkpoint`);
- ``final/`` (``train.save_final``): the final weights, ``meta.json`` and one ``rank<r>.pt`` per rank
  (:mod:`sdp.rank.final_weights`), read by ``sdp-bench diagnose``;
- ``failure.json`` (the job's first failure), ``failure_rank<r>.json`` (each failing rank's own),
  ``failures/<attempt>/rank<r>.json`` (ranks of an external launcher); ``resume_verdicts/<attempt>.json`` (the
  checkpoint rank 0 verified for the job's other processes, while they start);
- ``rank_logs/`` (torch elastic's per-rank output), ``wandb_run_id`` (one W&B run across resumes),
  ``.hydra/overrides.yaml`` (Hydra's record of the command line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
METRICS_GZ = METRICS + ".gz"  # the same rows, gzip-compressed (sdp.bench.slim_runs)
SUMMARY = "summary.json"
PLAN = "plan.json"
CHECKPOINTS = "checkpoints"
FINAL = "final"  # train.save_final's directory (sdp.rank.final_weights)
CHECKPOINT_PREFIX = "step_"
CHECKPOINT_META = "meta.json"  # inside each checkpoint directory
SHARED_FILE = "shared.pt"  # inside each checkpoint directory, rank 0's: the "shared" state, scheduler, counters
FAILURE = "failure.json"
RANK_LOGS = "rank_logs"
WANDB_RUN_ID = "wandb_run_id"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory; nothing is created or read here."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def metrics_gz(self) -> Path:
        return self.root / METRICS_GZ

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def plan(self) -> Path:
        return self.root / PLAN

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        """The directory of the checkpoint after ``step`` (complete once it holds ``meta.json``)."""
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:08d}"

    @property
    def final(self) -> Path:
        """The run's final weights (``train.save_final``): ``meta.json`` and one file per rank."""
        return self.root / FINAL

    @property
    def failure(self) -> Path:
        return self.root / FAILURE

    def failure_rank(self, rank: int) -> Path:
        return self.root / f"failure_rank{rank}.json"

    def failures(self, attempt: str) -> Path:
        """Where the ranks of one attempt under an external launcher leave their tracebacks."""
        return self.root / "failures" / attempt

    def resume_verdict(self, attempt: str) -> Path:
        """The checkpoint one attempt's verifying process chose for ``train.resume`` (read by the job's other
        processes, removed once every rank has joined: :mod:`sdp.driver.checkpoint_resume`)."""
        return self.root / "resume_verdicts" / f"{attempt}.json"

    @property
    def rank_logs(self) -> Path:
        return self.root / RANK_LOGS

    @property
    def wandb_run_id(self) -> Path:
        return self.root / WANDB_RUN_ID

    @property
    def hydra_overrides(self) -> Path:
        return self.root / ".hydra" / "overrides.yaml"

    def __str__(self) -> str:
        return str(self.root)


def rank_file(rank: int) -> str:
    """Each rank's own file inside a checkpoint directory: its "local" state, RNG streams and record."""
    return f"rank{rank:05d}.pt"


def checkpoint_meta(ckpt: Path) -> Path:
    """``meta.json`` of a checkpoint directory (present only once the checkpoint is complete)."""
    return Path(ckpt) / CHECKPOINT_META


def run_of_checkpoint(ckpt: Path) -> RunDir:
    """The run directory a checkpoint directory belongs to (``<run>/checkpoints/step_N`` -> ``<run>``)."""
    return RunDir(Path(ckpt).parent.parent)
