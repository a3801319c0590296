"""The run's final weights (``train.save_final``), kept for analyses that read them after the run (``sdp-bench
diagnose``: where the assembled SDP model loses against its workers).

Why not a checkpoint: a checkpoint is for resuming, so it holds the optimizer state (2x the weights under AdamW),
every rank's own copy of what it holds (n x C copies of each unit under SDP) and the RNG streams, and a run
directory holding one is left unslimmed (:mod:`sdp.bench.slim_runs`). The final weights are one model: each
tensor written once by the rank the strategy names (:meth:`sdp.parallel.base.Strategy.final_state`; SDP: a unit's
lowest holder), in the dtype the key names (``fp32`` exact; ``bf16`` / ``fp16`` half the bytes, the values rounded),
no rank gathering anything. Layout of ``<run_dir>/final/``:

- ``rank00003.pt`` (every rank): ``{"tensors": {full-model name: tensor}, "own": {...}}``, this rank's share and its
  own facts (SDP: the blocks it held and the branch scale each ran at);
- ``meta.json`` (rank 0): the step, world size, strategy, dtype and the strategy's ``facts`` (SDP: the plan and the
  factor evaluation puts on every unit).

Each file is written under a temporary name and renamed, and rank 0 writes ``summary.json`` only after every rank
has passed the summary's collectives, so a run with a complete ``summary.json`` has every file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdp.core.precision import TENSOR_DTYPES
from sdp.errors import ConfigError
from sdp.results.rundir import CHECKPOINT_META as META, RunDir, rank_file  # the index a checkpoint has too

DTYPES = TENSOR_DTYPES
SAVE_FINAL = ("none", *DTYPES)  # train.save_final's values (its schema field names this tuple)


def save(*, run_dir: Path, strategy: Any, dtype: str, step: int) -> Path | None:
    """Write this rank's share of the final weights into ``<run_dir>/final/`` (``dtype``: ``train.save_final``;
    ``none`` writes nothing). Every rank calls it after the last step; no collective."""
    if dtype == "none":
        return None
    assert dtype in DTYPES, f"train.save_final={dtype!r} not in {SAVE_FINAL}"
    state = strategy.final_state()
    if state is None:  # the driver refuses the key for such a strategy; a strategy built outside the driver lands here
        raise ConfigError(f"train.save_final={dtype!r} is invalid for parallelism.name={strategy.name!r}: the strategy "
                          "keeps no final weights (Strategy.final_state); allowed: none")
    rank, world = strategy.ctx.rank, strategy.ctx.world_size
    out = RunDir(run_dir).final
    out.mkdir(parents=True, exist_ok=True)
    cast = {k: (t.to("cpu", DTYPES[dtype]) if t.is_floating_point() else t.to("cpu")).clone()
            for k, t in state["tensors"].items()}
    _atomic_save({"tensors": cast, "own": state.get("own", {})}, out / rank_file(rank))
    if rank == 0:
        meta = {"step": step, "world_size": world, "strategy": strategy.name, "dtype": dtype, "facts": state.get("facts", {})}
        tmp = out / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, out / META)
    return out


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class FinalWeights:
    """A run's final weights read back: ``tensors`` (full-model name, or ``name#dim:start:length`` for a slice ->
    tensor, every rank's share merged), ``own`` (rank -> its own facts) and ``meta`` (``meta.json``)."""

    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    own: dict[int, dict[str, Any]]


def load(run_dir: Path) -> FinalWeights:
    """Every rank's file of ``<run_dir>/final/`` merged; a missing directory or file is named (ConfigError)."""
    root = RunDir(run_dir).final
    if not (root / META).is_file():
        raise ConfigError(f"RUN_DIR={str(run_dir)!r} is invalid: it holds no {root.name}/{META} (final weights are kept "
                          "only by a run with train.save_final=fp32|bf16|fp16); allowed: such a run directory")
    meta = json.loads((root / META).read_text())
    tensors: dict[str, torch.Tensor] = {}
    own: dict[int, dict[str, Any]] = {}
    for r in range(int(meta["world_size"])):
        path = root / rank_file(r)
        if not path.is_file():
            raise ConfigError(f"RUN_DIR={str(run_dir)!r} is invalid: {path} is missing ({meta['world_size']} ranks wrote "
                              "final weights); allowed: a run directory whose run finished")
        part = torch.load(path, map_location="cpu", weights_only=True)
        twice = set(part["tensors"]) & set(tensors)
        assert not twice, f"{path}: tensors written by two ranks: {sorted(twice)[:5]}"
        tensors.update(part["tensors"])
        own[r] = part["own"]
    return FinalWeights(meta=meta, tensors=tensors, own=own)
