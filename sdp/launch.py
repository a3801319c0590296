"""Starting ranks: torch elastic locally (the engine behind torchrun), or nothing at all when the
process already is a rank of an external launcher (torchrun, Slurm tasks).

Under Slurm (``cluster.name=slurm``) every Slurm task is one rank: :func:`slurm_environment` turns
the task's SLURM_* variables into the torch.distributed ones, so nothing is spawned inside a task.

Why elastic and not a hand-written process manager: it picks a free rendezvous port, sets the rank
environment, watches every worker, and when one raises it tears the others down within a monitor
interval and returns the failed rank's traceback (recorded by ``@record`` in the worker).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


class RankFailure(RuntimeError):
    """A rank of the job raised; the message carries the rank and its traceback."""


def external_launcher() -> bool:
    """True when RANK and WORLD_SIZE are already set (torchrun, Slurm + submitit)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# Variables that say which launcher started a rank and as what (recorded per rank in summary.json).
LAUNCHER_ENV = (
    "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID", "SLURM_PROCID",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_RESTART_COUNT", "SUBMITIT_EXECUTOR", "TORCHELASTIC_RUN_ID",
    "GROUP_RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
)
FAILURE_GRACE_S = 10.0  # how long a failing rank waits for the other ranks' error reports
# What tells one attempt of a job from another in the same run directory (requeue, elastic restart).
ATTEMPT_ENV = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")


def launcher_identity() -> dict[str, Any]:
    """This process as its launcher sees it: host, pid and the launcher's variables that are set."""
    env = {k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ}
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "env": env}


def master_port(*, job_id: int) -> int:
    """A rendezvous port from the Slurm job id: 20000 + id mod 40000. Every element of a job array
    has its own consecutive SLURM_JOB_ID, so jobs sharing a node never pick the same port (a
    random draw, as in submitit's helper, collides now and then)."""
    return 20000 + job_id % 40000


def slurm_environment(*, cluster: DictConfig) -> None:
    """Make this Slurm task a torch.distributed rank (``cluster.name=slurm``; no-op otherwise).

    Exports MASTER_ADDR (first node of the job), MASTER_PORT (from the job id unless already set),
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from SLURM_* variables; works for tasks started
    by the submitit launcher and by a plain ``srun`` (slurm/sdp.sbatch) alike.
    """
    from sdp.config import ConfigError, require

    if cluster.name != "slurm" or external_launcher():
        return
    if "SLURM_JOB_ID" not in os.environ or "SLURM_STEP_ID" not in os.environ:
        raise ConfigError(
            "cluster.name='slurm' runs every rank as a Slurm task, but this process is not a Slurm job step: "
            "add --multirun (-m) so Hydra's submitit launcher submits the job, or start it with srun "
            "(slurm/sdp.sbatch); for local processes use cluster=local"
        )
    from submitit.slurm.slurm import SlurmJobEnvironment

    env = SlurmJobEnvironment()  # parses SLURM_JOB_NODELIST (node[01-04] style) for the first host
    require(env.num_tasks == int(cluster.world_size), "cluster.world_size", cluster.world_size,
            f"this Slurm job has {env.num_tasks} tasks (SLURM_NTASKS); launch nodes x tasks_per_node = "
            "cluster.nodes x cluster.tasks_per_node tasks (hydra.launcher resources cannot change per sweep job)")
    os.environ.update(
        MASTER_ADDR=env.hostnames[0],
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(master_port(job_id=int(env.raw_job_id))),
        RANK=str(env.global_rank),
        WORLD_SIZE=str(env.num_tasks),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.num_tasks // env.num_nodes),
    )


def run_external(*, config: dict[str, Any], run_dir: Path) -> dict[str, Any] | None:
    """Run this process's rank; if it fails, raise the failure of the rank that failed first.

    When one rank raises, its peers only see a closed connection; each failing rank writes its
    traceback to ``run_dir/failures/<attempt>/`` and reports the earliest one, so the job's error (what Hydra
    and the Slurm launcher show for rank 0) is the root cause, as with the local launcher.
    """
    from sdp.results import write_json
    from sdp.worker import run_rank

    try:
        return run_rank(config, str(run_dir))
    except Exception:
        rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
        folder = run_dir / "failures" / "-".join(os.environ.get(k, "") for k in ATTEMPT_ENV)
        folder.mkdir(parents=True, exist_ok=True)
        mine = {"rank": int(rank), "time": time.time(), "traceback": traceback.format_exc()}
        write_json(folder / f"rank{rank}.json", mine)
        deadline = time.time() + FAILURE_GRACE_S
        reports = [mine]
        while time.time() < deadline:
            reports = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
            if len(reports) == int(world):
                break
            time.sleep(0.5)
        first = min(reports, key=lambda r: r["time"])
        others = sorted(r["rank"] for r in reports if r is not first)
        raise RankFailure(
            f"rank {first['rank']} of {world} failed first (ranks {others} failed after it):\n{first['traceback']}"
        ) from None


def launch(*, cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Run the job's ranks and return rank 0's summary (None on other ranks of an external job)."""
    from sdp.worker import run_rank

    config = OmegaConf.to_container(cfg, resolve=True)
    if external_launcher():
        return run_external(config=config, run_dir=run_dir)
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
        rank, failure = exc.get_first_failure()
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        inner = data.get("message", {})
        callstack = inner.get("extraInfo", {}).get("py_callstack") if isinstance(inner, dict) else None
        message = callstack or failure.message
        raise RankFailure(f"rank {rank} of {world} failed (exit code {failure.exitcode}):\n{message}") from None
    return outputs.get(0)
