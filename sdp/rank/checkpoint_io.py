"""How a checkpoint's files are written and waited for, and how a damaged one is found.

Checksums. A checkpoint cut short (a full disk, a killed copy, a failing filesystem) used to be found
by the first ``json.loads`` or ``torch.load`` that tripped over it: in the driver, a bare
``JSONDecodeError`` naming no file; in every rank, a zip error. Now ``meta.json`` lists every file of
the checkpoint with its size and SHA-256 (:func:`record`), and the driver checks a checkpoint before
any rank loads it (:func:`damage`): the sizes first (a truncation is found without reading a byte),
then the hashes, streamed in :data:`CHUNK` pieces (memory stays flat at any checkpoint size; the cost
is one read of the checkpoint). Each rank hashes its own files as ``torch.save`` streams them out
(:func:`save_hashed`), so writing costs no second read; only files another library wrote
(``torch.distributed.checkpoint``'s ``sharded/``) are read back once, by rank 0. Checkpoints written
before checksums were recorded have no ``files`` entry: their files are checked for presence only,
and :func:`checksummed` lets the caller say so.

Waiting. Rank 0 alone writes the shared state while the other ranks wait for it; at LLaMA-1B with
AdamW that is the weights and both moments, which a slow filesystem may take longer than
``cluster.timeout_s`` to write. So every wait of a save is on :func:`io_group`, a gloo group with its
own timeout (``train.checkpoint_timeout_s``), and a wait that times out names that key
(:func:`naming_timeout`).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from sdp.rank.guards import StepFailure

from sdp.results.rundir import SHARED_FILE, checkpoint_meta, rank_file

CHUNK = 1 << 20  # bytes read per hash update
FILES = "files"  # meta.json: {path relative to the checkpoint: {"bytes": size, "sha256": hex digest}}
META_KEYS = ("step", "world_size", "strategy", "data_key")  # what every meta.json holds (sdp.rank.checkpoint.save)


class _Hashing:
    """A write-only file that hashes what passes through it (``torch.save`` to a buffer needs only
    ``write`` and ``flush``; it passes memoryviews of the tensors' bytes, so nothing is copied)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_hashed(*, obj: Any, path: Path) -> dict[str, Any]:
    """``torch.save(obj, path)``, hashing the bytes on their way out; returns the file's entry."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        torch.save(obj, out)
    return {"bytes": path.stat().st_size, "sha256": out.sha.hexdigest()}


def file_entry(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a file on disk, read in :data:`CHUNK` pieces."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def record(*, root: Path, known: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The ``files`` entry of ``root``'s meta.json: every file under it but meta.json itself, each with
    the entry in ``known`` (hashed while written) or, for a file no rank hashed, one read now."""
    meta = checkpoint_meta(root)
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p != meta):
        rel = path.relative_to(root).as_posix()
        out[rel] = known[rel] if rel in known else file_entry(path)
    return out


def checksummed(meta: dict[str, Any]) -> bool:
    """Whether a (readable) meta.json records its files' checksums."""
    return isinstance(meta.get(FILES), dict)


def damage(ckpt: Path) -> str | None:
    """What is wrong with checkpoint directory ``ckpt``, naming the file; None when it is whole.

    In order: meta.json readable with its keys; every listed file present at its recorded size; every
    hash equal to the recorded one. A checkpoint without checksums: meta.json and the files every
    checkpoint holds (``shared.pt``, one ``rank<r>.pt`` per rank) present."""
    meta_path = checkpoint_meta(ckpt)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{meta_path} cannot be read ({type(exc).__name__}: {exc})"
    lacking = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
    if lacking:
        return f"{meta_path} lacks {', '.join(lacking)} (holds {sorted(meta) if isinstance(meta, dict) else type(meta).__name__})"
    if not checksummed(meta):
        for name in [SHARED_FILE, *(rank_file(r) for r in range(int(meta["world_size"])))]:
            if not (ckpt / name).is_file():
                return f"{ckpt / name} is missing"
        return None
    files: dict[str, dict[str, Any]] = meta[FILES]
    for rel, entry in files.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{path} is missing ({meta_path} lists it)"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path} holds {size} bytes, {meta_path} recorded {entry['bytes']} (cut short or overwritten)"
    for rel, entry in files.items():
        got = file_entry(ckpt / rel)["sha256"]
        if got != entry["sha256"]:
            return (f"{ckpt / rel} has SHA-256 {got}, {meta_path} recorded {entry['sha256']} "
                    "(its bytes changed after it was written)")
    return None


_IO_GROUP: tuple[Any, float, Any] | None = None  # (the default group it belongs to, its timeout, the group)


def io_group(*, timeout_s: float) -> Any:
    """The gloo group every wait of a save is on, with its own timeout (gloo: a CPU barrier, whatever
    the training backend). Created at the first save of a process group, by every rank at the same step
    (``new_group`` is collective), and kept for the later ones."""
    global _IO_GROUP
    world = dist.group.WORLD
    if _IO_GROUP is None or _IO_GROUP[0] is not world or _IO_GROUP[1] != timeout_s:
        _IO_GROUP = (world, timeout_s, dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    return _IO_GROUP[2]


class Waits:
    """Every wait of one save: on :func:`io_group` when ``timeout_s`` (``train.checkpoint_timeout_s``) is
    given, else on the default group (its ``cluster.timeout_s``); one that times out names the key
    (:func:`sdp.rank.guards.naming_step` would name ``cluster.timeout_s``). Only the waits are wrapped: a
    training collective a strategy runs while saving keeps its own limit and message."""

    def __init__(self, *, world_size: int, rank: int, step: int, timeout_s: float | None) -> None:
        self.world_size, self.rank, self.step, self.timeout_s = world_size, rank, step, timeout_s
        self.group = io_group(timeout_s=timeout_s) if world_size > 1 and timeout_s is not None else None

    @contextmanager
    def naming(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:
            text = str(exc).lower()
            if self.timeout_s is None or isinstance(exc, StepFailure) or ("timed out" not in text and "timeout" not in text):
                raise
            raise StepFailure(f"step {self.step} failed on rank {self.rank} (the checkpoint did not complete within "
                              f"train.checkpoint_timeout_s={self.timeout_s:g}: a rank writes slower than that, or is "
                              f"hung or dead): {type(exc).__name__}: {exc}") from exc

    def barrier(self) -> None:
        if self.world_size > 1:
            with self.naming():
                dist.barrier(group=self.group)

    def gather(self, *, mine: dict[str, Any]) -> dict[str, Any]:
        """Every rank's entries merged on rank 0 (empty elsewhere); a collective, so also a barrier."""
        if self.world_size == 1:
            return mine
        parts: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        with self.naming():
            dist.gather_object(mine, parts, dst=0, group=self.group)
        return {k: v for part in parts or [] for k, v in part.items()}
