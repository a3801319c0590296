"""Starting ranks: torch elastic locally (the engine behind torchrun), or nothing at all when the
process already is a rank of an external launcher (torchrun, Slurm tasks).

Why elastic and not a hand-written process manager: it picks a free rendezvous port, sets the rank
environment, watches every worker, and when one raises it tears the others down within a monitor
interval and returns the failed rank's traceback (recorded by ``@record`` in the worker).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


class RankFailure(RuntimeError):
    """A rank of the job failed; the message carries the rank and its traceback (or signal)."""

    def __init__(self, message: str, *, rank: int, exitcode: int) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


def external_launcher() -> bool:
    """True when RANK and WORLD_SIZE are already set (torchrun, Slurm + submitit)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(*, cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run the job's ranks and return rank 0's summary (None on other ranks of an external job)."""
    from sdp.worker import run_rank

    config = OmegaConf.to_container(cfg, resolve=True)
    if external_launcher():
        return run_rank(config, str(run_dir))
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
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
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "rank_logs")),
    )
    try:
        outputs = elastic_launch(launch_cfg, run_rank)(config, str(run_dir))
    except ChildFailedError as exc:
        # Root cause first: a rank killed by a signal (its peers then fail in their collectives,
        # within the same second, so failure timestamps cannot tell them apart), else the earliest.
        killed = sorted(r for r, f in exc.failures.items() if f.exitcode < 0)
        rank, failure = (killed[0], exc.failures[killed[0]]) if killed else exc.get_first_failure()
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        inner = data.get("message", {})
        callstack = inner.get("extraInfo", {}).get("py_callstack") if isinstance(inner, dict) else None
        message = callstack or failure.message
        others = sorted(r for r in exc.failures if r != rank)
        also = f" (then also rank(s) {others})" if others else ""
        raise RankFailure(
            f"rank {rank} of {world} failed (exit code {failure.exitcode}){also}:\n{message}",
            rank=rank, exitcode=failure.exitcode,
        ) from None
    return outputs.get(0)
