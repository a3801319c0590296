"""A hang ends within ``cluster.timeout_s`` wherever it happens, and the report says where.

- A rank stalled inside a holder-set all-reduce (a sub-group, not the world) makes its peer fail after
  the job's timeout, not torch's per-backend default for ``new_group`` (30 minutes on gloo, 10 on
  NCCL), with a message naming the step and the group (``sdp.rank.guards.naming_step`` with
  ``sdp.core.distctx.WHERE``): spawned gloo ranks (default tier) and a whole SDP job (slow tier).
- A rank that dies without a Python error (NCCL's watchdog aborts the process on a timeout under its
  default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``) has already left its step and groups in its failure file,
  which the launcher's report quotes (``sdp.core.distctx.last_position``).
- Under Slurm a task that dies ends the job step (``srun --kill-on-bad-exit=1``) in both the submitit
  launcher's config and the sbatch scripts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run_train, spawn

TIMEOUT_S = 3  # the job's cluster.timeout_s in these tests
MARGIN_S = 30  # generous: the old behaviour (torch's default) takes 30 minutes on gloo


def _stall_in_holder_set(rank: int, world: int) -> dict | None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from sdp.rank.guards import StepFailure, naming_step
    from sdp.subnet.holder_groups import GroupSet

    dist.set_timeout(timedelta(seconds=TIMEOUT_S))  # the default group's: what cluster.timeout_s sets
    groups = GroupSet(world_size=world, holder_sets=[(0, 1), (1, 2)], refresh=False)
    dist.set_timeout(timedelta(seconds=TIMEOUT_S + MARGIN_S))  # the barrier below waits for rank 0's failure
    if rank != 0:  # rank 1 stalls: it never enters the all-reduce of its holder set (0, 1)
        dist.barrier()
        return None
    start = time.time()
    try:
        with naming_step(step=5, rank=rank, timeout_s=TIMEOUT_S):
            dist.all_reduce(torch.ones(4), group=groups.get((0, 1)))
        got = {"seconds": time.time() - start, "message": "the all-reduce completed"}
    except StepFailure as exc:
        got = {"seconds": time.time() - start, "message": str(exc)}
    dist.barrier()
    return got


@pytest.mark.dist
@pytest.mark.slow  # slow tier (CI time)
@pytest.mark.timeout(120)
def test_a_rank_stalled_in_a_holder_set_all_reduce_fails_its_peer_within_the_timeout_naming_step_and_group() -> None:
    got = spawn(_stall_in_holder_set, world=3, timeout_s=TIMEOUT_S + MARGIN_S)[0]
    assert got["seconds"] < TIMEOUT_S + MARGIN_S, got
    message = got["message"]
    assert "step 5 failed on rank 0" in message and f"cluster.timeout_s={TIMEOUT_S}" in message, message
    assert "collectives of step 5 went to ranks (0, 1)" in message, message


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_an_sdp_job_with_a_rank_hung_before_its_holder_set_all_reduce_ends_within_the_timeout(tmp_path: Path) -> None:
    """Three ranks, block-level SDP at C = 0.5 (holder sets of two ranks), blocking all-reduces in holder-set
    order (``overlap=false``: each rank's first collective of a step is a holder-set one); rank 1 hangs
    before step 3, so its peers wait in holder-set groups (rank 2 in (0, 2) for rank 0, which waits in
    (0, 1)). The job ends within the timeout naming the step and a holder set."""
    timeout = 5
    start = time.time()
    job = run_train(tmp_path / "hang", "experiment=smoke", "parallelism=sdp", "parallelism.overlap=false",
                    "cluster.world_size=3", "train.steps=6", "train.eval_every=0", "logger.progress=false",
                    f"cluster.timeout_s={timeout}", "train.debug.fault=hang", "train.debug.fault_rank=1",
                    "train.debug.fault_step=3", timeout=240, check=False)
    out = job.output
    assert job.proc.returncode != 0, out[-3000:]
    t_hang = float(re.search(r"hanging at step 3 t=([0-9.]+)", out).group(1))
    print(f"\nhang -> job end: {job.ended - t_hang:.1f} s (cluster.timeout_s={timeout}; {job.ended - start:.0f} s in all)")
    assert job.ended - t_hang < timeout + 60, out[-3000:]
    assert re.search(r"step 3 failed on rank \d .*collectives of step 3 went to ranks \(\d, \d\)", out), out[-3000:]


ABORT = """
import os, signal, sys
from sdp.core.distctx import WHERE
WHERE.keep_at(sys.argv[1], rank=2, world=4)
WHERE.begin_step(4)
WHERE.used((0, 2), world=4)
WHERE.used((0, 1, 2, 3), world=4)
os.kill(os.getpid(), signal.SIGABRT)  # what NCCL's watchdog does to a rank on a timeout
"""


def test_a_rank_aborted_without_a_python_error_leaves_its_step_and_groups_in_its_failure_file(tmp_path: Path) -> None:
    from sdp.core.distctx import last_position

    path = tmp_path / "failure_rank2.json"
    proc = subprocess.run([sys.executable, "-c", ABORT, str(path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -6, (proc.returncode, proc.stderr[-2000:])
    saved = json.loads(path.read_text())
    assert saved["rank"] == 2 and saved["step"] == 4 and saved["groups"] == [[0, 2], [0, 1, 2, 3]], saved
    assert saved["state"].startswith("running"), saved
    assert "Current thread" in proc.stderr, "faulthandler printed no Python stack on the abort: " + proc.stderr[-2000:]
    line = last_position(str(path))
    assert "rank 2 was at: collectives of step 4 went to ranks (0, 2) then world" in line, line


def test_a_rank_that_finishes_or_raises_leaves_no_running_position(tmp_path: Path) -> None:
    from sdp.core.distctx import Whereabouts, last_position

    where = Whereabouts()
    path = tmp_path / "failure_rank0.json"
    where.keep_at(str(path), rank=0, world=2)
    where.begin_step(1)
    assert "step 1" in last_position(str(path))
    where.release()
    assert not path.exists(), "a rank that finished cleanly leaves no failure file"
    path.write_text(json.dumps({"rank": 0, "error": "StepFailure", "message": "step 1 failed"}))
    assert last_position(str(path)) == "", "a raised error's file is the rank's own account, not a position"


def test_slurm_launcher_and_sbatch_scripts_end_the_step_when_a_task_dies(tmp_path: Path) -> None:
    from submitit.slurm.slurm import SlurmExecutor, _make_sbatch_string

    from tests.hydra_cfg import compose_config

    for name in ("slurm", "slurm_gpu"):
        launcher = compose_config(f"cluster={name}", hydra=True).hydra.launcher
        assert "--kill-on-bad-exit=1" in launcher.srun_args, (name, launcher.srun_args)
    # submitit takes the key (the launcher hands it over as slurm_srun_args) and puts it on the srun line
    assert "srun_args" in SlurmExecutor._valid_parameters()
    script = _make_sbatch_string(command="python -m sdp.driver.train", folder=str(tmp_path), srun_args=list(launcher.srun_args))
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert srun and "--kill-on-bad-exit=1" in srun[0], script
    scripts = sorted((REPO / "slurm").glob("*.sbatch"))
    assert scripts, "no slurm/*.sbatch"
    for path in scripts:
        sruns = [line for line in path.read_text().splitlines() if re.match(r"\s*srun\b", line)]
        assert sruns and all("--kill-on-bad-exit=1" in line for line in sruns), f"{path.name}: {sruns}"
