"""Slurm tier: real sweeps through Hydra's submitit launcher on a running Slurm controller.

Start one on this machine with ``bash slurm/local/start.sh`` (``slurm/local/ci.sh`` starts it, runs
``pytest -m slurm`` and stops it). Skipped only when no controller answers ``sinfo``.
Every Slurm task is one rank; the tests read the results contract back from the sweep directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run_train, sdp_env

pytestmark = [pytest.mark.slurm]

# Strategies the sweep test runs, one Slurm job each (extend the list to sweep more of them).
STRATEGIES = "ddp,sdp"
# Small, fast jobs: 2 tasks per job (cluster/slurm.yaml default), short Slurm time limit.
COMMON = ("cluster=slurm", "model=mlp", "train.eval_every=0", "train.warmup_steps=1", "hydra.launcher.timeout_min=10")


def slurm_unavailable() -> str | None:
    """Why no Slurm controller can be used here, or None when ``sinfo`` reaches one."""
    if shutil.which("sinfo") is None:
        return "no Slurm client (sinfo) installed: start a test cluster with `bash slurm/local/start.sh`"
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"no Slurm controller reachable (sinfo: {out.stderr.strip()}): run `bash slurm/local/start.sh`"
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm_controller() -> None:
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)


def summaries(sweep: Path) -> dict[str, dict]:
    """Job number -> summary.json of every finished job of a sweep."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))}


def launcher_env(summary: dict) -> list[dict]:
    return [r["env"] for r in summary["launcher"]["per_rank"]]


@pytest.mark.timeout(240)
def test_sweep_runs_every_rank_as_a_slurm_task(tmp_path):
    # The sweep dir keeps the per-process ${sdp_uid:} resolver: every task must see the driver's value.
    job = run_train(tmp_path / "sweep_${sdp_uid:}", *COMMON, f"parallelism={STRATEGIES}", "train.steps=6",
                    multirun=True, timeout=230)
    sweeps = list(tmp_path.iterdir())
    assert len(sweeps) == 1, f"tasks resolved different sweep dirs: {sweeps}\n{job.output[-3000:]}"
    found = summaries(sweeps[0])
    names = STRATEGIES.split(",")
    assert sorted(found) == [str(i) for i in range(len(names))], f"jobs with summary.json: {sorted(found)}\n{job.output[-3000:]}"
    assert [found[str(i)]["strategy"] for i in range(len(names))] == names
    ports, job_ids = set(), set()
    for num, s in found.items():
        assert s["world_size"] == 2 and s["steps"] == 6, s
        envs = launcher_env(s)
        assert [e.get("SLURM_PROCID") for e in envs] == ["0", "1"], f"job {num}: ranks were not Slurm tasks 0,1: {envs}"
        assert len({r["pid"] for r in s["launcher"]["per_rank"]}) == 2, f"job {num}: ranks shared a process"
        assert len({e["SLURM_JOB_ID"] for e in envs}) == 1, f"job {num}: ranks in different Slurm jobs: {envs}"
        job_id = int(envs[0]["SLURM_JOB_ID"])
        assert {e["MASTER_PORT"] for e in envs} == {str(20000 + job_id % 40000)}, envs
        assert "TORCHELASTIC_RUN_ID" not in envs[0], "a rank was spawned by torch elastic inside the task"
        job_ids.add(job_id)
        ports.add(envs[0]["MASTER_PORT"])
        assert (sweeps[0] / num / "config.yaml").exists() and (sweeps[0] / num / "metrics.jsonl").exists()
    assert len(job_ids) == len(names) and len(ports) == len(names), f"jobs of the sweep shared a Slurm job or port: {job_ids} {ports}"
    assert "tables written to" in job.output, f"no multirun-end report after the Slurm sweep:\n{job.output[-3000:]}"


@pytest.mark.timeout(240)
def test_crashing_rank_fails_its_job_with_the_error_and_the_sweep_ends(tmp_path):
    sweep = tmp_path / "sweep"
    # Job 0 injects a failure on rank 1; job 1 names a rank that does not exist, so it trains normally.
    job = run_train(sweep, *COMMON, "parallelism=ddp", "model._target_=tests.faulty.FaultyMLP",
                    "+model.fail_rank=1,99", "+model.fail_step=2", "train.steps=6", "cluster.timeout_s=60",
                    multirun=True, check=False, timeout=230)
    assert job.proc.returncode != 0, job.output[-3000:]
    assert "injected failure on rank 1 at step 2" in job.output, job.output[-3000:]
    assert "rank 1 of 2 failed first" in job.output, job.output[-3000:]
    found = summaries(sweep)
    assert sorted(found) == ["1"], f"expected only the healthy job to finish, got {sorted(found)}"


@pytest.mark.timeout(300)
def test_preempted_job_is_requeued_and_resumes_to_the_uninterrupted_result(tmp_path):
    """``scancel --signal=USR1`` on job 0 of a sweep of two identical jobs after its second checkpoint:
    job 0 is requeued (same Hydra job, same run dir), continues from its latest checkpoint (step 1 is
    logged once) and ends with bitwise the same parameters as job 1, which was never interrupted."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "sdp.driver.train", "-m", f"hydra.sweep.dir={sweep}", "logger.wandb.mode=disabled",
           "logger.progress=false", "cluster=slurm", "model=resnet18_cifar", "parallelism=ddp", "train.steps=30",
           "train.eval_every=0", "train.warmup_steps=1", "hydra.launcher.timeout_min=10", "seed=0,0",
           "train.resume=auto", "train.checkpoint_every=5"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=sdp_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = sweep / "0" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            text = metrics.read_text() if metrics.exists() else ""
            rows = [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines()]  # complete rows only
            if rows and rows[-1]["step"] >= 10:  # mid-run, after two checkpoints
                break
            time.sleep(0.2)
        array = next((sweep / ".submitit").glob("*_0")).name  # "<array job id>_0": job 0 of the sweep
        subprocess.run(["scancel", "--signal=USR1", array], check=True, timeout=30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # the test failed while the sweep ran: leave no job behind
            proc.kill()
            for job in (sweep / ".submitit").glob("*_*"):
                subprocess.run(["scancel", job.name], timeout=30)
    assert proc.returncode == 0, out[-4000:]
    found = summaries(sweep)
    assert sorted(found) == ["0", "1"], out[-3000:]
    restarts = [[e.get("SLURM_RESTART_COUNT") for e in launcher_env(found[n])] for n in ("0", "1")]
    assert restarts[0] == ["1", "1"], f"job 0 was not requeued once: {restarts}"
    assert restarts[1] in (["0", "0"], [None, None]), f"job 1 should not have been requeued: {restarts}"
    steps = [json.loads(x)["step"] for x in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    logged_first_step = steps.count(1)
    assert logged_first_step == 1, f"step 1 logged {logged_first_step}x (retrained from scratch?): {steps}"
    digests = [[m["param_digest"] for m in found[n]["memory"]["per_rank"]] for n in ("0", "1")]
    assert digests[0] == digests[1], f"requeued job ended with other parameters: {digests}"
    assert found["0"]["final"] == found["1"]["final"]
