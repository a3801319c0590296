"""Starting ranks: torch elastic locally (the engine behind torchrun), or nothing at all when the
process already is a rank of an external launcher (torchrun, Slurm tasks).

Under Slurm every Slurm task is one rank (:mod:`sdp.slurm` sets the rank variables), so nothing is
spawned inside a task.

Why elastic and not a hand-written process manager: it picks a free rendezvous port, sets the rank
environment, watches every worker, and when one raises it tears the others down within a monitor
interval and returns the failed rank's traceback (recorded by ``@record`` in the worker).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


class RankFailure(RuntimeError):
    """A rank of the job failed; the message carries the rank and its traceback (or signal)."""

    def __init__(self, message: str, *, rank: int = -1, exitcode: int = 1) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode

    def __reduce__(self) -> tuple:
        # Picklable with its fields: the Slurm launcher ships a job's exception back to the submitter.
        return (type(self), (self.args[0],), {"rank": self.rank, "exitcode": self.exitcode})


def external_launcher() -> bool:
    """True when RANK and WORLD_SIZE are already set (torchrun, Slurm + submitit)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# Variables that say which launcher started a rank and as what (recorded per rank in summary.json).
LAUNCHER_ENV = (
    "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID", "SLURM_PROCID",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_RESTART_COUNT", "SUBMITIT_EXECUTOR", "TORCHELASTIC_RUN_ID",
    "GROUP_RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
)
FAILURE_GRACE_S = 3.0  # how long a rank whose report is alone waits for an earlier one (shared-FS lag)
# What tells one attempt of a job from another in the same run directory (requeue, elastic restart).
ATTEMPT_ENV = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")


# What decides the shape of the world under an external launcher (named when the world is not the one configured).
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_PROCID")


def seen_env() -> str:
    """``RANK=0 WORLD_SIZE=2 ...``: the world variables of this process that are set."""
    return " ".join(f"{k}={os.environ[k]}" for k in WORLD_ENV if k in os.environ) or "none of " + ", ".join(WORLD_ENV)


def node_index() -> int:
    """This process's node: torchrun's GROUP_RANK (its --node-rank under the static rendezvous), Slurm's
    SLURM_NODEID, else 0 (the local launcher runs every rank on one node)."""
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def world_layout(*, rank: int, local_rank: int, device: Any, world_size: int, nodes: int | None) -> list[dict[str, Any]]:
    """Every rank's (node, host, local rank, rank, device), gathered; collective. Raises on every rank,
    naming what each rank saw, when the world is not the configured one: ranks that are not 0..W-1, a
    node whose local ranks are not 0..n-1, or another number of nodes than ``cluster.nodes`` (where set)."""
    import torch.distributed as dist

    me = {"node": node_index(), "host": socket.gethostname(), "local_rank": local_rank, "rank": rank,
          "device": str(device), "env": seen_env()}
    layout: list[Any] = [None] * world_size
    dist.all_gather_object(layout, me)
    by_node: dict[int, list[dict[str, Any]]] = {}
    for r in layout:
        by_node.setdefault(r["node"], []).append(r)
    problems = []
    if sorted(r["rank"] for r in layout) != list(range(world_size)):
        problems.append(f"ranks {sorted(r['rank'] for r in layout)} are not 0..{world_size - 1}")
    for node, members in by_node.items():
        if sorted(m["local_rank"] for m in members) != list(range(len(members))):
            problems.append(f"node {node} has local ranks {sorted(m['local_rank'] for m in members)}")
    if nodes is not None and len(by_node) != int(nodes):
        problems.append(f"{len(by_node)} node(s) {sorted(by_node)} where cluster.nodes={nodes}")
    if problems:
        seen = "; ".join(f"rank {r['rank']}: {r['env']}" for r in layout)
        raise RuntimeError(f"the world is not the configured one ({', '.join(problems)}); variables seen: {seen}")
    return [{k: v for k, v in r.items() if k != "env"} for r in layout]


def format_layout(layout: list[dict[str, Any]]) -> str:
    """The world layout printed at start: one line per rank."""
    nodes = sorted({r["node"] for r in layout})
    lines = [f"world: {len(layout)} ranks on {len(nodes)} node(s)"]
    lines += [f"  node {r['node']} host {r['host']} local_rank {r['local_rank']} rank {r['rank']} device {r['device']}"
              for r in sorted(layout, key=lambda r: r["rank"])]
    return "\n".join(lines)


def nodes_of(layout: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """summary.json's ``nodes``: per node its host(s), ranks and devices."""
    out = []
    for node in sorted({r["node"] for r in layout}):
        members = sorted((r for r in layout if r["node"] == node), key=lambda r: r["rank"])
        out.append({"node": node, "hosts": sorted({m["host"] for m in members}), "ranks": [m["rank"] for m in members],
                    "devices": [m["device"] for m in members]})
    return out


def launcher_identity() -> dict[str, Any]:
    """This process as its launcher sees it: host, pid and the launcher's variables that are set."""
    env = {k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ}
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "env": env}


def run_external(*, config: dict[str, Any], run_dir: Path, budget: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Run this process's rank; if it fails, raise the failure of the rank that failed first.

    When one rank raises, its peers only see a closed connection once it has exited; each failing
    rank writes its traceback to ``run_dir/failures/<attempt>/`` and reports the earliest one, so the
    job's error (what Hydra and the Slurm launcher show for rank 0) is the root cause, as with the local
    launcher. A rank never waits for later failures (its peers may be blocked on it), only briefly for
    an earlier report that a shared file system has not shown yet.
    """
    from sdp.results import write_json
    from sdp.worker import run_rank

    try:
        return run_rank(config, str(run_dir), budget)
    except Exception:
        rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
        folder = run_dir / "failures" / "-".join(os.environ.get(k, "") for k in ATTEMPT_ENV)
        folder.mkdir(parents=True, exist_ok=True)
        mine = {"rank": int(rank), "time": time.time(), "traceback": traceback.format_exc()}
        write_json(folder / f"rank{rank}.json", mine)
        deadline = time.time() + FAILURE_GRACE_S
        while True:
            reports = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
            if len(reports) > 1 or time.time() > deadline:
                break
            time.sleep(0.5)
        from sdp.guards import PEER_LOST

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
    from sdp.guards import PEER_LOST

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


def launch(*, cfg: DictConfig, run_dir: Path, budget: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Run the job's ranks and return rank 0's summary (None on other ranks of an external job).

    ``budget``: what the driver counted to resolve ``train.steps``; rank 0 puts it in summary.json."""
    from sdp.worker import run_rank

    config = OmegaConf.to_container(cfg, resolve=True)
    if external_launcher():
        return run_external(config=config, run_dir=run_dir, budget=budget)
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
        outputs = elastic_launch(launch_cfg, run_rank)(config, str(run_dir), budget)
    except ChildFailedError as exc:
        rank, failure, message = root_cause(exc.failures)
        others = sorted(r for r in exc.failures if r != rank)
        also = f" (then also rank(s) {others})" if others else ""
        raise RankFailure(
            f"rank {rank} of {world} failed (exit code {failure.exitcode}){also}:\n{message}",
            rank=rank, exitcode=failure.exitcode,
        ) from None
    return outputs.get(0)
