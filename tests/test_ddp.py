"""DDP through the real launcher on the bundled digits set: training, the results contract,
identical replicas, exact comm accounting, multirun directories and fail-fast."""

from __future__ import annotations

import time

import pytest

from tests.helpers import CORE, REPO, run_train, sdp_env

pytestmark = [pytest.mark.dist]

FAST = ("model.width=8", "dataset.image_size=8", "train.steps=30", "train.eval_every=15", "train.warmup_steps=2")


def check_contract(job, *, world: int, steps: int) -> dict:
    s = job.summary
    for key in ("strategy", "world_size", "steps", "final", "memory", "comm", "time", "versions", "machine"):
        assert key in s, f"summary.json lacks {key!r}: {sorted(s)}"
    assert s["world_size"] == world and s["steps"] == steps
    assert set(s["final"]) >= {"train_loss", "eval_loss", "eval_accuracy"}
    assert [m["rank"] for m in s["memory"]["per_rank"]] == list(range(world))
    for m in s["memory"]["per_rank"]:
        assert set(m) >= {"rank", "param_bytes", "grad_bytes", "optim_bytes", "peak_rss_delta_bytes"}
    for c in s["comm"]["per_rank"]:
        assert set(c) >= {"rank", "bytes_per_step", "collectives_per_step"}
    assert s["time"]["step_s_median"] > 0 and s["time"]["samples_per_s"] > 0
    assert set(s["versions"]) >= {"python", "torch", "sdp", "git_commit"}
    rows = job.metrics
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert set(r) >= {"step", "loss", "lr", "samples_per_s"}
    assert evals and evals[-1]["step"] == steps and 0 <= evals[-1]["eval_accuracy"] <= 1
    assert (job.run_dir / "config.yaml").exists()
    return s


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [pytest.param(2, marks=CORE), 4])
def test_ddp_trains_and_follows_contract(train_job, world: int):
    job = train_job("parallelism=ddp", f"cluster.world_size={world}", *FAST)
    s = check_contract(job, world=world, steps=30)
    losses = [r["loss"] for r in job.metrics if "loss" in r]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, f"loss did not fall: {losses}"
    digests = {m["param_digest"] for m in s["memory"]["per_rank"]}
    assert len(digests) == 1, f"replicas differ after training: {digests}"
    # DDP must all-reduce exactly the gradients: bytes per step == the model's gradient bytes.
    for m, c in zip(s["memory"]["per_rank"], s["comm"]["per_rank"]):
        assert c["bytes_per_step"] == m["param_bytes"] == m["grad_bytes"], (m, c)
        assert c["by_group_size"] == {str(world): {"bytes": m["param_bytes"], "count": c["collectives_per_step"]}}
    assert s["final"]["eval_accuracy"] > 0.3


@pytest.mark.timeout(300)  # slow tier (CI time): tests/test_report.py runs a multirun in the default tier
def test_multirun_jobs_get_distinct_directories(tmp_path):
    sweep = tmp_path / "sweep"
    job = run_train(sweep, "parallelism=ddp", "seed=0,1", "model=mlp", "train.steps=5", "train.eval_every=0",
                    multirun=True)
    dirs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert [d.name for d in dirs] == ["0", "1"], f"expected two job dirs, got {list(sweep.iterdir())}\n{job.output}"
    import json

    seeds = [json.loads((d / "summary.json").read_text())["seed"] for d in dirs]
    assert seeds == [0, 1]


@CORE
@pytest.mark.timeout(90)
def test_rank_that_raises_ends_the_job_fast_with_its_traceback(train_job):
    t0 = time.monotonic()
    job = train_job(
        "parallelism=ddp", "model=mlp", "+model.fail_rank=1", "+model.fail_step=2",
        "model._target_=tests.faulty.FaultyMLP", "train.steps=50", "cluster.timeout_s=300", check=False,
    )
    elapsed = time.monotonic() - t0
    assert job.proc.returncode != 0
    assert "injected failure on rank 1 at step 2" in job.output and "rank 1 of 2 failed" in job.output, job.output[-3000:]
    assert "Traceback" in job.output
    assert elapsed < 60, f"job took {elapsed:.1f}s to fail"


@pytest.mark.slow  # slow tier (CI time)
@pytest.mark.timeout(180)
def test_inside_torchrun_it_does_not_spawn_again(tmp_path):
    """Under an external launcher (RANK/WORLD_SIZE set) each process is one rank: no second spawn."""
    import json
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "sdp.driver.train",
           f"hydra.run.dir={run_dir}", "parallelism=ddp", "model=mlp", "train.steps=4", "train.eval_every=0",
           "cluster.world_size=2", "logger.wandb.mode=disabled", "logger.progress=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=sdp_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and not (run_dir / "rank_logs").exists(), "spawned its own ranks under torchrun"


def _wrapped_on_rank(rank: int, world: int) -> dict:
    """Each rank builds its module from its own seed; after wrap_ddp every rank holds rank 0's values, and the
    sync allocated nothing beyond the module (no flat broadcast copy, so DDP's set-up peak is params + buckets)."""
    import torch
    from omegaconf import OmegaConf

    from sdp.metrics.comm import CommCounter
    from sdp.metrics.live import LiveTensorTracker
    from sdp.parallel.ddp import sync_in_place

    torch.manual_seed(rank)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    net[1].running_mean.fill_(float(rank))
    tracker = LiveTensorTracker()
    with tracker:
        tracker.label([*net.parameters(), *net.buffers()], "parameters")
        before = tracker.total
        sync_in_place(net, process_group=None, buffers=False)
    from sdp.parallel.ddp import wrap_ddp  # the whole wrapper too: it must keep working without DDP's own sync
    cfg = OmegaConf.create({"broadcast_buffers": False, "bucket_cap_mb": 25, "find_unused_parameters": False})
    wrap_ddp(net, cfg=cfg, comm=CommCounter(), device=torch.device("cpu"))
    return {"weight": net[0].weight.detach().clone(), "mean": net[1].running_mean.clone(), "allocated": tracker.peak - before}


def test_ddp_starts_every_rank_from_rank_0_without_a_flat_copy() -> None:
    import torch

    from tests.helpers.ranks import spawn

    out = spawn(_wrapped_on_rank, world=2, timeout_s=120)
    assert torch.equal(out[0]["weight"], out[1]["weight"]), "rank 1's parameters are not rank 0's after wrap_ddp"
    assert float(out[1]["mean"][0]) == 1.0, "broadcast_buffers=false: rank 1 keeps its own buffers"
    assert [o["allocated"] for o in out] == [0, 0], [o["allocated"] for o in out]
