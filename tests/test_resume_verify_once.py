"""A checkpoint is verified once per job, not in every rank's process (issue 35, item 3).

Under Slurm tasks or torchrun each rank runs the driver itself; each used to hash the whole checkpoint before its
peers could set up their communicators (8 ranks per node x 13 GB for LLaMA-1B with AdamW). Now rank 0 verifies
and hands its verdict to the others through the run directory (:func:`sdp.driver.checkpoint_resume.resolve_once`),
which rank 0 removes once they have read it. Unit tests run the job's processes as threads; the end-to-end test
runs two torchrun ranks with a plugin that logs every hash (``tests/count_hashes.py``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

from sdp.errors import ConfigError
from sdp.rank import checkpoint, checkpoint_io
from sdp.driver import checkpoint_resume
from sdp.driver.checkpoint_resume import CheckpointWarning
from sdp.results.rundir import RunDir
from tests.helpers import REPO, run_train, sdp_env
from tests.test_checkpoint_integrity import flip_a_byte, truncate, two_checkpoints
from tests.test_resume_finished import files as digest

pytestmark = pytest.mark.timeout(300)


def job(run_dir: Path, world: int, *, monkeypatch: pytest.MonkeyPatch, timeout_s: float = 30,
        ranks: range | None = None) -> tuple[dict[int, Any], list[str]]:
    """``resolve_once`` in ``world`` threads standing for the job's processes (``ranks``: those that run; rank 0
    absent: it never writes its verdict); returns each rank's result (a path or the exception) and the thread
    of every file hashed."""
    hashed: list[str] = []
    real = checkpoint_io.file_entry

    def counted(path: Path) -> dict[str, Any]:
        hashed.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr(checkpoint_io, "file_entry", counted)
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            out[r] = checkpoint_resume.resolve_once(resume="auto", run_dir=run_dir, rank=r, attempt="job-1",
                                                    timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 (returned to the test, which names it)
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (ranks or range(world))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    return out, hashed


def test_rank_zero_alone_hashes_and_every_rank_takes_its_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    older, latest = two_checkpoints(tmp_path)
    flip_a_byte(latest / "shared.pt")  # only a hash finds it: a rank that did not hash would pick step 6
    out, hashed = job(tmp_path, 3, monkeypatch=monkeypatch)
    assert out == {0: older, 1: older, 2: older}, out
    per_rank = {name: hashed.count(name) for name in sorted(set(hashed))}
    assert set(per_rank) == {"rank0"}, f"files hashed per rank: {per_rank} (only rank 0 may hash)"
    assert per_rank["rank0"] == len(checkpoint.read_meta(older)[checkpoint_io.FILES]) + 2, per_rank  # step 6 to its bad file
    verdicts = RunDir(tmp_path).resume_verdict("job-1").parent
    assert sorted(p.name for p in verdicts.iterdir()) == ["job-1.json", "job-1.read1", "job-1.read2"]
    checkpoint.release_verdicts(run_dir=tmp_path, attempt="job-1", world_size=3, timeout_s=5)
    assert not verdicts.exists(), "the verdicts are removed once every rank has read them"


def test_rank_zeros_refusal_reaches_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    older, latest = two_checkpoints(tmp_path)
    truncate(older / "shared.pt")
    flip_a_byte(latest / "shared.pt")
    out, hashed = job(tmp_path, 2, monkeypatch=monkeypatch)
    assert all(isinstance(e, ConfigError) for e in out.values()) and str(out[0]) == str(out[1]), out
    assert "every checkpoint of" in str(out[1]) and set(hashed) == {"rank0"}, (out, set(hashed))


def test_a_verdict_that_never_comes_names_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    two_checkpoints(tmp_path)
    out, hashed = job(tmp_path, 2, monkeypatch=monkeypatch, timeout_s=1, ranks=range(1, 2))
    assert isinstance(out[1], RuntimeError) and "train.checkpoint_timeout_s=1 s for rank 0's verdict" in str(out[1]), out
    assert hashed == []


@pytest.mark.dist
@pytest.mark.slow  # slow tier (CI time: ~20-35 s)
def test_torchrun_ranks_hash_the_checkpoint_once_per_job(tmp_path: Path) -> None:
    """Two torchrun ranks resume a finished run (no rank trains: item 1): one process hashes the checkpoint."""
    job_args = ["experiment=smoke", "parallelism=ddp", "cluster.world_size=2", "train.steps=6", "train.checkpoint_every=3",
                "logger.wandb.mode=disabled", "logger.progress=false"]
    run_dir = tmp_path / "run"
    run_train(run_dir, *job_args)
    before, log = digest(run_dir), tmp_path / "hashes.log"
    log.touch()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "sdp.driver.train", f"hydra.run.dir={run_dir}", *job_args, "train.resume=auto",
           "plugins=[tests.count_hashes]"]
    proc = subprocess.run(cmd, cwd=REPO, env={**sdp_env(), "SDP_TEST_HASH_LOG": str(log)}, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    lines = log.read_text().splitlines()
    per_rank = {r: sum(1 for x in lines if x.split()[0] == r) for r in sorted({x.split()[0] for x in lines})}
    files = len(checkpoint.read_meta(checkpoint.step_dir(run_dir, 6))[checkpoint_io.FILES])
    assert per_rank == {"0": files}, f"files hashed per rank: {per_rank}; the checkpoint has {files} (one job, one hash)"
    assert proc.returncode == 0, out[-4000:]
    assert "is finished" in out and digest(run_dir) == before, out[-3000:]
