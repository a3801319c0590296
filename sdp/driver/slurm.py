"""Slurm tasks as ranks, and what a task does when Slurm asks it to make room.

Every Slurm task of a job is one rank: :func:`slurm_environment` turns the task's SLURM_* variables
into the torch.distributed ones (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE),
so the worker runs in-process (``sdp.rank.rankenv.external_launcher``) and nothing is spawned again. It
works for tasks started by Hydra's submitit launcher (``cluster=slurm`` with ``-m``) and by a plain
``srun`` (``slurm/sdp.sbatch``) alike, single- or multi-node.

Preemption and time limits (:func:`install_preemption_handlers`): SIGUSR1 or SIGUSR2 (``scancel
--signal=...``, or Slurm's ``--signal=USR2@<delay>`` before the time limit) makes rank 0 requeue
the job and exit; the requeued job runs the same Hydra job (same overrides, same run directory) and,
with ``train.resume=auto``, continues from the run directory's latest checkpoint.

A crashed task ends the job step (``srun --kill-on-bad-exit=1``) instead of leaving its peers in a
collective until ``cluster.timeout_s``: ``slurm/*.sbatch`` pass it to srun, and ``cluster=slurm``
selects the launcher config :class:`SlurmLauncherConf` (``hydra/launcher: sdp_submitit_slurm``),
hydra-submitit-launcher 1.2.0's own plus ``srun_args``, which submitit puts on its srun line (the
plugin's schema lacks that key although submitit takes it).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from omegaconf import DictConfig

from sdp.rank.rankenv import external_launcher

log = logging.getLogger(__name__)

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
MAX_REQUEUES = int(os.environ.get("SDP_MAX_REQUEUES", "3"))  # plain-srun jobs: requeues before giving up


@dataclass
class SlurmLauncherConf(SlurmQueueConf):
    """hydra-submitit-launcher's Slurm config plus ``srun_args``: arguments submitit adds to the srun
    line of the job's sbatch script (``submitit.slurm.slurm._make_sbatch_string``; the launcher hands
    every key it gets, prefixed ``slurm_``, to ``executor.update_parameters``)."""

    srun_args: list[str] = field(default_factory=list)


# Registered on import (sdp.driver.train imports this module before Hydra composes the config).
ConfigStore.instance().store(group="hydra/launcher", name="sdp_submitit_slurm", node=SlurmLauncherConf, provider="sdp")


def master_port(*, job_id: int) -> int:
    """A rendezvous port from the Slurm job id: 20000 + id mod 40000. Every element of a job array
    has its own consecutive SLURM_JOB_ID, so jobs sharing a node never pick the same port (a
    random draw, as in submitit's helper, collides now and then)."""
    return 20000 + job_id % 40000


def slurm_environment(*, cluster: DictConfig) -> None:
    """Make this Slurm task a torch.distributed rank (``cluster.name=slurm``; no-op otherwise).

    MASTER_ADDR is the job's first node, MASTER_PORT comes from the job id unless already set.
    Not ``submitit.helpers.TorchDistributedEnvironment``: it needs a submitit job (no plain srun),
    draws a random port and masks CUDA_VISIBLE_DEVICES, while the worker selects ``cuda:LOCAL_RANK``.
    """
    from sdp.errors import ConfigError, require

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
            f"this Slurm job step has {env.num_tasks} tasks (SLURM_NTASKS); launch cluster.nodes x "
            "cluster.tasks_per_node tasks (hydra.launcher resources are fixed for a whole sweep)")
    os.environ.update(
        MASTER_ADDR=env.hostnames[0],
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(master_port(job_id=int(env.raw_job_id))),
        RANK=str(env.global_rank),
        WORLD_SIZE=str(env.num_tasks),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.num_tasks // env.num_nodes),
    )
    install_preemption_handlers()


def install_preemption_handlers() -> None:
    """Route SIGUSR1 and SIGUSR2 to a requeue (signals that already have a Python handler are kept).

    In a submitit task, submitit already handles its preemption signal (USR2 since submitit 1.5,
    ``SUBMITIT_PREEMPT_SIGNAL``): rank 0 calls the Hydra launcher's ``checkpoint()`` (a resubmission
    of the same job), runs ``scontrol requeue`` and exits, counting time-limit requeues against
    ``hydra.launcher.max_num_timeout``. The other USR signal gets that same handler, so
    ``scancel --signal=USR1`` works too. Under a plain srun, :func:`requeue_and_exit` does the same.
    """
    handler: Callable[..., Any] = requeue_and_exit
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        from submitit.core.job_environment import JobEnvironment

        current = signal.getsignal(JobEnvironment._usr_sig())
        if callable(current):
            handler = current
    for sig in PREEMPT_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, handler)


def requeue_and_exit(signum: int, frame: types.FrameType | None = None) -> None:
    """Rank 0: ``scontrol requeue`` this job (Slurm then ends every task) and exit; other ranks wait."""
    name = signal.Signals(signum).name
    if int(os.environ.get("SLURM_PROCID", "0")) != 0:
        log.warning("caught %s: rank 0 requeues the job", name)
        return
    job, restarts = os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= MAX_REQUEUES:
        log.error("caught %s: job %s already requeued %d times (SDP_MAX_REQUEUES=%d): not requeued",
                  name, job, restarts, MAX_REQUEUES)
        return
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        log.error("caught %s: scontrol requeue %s failed (is the job requeueable? sbatch --requeue): %s",
                  name, job, out.stderr.strip())
        return
    log.warning("caught %s: requeued job %s (restart %d); exiting", name, job, restarts + 1)
    sys.exit(-1)
