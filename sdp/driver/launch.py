"""Starting ranks: torch elastic locally (the engine behind torchrun), or nothing at all when the
process already is a rank of an external launcher (torchrun, Slurm tasks).

Under Slurm every Slurm task is one rank (:mod:`sdp.driver.slurm` sets the rank variables), so nothing is
spawned inside a task.

Why elastic and not a hand-written process manager: it picks a free rendezvous port, sets the rank
environment, watches every worker, and when one raises it tears the others down within a monitor
interval and returns the failed rank's traceback (recorded by ``@record`` in the worker).
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sdp.rank.rankenv import attempt_id, external_launcher
from sdp.results.rundir import RunDir
from sdp.results.summary import Summary


class RankFailure(RuntimeError):
    """A rank of the job failed; the message carries the rank and its traceback (or signal)."""

    def __init__(self, message: str, *, rank: int = -1, exitcode: int = 1) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode

    def __reduce__(self) -> tuple:
        # Picklable with its fields: the Slurm launcher ships a job's exception back to the submitter.
        return (type(self), (self.args[0],), {"rank": self.rank, "exitcode": self.exitcode})


FAILURE_GRACE_S = 3.0  # how long a rank whose report is alone waits for an earlier one (shared-FS lag)


def run_external(*, config: dict[str, Any], run_dir: Path, budget: dict[str, Any] | None = None,
                 prepared: Any = None) -> Summary | None:
    """Run this process's rank; if it fails, raise the failure of the rank that failed first.

    When one rank raises, its peers only see a closed connection once it has exited; each failing
    rank writes its traceback to ``run_dir/failures/<attempt>/`` and reports the earliest one, so the
    job's error (what Hydra and the Slurm launcher show for rank 0) is the root cause, as with the local
    launcher. A rank never waits for later failures (its peers may be blocked on it), only briefly for
    an earlier report that a shared file system has not shown yet.
    """
    from sdp.results.contract import write_json
    from sdp.rank.worker import run_rank

    try:
        return run_rank(config, str(run_dir), budget, prepared)
    except Exception:
        rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
        folder = RunDir(run_dir).failures(attempt_id())
        folder.mkdir(parents=True, exist_ok=True)
        mine = {"rank": int(rank), "time": time.time(), "traceback": traceback.format_exc()}
        write_json(folder / f"rank{rank}.json", mine)
        deadline = time.time() + FAILURE_GRACE_S
        while True:
            reports = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
            if len(reports) > 1 or time.time() > deadline:
                break
            time.sleep(0.5)
        from sdp.rank.guards import PEER_LOST

        first = min(reports, key=lambda r: (PEER_LOST in r["traceback"], r["time"]))  # a cause, not a consequence
        others = sorted(r["rank"] for r in reports if r["rank"] != first["rank"])
        after = f" (then ranks {others})" if others else ""
        raise RankFailure(f"rank {first['rank']} of {world} failed first{after}:\n{first['traceback']}",
                          rank=first["rank"], exitcode=1) from None


def root_cause(failures: dict[int, Any]) -> tuple[int, Any, str]:
    """(rank, failure, traceback) of the failure that caused the others.

    A rank killed by a signal (not the agent's SIGTERM) comes first, then a rank whose error is its own (not a collective that
    broke because a peer went away, which peers report within the same second, so timestamps cannot
    tell them apart), then the earliest.
    """
    from sdp.rank.guards import PEER_LOST

    def text(f: Any) -> str:
        data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
        inner = data.get("message", {})
        callstack = inner.get("extraInfo", {}).get("py_callstack") if isinstance(inner, dict) else None
        return str(callstack or f.message)

    def killed(f: Any) -> bool:  # by a signal from outside (the agent itself stops ranks with SIGTERM)
        return f.exitcode < 0 and f.exitcode != -signal.SIGTERM

    rank = min(failures, key=lambda r: (not killed(failures[r]), PEER_LOST in text(failures[r]),
                                        failures[r].timestamp, r))
    return rank, failures[rank], text(failures[rank])


def stopped(sig: int) -> BaseException:
    """What a stop signal that reached the elastic agent becomes: the agent stops the ranks and raises
    ``SignalException``, an ``Exception``, which Hydra's multirun records as one failed job before it
    starts the next; so a Ctrl-C or ``kill`` of a local sweep only ended the current job (seen in the CPU
    study). ``KeyboardInterrupt`` (SIGINT) or ``SystemExit(128 + signal)`` is not an ``Exception``: the
    sweep ends, and the stopped job's checkpoint stays for ``train.skip_done`` / ``train.resume``."""
    if sig == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + int(sig))


def launch(*, cfg: DictConfig, run_dir: Path, budget: dict[str, Any] | None = None, prepared: Any = None) -> Summary | None:
    """Run the job's ranks and return rank 0's summary (None on other ranks of an external job).

    ``budget``: what the driver counted to resolve ``train.steps``; rank 0 puts it in summary.json.
    ``prepared``: what the strategy built once in the driver for every rank (SDP's plan, picklable:
    :meth:`sdp.parallel.spec.StrategySpec.prepare`)."""
    from sdp.rank.worker import run_rank

    config = OmegaConf.to_container(cfg, resolve=True)
    if external_launcher():
        return run_external(config=config, run_dir=run_dir, budget=budget, prepared=prepared)
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = int(cfg.cluster.world_size)
    launch_cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"sdp-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: the agent binds a free port, like torchrun --standalone
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(RunDir(run_dir).rank_logs)),
    )
    try:
        outputs = elastic_launch(launch_cfg, run_rank)(config, str(run_dir), budget, prepared)
    except SignalException as exc:
        raise stopped(exc.sigval) from None
    except ChildFailedError as exc:
        rank, failure, message = root_cause(exc.failures)
        from sdp.core.distctx import last_position

        message += last_position(str(RunDir(run_dir).failure_rank(rank)))  # aborted (NCCL watchdog) or killed
        others = sorted(r for r in exc.failures if r != rank)
        also = f" (then also rank(s) {others})" if others else ""
        raise RankFailure(
            f"rank {rank} of {world} failed (exit code {failure.exitcode}){also}:\n{message}",
            rank=rank, exitcode=failure.exitcode,
        ) from None
    return outputs.get(0)
