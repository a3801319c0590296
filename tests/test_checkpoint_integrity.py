"""A checkpoint is written without timing out the ranks that wait for it, and a damaged one is found
before any rank loads it.

- Issue 26, item 8: with the latest checkpoint's files truncated, ``train.resume=auto`` stopped in the
  driver with a bare ``JSONDecodeError`` naming no file (or a zip error in every rank). Now meta.json
  records every file's size and SHA-256; ``auto`` skips a damaged latest checkpoint with a warning
  naming it and resumes from the previous whole one, an explicit damaged path is refused naming the
  file, and nothing is deleted (a damaged later checkpoint is moved aside, not overwritten).
- Issue 29, item 3: rank 0 alone writes the shared state while the others waited in a barrier on the
  training process group; a write longer than ``cluster.timeout_s`` timed them out. The waits of a save
  are now on a gloo group with ``train.checkpoint_timeout_s``.
"""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sdp.rank import checkpoint, checkpoint_io
from sdp.driver import checkpoint_resume
from sdp.driver.checkpoint_resume import CheckpointWarning
from sdp.errors import ConfigError
from sdp.core.distctx import DistContext
from sdp.results.rundir import checkpoint_meta
from tests.helpers import compose, run_job, spawn
from tests.test_checkpoint import KEY, Plain, Sharded, make

pytestmark = pytest.mark.timeout(300)


def two_checkpoints(run_dir: Path) -> tuple[Path, Path]:
    a, sa = make(Plain, seed=0)
    for k in (3, 6):
        checkpoint.save(run_dir=run_dir, step=k, strategy=a, scheduler=sa, train_state={"step": k}, data_key=KEY, keep=0)
    return checkpoint.step_dir(run_dir, 3), checkpoint.step_dir(run_dir, 6)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the hash can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("cls", [Plain, Sharded])
def test_meta_records_every_file(cls: type, tmp_path: Path) -> None:
    a, sa = make(cls, seed=0)
    ckpt = checkpoint.save(run_dir=tmp_path, step=1, strategy=a, scheduler=sa, train_state={}, data_key=KEY, keep=0)
    files = checkpoint.read_meta(ckpt)[checkpoint_io.FILES]
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != "meta.json")
    assert sorted(files) == on_disk, f"meta.json lists {sorted(files)}, the checkpoint holds {on_disk}"
    assert all(files[rel] == checkpoint_io.file_entry(ckpt / rel) for rel in files), "hashed while written = hashed on disk"
    assert checkpoint_io.damage(ckpt) is None


@pytest.mark.parametrize(("damaged", "harm", "said"), [
    ("rank00000.pt", truncate, "holds .* bytes, .* recorded"),
    ("meta.json", truncate, r"cannot be read \(JSONDecodeError"),
    ("shared.pt", flip_a_byte, "has SHA-256 .* recorded"),
], ids=["rank-file-truncated", "meta-truncated", "shared-bit-flip"])
def test_auto_resumes_from_the_previous_whole_checkpoint(tmp_path: Path, damaged: str, harm, said: str) -> None:
    older, latest = two_checkpoints(tmp_path)
    harm(latest / damaged)
    kept = (latest / damaged).read_bytes()
    o, lt, f = (re.escape(str(p)) for p in (older, latest, latest / damaged))
    with pytest.warns(CheckpointWarning, match=rf"resuming from {o}.*damaged.*{f} {said}"):
        assert checkpoint_resume.resolve(resume="auto", run_dir=tmp_path) == older
    # An explicit path whose (latest) checkpoint is damaged is refused, naming the file.
    for explicit in (latest, tmp_path):
        with pytest.raises(ConfigError, match=rf"checkpoint {lt} is damaged: {f} {said}.*{o}"):
            checkpoint_resume.resolve(resume=str(explicit), run_dir=None)
    # Resuming in place: the damaged later checkpoint is moved aside, not deleted.
    with pytest.warns(CheckpointWarning, match=rf"{lt} .* moved aside to {lt}\.damaged"):
        assert checkpoint_resume.prepare_run_dir(ckpt=older, run_dir=tmp_path) == 3
    assert (latest.parent / f"{latest.name}.damaged" / damaged).read_bytes() == kept
    assert [k for k, _ in checkpoint.checkpoints(tmp_path)] == [3]


def test_auto_with_every_checkpoint_damaged_is_refused(tmp_path: Path) -> None:
    older, latest = two_checkpoints(tmp_path)
    truncate(older / "shared.pt")
    truncate(checkpoint_meta(latest))
    o, lt = re.escape(str(older)), re.escape(str(latest))
    with pytest.raises(ConfigError, match=rf"every checkpoint of .* is damaged: {lt} .*; {o} .*shared\.pt"):
        checkpoint_resume.resolve(resume="auto", run_dir=tmp_path)
    assert older.exists() and latest.exists()


def test_checkpoint_without_checksums_is_accepted_with_a_note(tmp_path: Path) -> None:
    """Written before checksums were recorded: its files are checked for presence only, and it says so."""
    _, latest = two_checkpoints(tmp_path)
    meta = checkpoint.read_meta(latest)
    del meta[checkpoint_io.FILES]
    checkpoint_meta(latest).write_text(json.dumps(meta))
    with pytest.warns(CheckpointWarning, match=rf"{re.escape(str(latest))} was written before checkpoints recorded checksums"):
        assert checkpoint_resume.resolve(resume="auto", run_dir=tmp_path) == latest
    (latest / "rank00000.pt").unlink()
    with pytest.raises(ConfigError, match=rf"{re.escape(str(latest / 'rank00000.pt'))} is missing"):
        checkpoint_resume.resolve(resume=str(latest), run_dir=None)


def test_checkpoint_timeout_is_validated() -> None:
    from sdp.driver.typed import parse  # the schema's range (sdp/driver/schema.py), checked in the driver's parse

    with pytest.raises(ConfigError, match=r"train.checkpoint_timeout_s=0 is invalid: must be a number > 0"):
        parse(compose(["train.checkpoint_timeout_s=0"]))


# ---- multi-rank ----------------------------------------------------------------------------------
TRAINING_TIMEOUT_S = 1.5  # the training collectives' limit (cluster.timeout_s) inside the slow-write ranks
SLOW_WRITE_S = 3 * TRAINING_TIMEOUT_S


def _save_with_slow_rank0(rank: int, world: int, run_dir: str, checkpoint_timeout_s: float) -> dict:
    """One checkpoint on ``world`` gloo ranks whose rank 0 writes slower than the training timeout."""
    dist.barrier()  # every rank is up: from here on the training collectives' limit is the short one
    dist.set_timeout(timedelta(seconds=TRAINING_TIMEOUT_S))
    if rank == 0:
        real, slow = torch.save, [True]

        def slow_save(*args, **kwargs):  # the first write (shared.pt) takes longer than TRAINING_TIMEOUT_S
            if slow:
                slow.clear()
                time.sleep(SLOW_WRITE_S)
            return real(*args, **kwargs)

        torch.save = slow_save
    torch.manual_seed(0)
    strategy, sched = make(Plain, seed=0)
    strategy.ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    ckpt = checkpoint.save(run_dir=Path(run_dir), step=1, strategy=strategy, scheduler=sched, train_state={},
                           data_key=KEY, keep=0, timeout_s=checkpoint_timeout_s)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the training collectives go on after the checkpoint
    return {"sum": float(ones), "damage": checkpoint_io.damage(ckpt) if rank == 0 else None,
            "files": sorted(checkpoint.read_meta(ckpt)[checkpoint_io.FILES]) if rank == 0 else None}


@pytest.mark.dist
@pytest.mark.slow  # ~11 s: slow tier (CI time)
def test_slow_rank0_write_does_not_time_out_the_others(tmp_path: Path) -> None:
    out = spawn(_save_with_slow_rank0, world=2, args=(str(tmp_path), 60.0))
    assert [o["sum"] for o in out] == [2.0, 2.0]
    assert out[0]["files"] == ["rank00000.pt", "rank00001.pt", "shared.pt"], "every rank's hash reached meta.json"
    assert out[0]["damage"] is None


@pytest.mark.dist
def test_a_write_slower_than_the_checkpoint_limit_names_it(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=rf"(?s)rank 1 failed.*StepFailure: step 1 failed on rank 1 \(the checkpoint did "
                                             rf"not complete within train.checkpoint_timeout_s={TRAINING_TIMEOUT_S:g}"):
        spawn(_save_with_slow_rank0, world=2, args=(str(tmp_path), TRAINING_TIMEOUT_S))


@pytest.mark.dist
def test_driver_resumes_from_the_older_checkpoint(tmp_path: Path) -> None:
    """The issue's case end to end: truncate a rank file, then the metadata, of the latest of two
    checkpoints; each time ``train.resume=auto train.extend_steps=true`` resumes from the older one."""
    base = ["experiment=smoke", "parallelism=ddp", "train.eval_every=0", "train.checkpoint_every=3"]
    run = tmp_path / "run"
    run_job([*base, "train.steps=6"], run_dir=run, world=2)
    for steps, (older, latest), damaged in ((9, (3, 6), "rank00001.pt"), (12, (6, 9), "meta.json")):
        bad = checkpoint.step_dir(run, latest) / damaged
        truncate(bad)
        said = rf"resuming from {re.escape(str(checkpoint.step_dir(run, older)))}.*{re.escape(str(bad))}"
        with pytest.warns(CheckpointWarning, match=said):
            _, rows = run_job([*base, f"train.steps={steps}", "train.resume=auto", "train.extend_steps=true"],
                              run_dir=run, world=2)
        assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1)), "each step once"
        assert (bad.parent.parent / f"{bad.parent.name}.damaged" / damaged).exists(), "kept, moved aside"
