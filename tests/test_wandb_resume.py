"""One W&B run per job across a kill and a resume, offline (issue 19, part 2): the run id lives in the
run directory and in every checkpoint, the resumed attempt logs into the same run from the checkpoint's
step on, and the offline directories hold both halves' history and the config from the start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.helpers import REPO, sdp_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

RUN = ["experiment=smoke", "logger.wandb.mode=offline", "logger.progress=false", "parallelism=ddp", "train.steps=8",
       "train.eval_every=0", "train.checkpoint_every=3"]
KILL = ["train.debug.fault=kill", "train.debug.fault_rank=1", "train.debug.fault_step=6"]


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``run-<id>.wandb`` transaction log (a leveldb-style log of 32 KiB
    blocks after a 7-byte ``:W&B`` header; wandb 0.31 ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log: {data[:7]!r}"
    pos, block, chunks, partial = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            chunks.append(chunk)
        elif kind == 2:  # first
            partial = chunk
        elif kind == 3:  # middle
            partial += chunk
        else:  # last
            chunks.append(partial + chunk)
    return [pb.Record.FromString(c) for c in chunks]


def attempt(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = sdp_env()
    env.pop("WANDB_MODE", None)
    env.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    cmd = [sys.executable, "-m", "sdp.driver.train", f"hydra.run.dir={run_dir}", *RUN, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_killed_and_resumed_job_is_one_wandb_run_with_both_halves(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    killed = attempt(run_dir, *KILL)
    assert killed.returncode != 0, "the killed attempt must fail"
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    meta = json.loads((run_dir / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["wandb_run_id"] == run_id, "the checkpoint carries the run id"
    resumed = attempt(run_dir, "train.resume=auto")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id, "one run id for the job"

    halves = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [h.name.rsplit("-", 1)[-1] for h in halves] == [run_id, run_id], f"two attempts of run {run_id}: {halves}"
    steps = []
    for half in halves:
        records = wandb_records(half / f"run-{run_id}.wandb")
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert run.run_id == run_id
        steps.append([r.history.step.num for r in records if r.WhichOneof("record_type") == "history"])
        config = OmegaConf.load(half / "files" / "config.yaml")
        assert config.train.value.steps == 8, "the config is on disk from the start of each attempt"
    first, second = steps
    assert first[:3] == [1, 2, 3], f"the killed attempt's history up to its checkpoint is kept: {first}"
    assert second == [4, 5, 6, 7, 8], f"the resumed attempt continues from the checkpoint's step, not 0: {second}"
