"""``sdp-plan``'s checkpoint writes: the bytes each rank writes per checkpoint and over the run's cadence.

Why: a checkpoint is the one phase whose bytes go to the filesystem rather than over the links, and at paper scale
its cadence (``train.checkpoint_every``) sets how much a run writes and how long rank 0 writes alone (the shared
state of a strategy whose replicas are identical is written once, by rank 0). What a rank writes is what
:func:`sdp.rank.checkpoint.save` hands ``torch.save``: rank 0 the ``shared.pt`` part, every rank its own file with
the ``local`` part and its RNG streams (:func:`sdp.rank.rng.capture`). The strategy says which tensors go where
(:meth:`sdp.parallel.spec.StrategySpec.checkpoint_tensors`, from the same meta model, plan and optimizer its
runtime builds); this module counts them as ``torch.save`` writes them: every storage once and whole.

The rule, and what ``tests/test_traffic_plan.py`` holds to the files 4-rank runs write, byte for byte: the
*tensor payload*, the storages' bytes (a ``torch.save`` zip's ``data/`` records). A file adds its framing: the
pickled structure (keys, the optimizer's hyper-parameters, the trainer's counters and this rank's measurement
record, which grows with the run), zip headers and the 64-byte alignment of each storage; it is not predicted.
``sharded/`` (``torch.distributed.checkpoint``: FSDP2) is not predicted either: a strategy without
``checkpoint_tensors`` is named in the plan's notes.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from sdp.models.base import SDPModel
from sdp.parallel.job import JobFacts
from sdp.parallel.plan_entries import storage_bytes, tensors_of
from sdp.parallel.spec import StrategySpec
from sdp.rank import rng
from sdp.rank.schedule import Cadence
from sdp.results.rundir import SHARED_FILE, rank_file

RULE = ("tensor payload: the storages torch.save writes (each once, whole); a file's framing (pickled keys, "
        "hyper-parameters, counters, the rank's measurement record; zip headers, alignment) is not counted")


def rng_bytes(*, device: str) -> int:
    """The RNG streams every rank file holds (:func:`sdp.rank.rng.capture`, captured here on the CPU; a CUDA rank's
    adds its generator's state, counted where this machine has CUDA)."""
    here = torch.device(device) if device.startswith("cuda") and torch.cuda.is_available() else torch.device("cpu")
    return storage_bytes(tensors_of(rng.capture(device=here)))


def predict_checkpoints(*, cfg: DictConfig, job: JobFacts, spec: type[StrategySpec], model: SDPModel, prepared: Any,
                        cadence: Cadence) -> tuple[dict[str, Any] | None, list[str]]:
    """The plan's ``checkpoint`` entry (None without checkpoints): the steps the run checkpoints after
    (:meth:`~sdp.rank.schedule.Cadence.checkpoints`) and per rank each checkpoint's files (name -> tensor payload
    bytes) and ``bytes``, the run's total; and the notes on what is not predicted."""
    steps = [n for n in range(1, cadence.steps + 1) if cadence.checkpoints(n)]
    if not steps:
        return None, []
    world, streams = job.world_size, rng_bytes(device=job.device)
    per_rank: list[dict[str, Any]] = [{"rank": r, "writes": [], "bytes": 0} for r in range(world)]
    for step in steps:
        parts = spec.checkpoint_tensors(cfg=cfg.parallelism, job=job, model=model, step=step, prepared=prepared)
        if parts is None:
            return None, [f"checkpoint: not predicted (parallelism.name={spec.name!r} has no checkpoint_tensors)"]
        assert len(parts) == world, f"checkpoint_tensors gave {len(parts)} ranks for a world of {world}"
        for r, (mine, entry) in enumerate(zip(parts, per_rank)):
            files = {rank_file(r): storage_bytes(mine.get("local", [])) + streams}
            if r == 0:
                files[SHARED_FILE] = storage_bytes(parts[0].get("shared", []))
            entry["writes"].append({"step": step, "files": files})
            entry["bytes"] += sum(files.values())
    return {"steps": steps, "keep": int(cfg.train.checkpoint_keep), "rule": RULE, "per_rank": per_rank}, []
