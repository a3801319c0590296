"""Minimal checkpoint/resume, so a requeued Slurm job continues where it stopped (placeholder for
the reliability work's checkpointing: the lead reconciles the two; the contract the Slurm tests rely
on is ``train.checkpoint_every`` + ``train.resume=auto`` = "continue from the run directory's latest
complete checkpoint").

Every rank saves what it holds (model, optimizer, LR schedule, loop state, RNG) to
``<run_dir>/checkpoints/step_<N>/rank<R>.pt``; after a barrier rank 0 points ``latest.json`` at it
and deletes older ones, so a job killed mid-save resumes from the previous complete checkpoint. Batches are a pure function of
(seed, step), so a resumed run ends bitwise where an uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from sdp.trainer import Trainer


class Checkpointer:
    """Saves every ``every`` steps and restores the latest checkpoint of ``run_dir`` (``resume=auto``)."""

    def __init__(self, *, run_dir: Path, every: int, resume: str, rank: int) -> None:
        self.root = run_dir / "checkpoints"
        self.every, self.resume, self.rank = every, resume, rank
        self.resumed_from: int | None = None

    def _blob(self, trainer: Trainer) -> dict[str, Any]:
        return {
            "model": trainer.strategy.unwrapped().state_dict(),
            "optimizer": trainer.strategy.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "state": asdict(trainer.state),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if trainer.ctx.device.type == "cuda" else None,
        }

    def step_end(self, trainer: Trainer) -> None:
        """Called by the trainer after every step; saves on multiples of ``every``."""
        step = trainer.state.step
        if self.every <= 0 or step % self.every != 0:
            return
        folder = self.root / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"rank{self.rank}.pt.tmp"
        torch.save(self._blob(trainer), tmp)
        os.replace(tmp, folder / f"rank{self.rank}.pt")
        if dist.is_initialized():
            dist.barrier()  # every rank's file is complete before ``latest`` moves
        if self.rank == 0:
            latest = self.root / "latest.json"
            latest.with_suffix(".tmp").write_text(json.dumps({"step": step}))
            os.replace(latest.with_suffix(".tmp"), latest)
            for old in self.root.glob("step_*"):  # only the latest complete checkpoint is kept
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)

    def restore(self, trainer: Trainer, *, metrics: Path) -> None:
        """``resume=auto``: load the latest complete checkpoint if there is one (else start fresh)."""
        latest = self.root / "latest.json"
        if self.resume != "auto" or not latest.exists():
            return
        step = int(json.loads(latest.read_text())["step"])
        blob = torch.load(self.root / f"step_{step}" / f"rank{self.rank}.pt", map_location=trainer.ctx.device,
                          weights_only=False)
        trainer.strategy.unwrapped().load_state_dict(blob["model"])
        trainer.strategy.optimizer.load_state_dict(blob["optimizer"])
        trainer.scheduler.load_state_dict(blob["scheduler"])
        for k, v in blob["state"].items():
            setattr(trainer.state, k, v)
        torch.set_rng_state(blob["rng"])
        if blob["cuda_rng"] is not None:
            torch.cuda.set_rng_state(blob["cuda_rng"])
        if self.rank == 0 and metrics.exists():  # rows logged after the checkpoint are logged again
            rows = [r for r in metrics.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
            metrics.write_text("".join(r + "\n" for r in rows))
        self.resumed_from = step
