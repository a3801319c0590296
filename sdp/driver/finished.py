"""A job whose work is done: decided in the driver, before any rank starts, from the checkpoint a resume names.

Why: ``train.resume=auto`` (what a requeued Slurm job runs) or ``train.skip_done`` on a run whose latest checkpoint is
at ``train.steps`` has nothing left to train. Started anyway, its ranks would train zero steps and rank 0 would
overwrite the run's ``summary.json`` with what an empty process measured (no step time, no training peak, the
re-draws of no step). Here instead (:func:`finish`):

- the run directory holds a complete ``summary.json``: nothing is written (``config.yaml``, ``metrics.jsonl`` and
  the summary stay byte-identical), the job says so and returns that summary;
- it holds none (a job stopped between its final checkpoint and its summary): the summary is rebuilt from what the
  run recorded, the checkpoint's counters (steps, final losses and evaluation, skipped steps) and rank 0's
  ``strategy_info`` as it wrote them, the config (strategy, plan facts, evaluation protocol) and the driver's budget; ``Summary.rebuilt`` says what only the live ranks had
  measured and is therefore absent (per-rank memory, communication, time). ``metrics.jsonl`` keeps every logged
  step as the run wrote it.

A finished checkpoint of another run directory (``train.resume=<path>``) is refused: there is nothing to train.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from sdp.driver.sweep import complete_summary
from sdp.errors import ConfigError
from sdp.rank.checkpoint import STRATEGY_INFO, TRAIN, read_meta
from sdp.rank.worker import run_facts
from sdp.results.rundir import SHARED_FILE, RunDir, run_of_checkpoint
from sdp.results.summary import Summary

REBUILT = ("rebuilt by the driver from the final checkpoint ({ckpt}) and config.yaml: the run ended after its "
           "checkpoint at train.steps={steps} without writing summary.json; per-rank memory, communication and time "
           "were measured by its ranks and are absent (metrics.jsonl holds every logged step)")


def is_finished(*, ckpt: Path, cfg: DictConfig) -> bool:
    """Whether ``ckpt`` is at the resolved ``train.steps`` (the last step always writes one:
    :class:`sdp.rank.schedule.Cadence`)."""
    return int(read_meta(ckpt)["step"]) >= int(cfg.train.steps)


def finish(*, cfg: DictConfig, run_dir: Path, ckpt: Path, budget: dict[str, Any] | None, prepared: Any,
           driver: bool) -> Summary | None:
    """The finished job's summary (None in a process that is not the job's driver, e.g. rank 1 of torchrun): left
    as it is when complete, else rebuilt and written by the driver; one line says which."""
    steps = int(cfg.train.steps)
    if run_of_checkpoint(ckpt).root.resolve() != Path(run_dir).resolve():
        raise ConfigError(f"train.resume={str(cfg.train.resume)!r} is invalid: {ckpt} is at step "
                          f"{read_meta(ckpt)['step']}, train.steps={steps}: nothing is left to train; allowed: "
                          "train.extend_steps=true with a larger train.steps, or train.resume=auto in that run's directory")
    summary = complete_summary(run_dir)
    if summary is not None:
        if driver:
            print(f"{run_dir} is finished (checkpoint {ckpt.name} at train.steps={steps}, summary.json complete): "
                  "nothing to run, the run directory is left as it is", flush=True)
        return summary if driver else None
    if not driver:
        return None
    summary = rebuilt(cfg=cfg, run_dir=run_dir, ckpt=ckpt, budget=budget, prepared=prepared)
    summary.write(RunDir(run_dir))
    print(f"{run_dir} is finished (checkpoint {ckpt.name} at train.steps={steps}) but had no complete summary.json: "
          f"rebuilt it from the checkpoint and config.yaml, without the measurements only the ranks had", flush=True)
    return summary


def train_state(ckpt: Path, *, meta: dict[str, Any]) -> dict[str, Any]:
    """The trainer's counters a checkpoint holds: from its ``meta.json`` (``meta``, read by the caller), or (written
    before they were put there) ``shared.pt``, memory-mapped so its tensors are not read."""
    if TRAIN in meta:
        return meta[TRAIN]
    return torch.load(ckpt / SHARED_FILE, map_location="cpu", weights_only=True, mmap=True)[TRAIN]


def rebuilt(*, cfg: DictConfig, run_dir: Path, ckpt: Path, budget: dict[str, Any] | None, prepared: Any) -> Summary:
    """The summary of the finished run in ``run_dir`` rebuilt from ``ckpt`` (its final checkpoint), the config, the
    driver's ``budget`` and the strategy's ``prepared`` plan (the fields rank 0 fills from them: :func:`run_facts`)."""
    meta = read_meta(ckpt)
    facts = run_facts(cfg=cfg, world_size=int(meta["world_size"]), prepared=prepared, precision=str(cfg.train.precision),
                      state=train_state(ckpt, meta=meta))
    return Summary(**facts, time={"warmup_steps": int(cfg.train.warmup_steps)}, run_dir=str(run_dir), budget=budget,
                   strategy_info=meta.get(STRATEGY_INFO, {}),  # rank 0's at the checkpoint ({}: written before it was kept)
                   rebuilt=REBUILT.format(ckpt=os.path.relpath(ckpt, run_dir), steps=int(cfg.train.steps)))
