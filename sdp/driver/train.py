"""``sdp-train`` / ``python -m sdp.driver.train``: the Hydra application.

Hydra composes and resolves the config once, here in the driver; the config is validated, written
as ``config.yaml`` into the run directory, and then the ranks are started below this process (or,
under an external launcher, this process is a rank). Multirun with Hydra's basic launcher therefore
runs each job's ranks in turn.

What runs is what Hydra composes from ``conf/config.yaml`` and the arguments, nothing else: ``sdp-train``
alone is one plain run of the default composition (``sdp-train --cfg job`` prints it), and the comparison (DDP
and SDP side by side, one table of ratios to DDP) is asked for by name, ``sdp-train experiment=compare``
(``conf/experiment/compare.yaml``); every further argument modifies what it names.
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
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from sdp.driver import finished, messages, sweep
from sdp.rank import checkpoint
from sdp.driver import checkpoint_resume
from sdp.results import contract as results
from sdp.driver import budget as budgets
from sdp.driver.config import check_resolved, renamed_overrides, validate
from sdp.driver.typed import register
from sdp.driver.launch import RankFailure, launch
from sdp.rank.rankenv import attempt_id, external_launcher
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
PROG = "sdp-train"


def run(cfg: DictConfig, *, run_dir: Path) -> Summary | None:
    """Validate, resolve the budget, record the config, launch the ranks, print and return rank 0's summary.

    The budget (``train.budget``) is resolved here, once, so ``config.yaml`` and every rank see the
    final ``train.steps`` and the schedule keys scaled with it; what was counted is added to ``summary.json`` as ``budget``. ``run_dir`` is
    where the job writes (the Hydra entry point passes its job's output directory): nothing here reads
    Hydra's global state, so a caller can run a composed config into any directory. A resume whose checkpoint
    is at ``train.steps`` starts no rank: the finished run is left as it is, or its missing summary rebuilt
    (:mod:`sdp.driver.finished`).
    """
    run_dir = Path(run_dir)
    slurm_environment(cluster=cfg.cluster)  # a Slurm task becomes a rank (RANK, WORLD_SIZE, ...) before validation
    built = validate(cfg)  # the driver's one meta build, the job's facts and the strategy's plan, handed on below
    budget = budgets.apply(cfg, preflight=built)  # train.steps and the step-denominated schedule keys (sdp/driver/budget.py)
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
    # verified once per job: under an external launcher rank 0 hashes the checkpoint, the other ranks take its verdict
    rank, wait_s = int(os.environ["RANK"]) if external_launcher() else None, float(checkpoint.io_timeout_s(cfg))
    ckpt = checkpoint_resume.resolve_once(resume=cfg.train.resume, run_dir=run_dir, rank=rank, attempt=attempt_id(),
                                          timeout_s=wait_s)
    if ckpt is not None:
        checkpoint_resume.check_resume(ckpt=ckpt, cfg=cfg)  # a changed schedule, optimizer or model is refused, naming the key
        if finished.is_finished(ckpt=ckpt, cfg=cfg):  # nothing to train: no rank starts, nothing is overwritten
            if rank == 0:  # no worker starts to remove the verdict: once the others have read it (before a rebuilt
                # summary.json exists, which a slower rank under train.skip_done would take for a job to skip)
                checkpoint.release_verdicts(run_dir=run_dir, attempt=attempt_id(), world_size=int(os.environ["WORLD_SIZE"]),
                                            timeout_s=wait_s)
            done = finished.finish(cfg=cfg, run_dir=run_dir, ckpt=ckpt, budget=budget, prepared=built.prepared, driver=driver)
            if done is not None:
                print(format_summary(done), flush=True)
            return done
    if ckpt is None and not cfg.train.get("skip_done"):  # skip_done's plan has cleared what it starts over
        sweep.refuse_used_dir(run_dir)  # every process: the ranks of an external launcher all stop alike
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
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)  # this job's output directory
    sweep_dir = Path(str(hc.sweep.dir)) if hc.mode == RunMode.MULTIRUN else None
    # a bad value: one line, exit 2; Ctrl-C: the command that resumes (sdp/driver/messages.py)
    with messages.config_errors(prog=PROG, sweep=sweep_dir is not None), \
            messages.interrupts(prog=PROG, run_dir=run_dir, sweep_dir=sweep_dir,
                                checkpoint_every=cfg.train.get("checkpoint_every")):
        summary = run(cfg, run_dir=run_dir)
    if summary is None:
        return None
    # A small JSON-safe return value (the Hydra callback on multirun end and tests use it).
    return json.loads(json.dumps({"run_dir": summary.run_dir, "final": summary.final.to_json()}))


def main() -> None:
    stale = renamed_overrides(sys.argv[1:])  # before Hydra, whose struct error would not name the new key
    if stale is not None:
        messages.refuse(prog=PROG, message=stale)
    _hydra_main()


if __name__ == "__main__":
    main()
