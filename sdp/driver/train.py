"""``sdp-train`` / ``python -m sdp.driver.train``: the Hydra application.

Hydra composes and resolves the config once, here in the driver; the config is validated, written
as ``config.yaml`` into the run directory, and then the ranks are started below this process (or,
under an external launcher, this process is a rank). Multirun with Hydra's basic launcher therefore
runs each job's ranks in turn.

``sdp-train`` with no arguments at all runs :data:`DEFAULT_JOB`, the comparison of
``conf/experiment/compare.yaml`` (DDP and SDP side by side, one table of ratios to DDP); any argument
(``sdp-train parallelism=sdp``) composes ``conf/config.yaml`` as given: one plain run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sdp.driver import sweep
from sdp.rank import checkpoint_resume
from sdp.results import contract as results
from sdp.planning import budget as budgets
from sdp.driver.config import check_resolved, renamed_overrides, validate
from sdp.driver.typed import register
from sdp.driver.launch import RankFailure, launch
from sdp.driver.rankenv import external_launcher
from sdp.results.loggers import wandb_mode, wandb_run_id
from sdp.results.rundir import RunDir
from sdp.driver.slurm import slurm_environment
from sdp.results.summary import Summary, format_summary

# A per-process unique token for run directories: two jobs started in the same second never share
# a directory (cached, so every interpolation in one process sees the same value).
if not OmegaConf.has_resolver("sdp_uid"):
    OmegaConf.register_new_resolver("sdp_uid", lambda: f"{os.getpid()}-{uuid.uuid4().hex[:6]}", use_cache=True)
# Products of config values, e.g. cluster.world_size = ${sdp_mul:${cluster.nodes},${cluster.tasks_per_node}}.
if not OmegaConf.has_resolver("sdp_mul"):
    OmegaConf.register_new_resolver("sdp_mul", lambda *xs: math.prod(int(x) for x in xs))

register()  # the typed schemas conf/*.yaml extend (sdp/driver/schema.py), stored before anything composes conf/

CONF_DIR = str(Path(__file__).resolve().parent.parent.parent / "conf")
DEFAULT_JOB = ["experiment=compare"]  # what `sdp-train` alone runs (the first Quick start command of the README)


def run(cfg: DictConfig, *, run_dir: Path) -> Summary | None:
    """Validate, resolve the budget, record the config, launch the ranks, print and return rank 0's summary.

    The budget (``train.budget``) is resolved here, once, so ``config.yaml`` and every rank see the
    final ``train.steps`` and the schedule keys scaled with it; what was counted is added to ``summary.json`` as ``budget``. ``run_dir`` is
    where the job writes (the Hydra entry point passes its job's output directory): nothing here reads
    Hydra's global state, so a caller can run a composed config into any directory.
    """
    run_dir = Path(run_dir)
    slurm_environment(cluster=cfg.cluster)  # a Slurm task becomes a rank (RANK, WORLD_SIZE, ...) before validation
    built = validate(cfg)  # the driver's one meta build, the job's facts and the strategy's plan, handed on below
    budget = budgets.apply(cfg, preflight=built)  # train.steps and the step-denominated schedule keys (sdp/planning/budget.py)
    check_resolved(cfg)  # checks against train.steps come after the budget has set it
    driver = not external_launcher() or os.environ.get("RANK") == "0"
    if cfg.train.get("skip_done"):
        plan, done = sweep.job_plan(cfg=cfg, run_dir=run_dir)  # refuses a directory holding another config
        if plan == "skip":
            if driver:
                print(f"skip_done: {run_dir} is complete (summary.json, same config): skipped", flush=True)
            return done if driver else None
        if cfg.train.resume is None:
            cfg.train.resume = "auto"  # a job with a checkpoint continues from it
        if plan == "start" and driver and (removed := sweep.clear_leftovers(run_dir)):
            print(f"skip_done: {run_dir} has no checkpoint: starting afresh (cleared {', '.join(removed)})", flush=True)
    ckpt = checkpoint_resume.resolve(resume=cfg.train.resume, run_dir=run_dir)
    if ckpt is not None:
        checkpoint_resume.check_resume(ckpt=ckpt, cfg=cfg)  # a changed schedule, optimizer or model is refused, naming the key
    cfg.train.resume = str(ckpt) if ckpt is not None else None  # ranks load exactly this directory
    if ckpt is not None and driver:
        step = checkpoint_resume.prepare_run_dir(ckpt=ckpt, run_dir=run_dir)
        print(f"resuming from {ckpt} (step {step}); metrics.jsonl holds steps <= {step}", flush=True)
    if driver:
        results.write_config(cfg=cfg, run_dir=run_dir)
        if wandb_mode(cfg.logger.wandb.get("mode")) != "disabled":
            wandb_run_id(run_dir=run_dir, ckpt=ckpt)  # one W&B run per job, across resumes and requeues
    started = time.time()
    try:
        # what the strategy built once from the driver's meta model (SDP's plan): every rank runs exactly it
        summary = launch(cfg=cfg, run_dir=run_dir, budget=budget, prepared=built.prepared)
    except RankFailure as exc:
        # The job-level verdict, next to whatever metrics.jsonl already holds.
        results.write_json(RunDir(run_dir).failure, {"rank": exc.rank, "exitcode": exc.exitcode,
                                                      "seconds_after_start": time.time() - started, "message": str(exc)})
        raise
    if summary is not None:
        print(format_summary(summary), flush=True)
    return summary


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> Any:
    summary = run(cfg, run_dir=Path(HydraConfig.get().runtime.output_dir))  # this job's output directory
    if summary is None:
        return None
    # A small JSON-safe return value (the Hydra callback on multirun end and tests use it).
    return json.loads(json.dumps({"run_dir": summary.run_dir, "final": summary.final.to_json()}))


def main() -> None:
    stale = renamed_overrides(sys.argv[1:])  # before Hydra, whose struct error would not name the new key
    if stale is not None:
        sys.exit(f"sdp-train: {stale}")
    if len(sys.argv) == 1:
        sys.argv += DEFAULT_JOB
        print(f"sdp-train with no arguments runs `sdp-train {' '.join(DEFAULT_JOB)}`: DDP and SDP side by side, one "
              "table of ratios to DDP at the end (conf/experiment/compare.yaml). One plain run: sdp-train parallelism=sdp",
              flush=True)
    _hydra_main()


if __name__ == "__main__":
    main()
