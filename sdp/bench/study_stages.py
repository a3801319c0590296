"""Running a study's stages one after another (:mod:`sdp.bench.cpu_study` says what they are), each followed by the
diagnosis of the runs that kept their weights, and what is left of them without running anything
(``sdp-bench cpu-study --study S --status``).

A study of some hundred runs on two CPU cores spans days and sessions, and is resumed stage by stage
(``train.skip_done``). Before spending the time a user needs to know, per stage, how many of its sweep's jobs
finished (a ``summary.json``), which started and did not finish (a run directory without one: running, or stopped,
and then going on from its last checkpoint, or from step 0 where it has none, as the CPU studies' runs) and how
many never started. The job count is the sweep's own: the
product of its comma-separated overrides, as Hydra's basic sweeper expands them (jobs ``0 .. N-1`` under
``hydra.sweep.dir``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from sdp.bench.runs import sdp_train
from sdp.rank.checkpoint import checkpoints
from sdp.results.rundir import RunDir

SWEEP_DIR = "hydra.sweep.dir="


def selected(name: str, only: list[str] | None) -> bool:
    """Whether ``--only`` takes the stage ``name``: no filter, its kind (``main`` for ``main-1``) or its full name."""
    return not only or name.split("-")[0] in only or name in only


def check_only(*, stages: list[tuple[str, list[str]]], only: list[str] | None) -> None:
    """Refuse, before anything runs, an ``--only`` item that selects no stage (a typo would otherwise run nothing
    and re-render the report as if it had), naming the kinds and an example of a full stage name."""
    names = [name for name, _ in stages]
    kinds = sorted({name.split("-")[0] for name in names})
    unknown = [o for o in only or [] if not any(selected(name, [o]) for name in names)]
    if unknown:
        raise SystemExit(f"--only {','.join(unknown)}: no such stage; allowed: a kind ({', '.join(kinds)}) or a "
                         f"stage's full name (e.g. {names[-1]}; --status lists them)")


def run_stages(*, study: str, stages: list[tuple[str, list[str]]], only: list[str] | None) -> float:
    """Run every stage (or those ``only`` selects, checked by the caller: :func:`check_only`) one after another;
    returns the wall seconds."""
    start = time.time()
    for name, args in stages:
        if not selected(name, only):
            continue
        t0 = time.time()
        print(f"[{study}] {name}: sdp-train {' '.join(args)}", flush=True)
        sdp_train(args).check_returncode()
        diagnose_kept(args)
        print(f"[{study}] {name}: {time.time() - t0:.0f} s", flush=True)
    return time.time() - start


def diagnose_kept(args: list[str]) -> list[Path]:
    """A stage whose runs kept their final weights (``train.save_final``) is followed by their diagnosis
    (:mod:`sdp.bench.diagnose`, issue 39: one process per run, seconds at this scale), so that the study's one
    command writes what its report reads; a run already diagnosed is skipped, as ``train.skip_done`` skips a run."""
    from sdp.bench.diagnose import DIAGNOSIS, diagnose
    from sdp.report.runs import run_dirs

    if not any(a.startswith("train.save_final=") and a != "train.save_final=none" for a in args):
        return []
    sweep = sweep_dir(args)
    done = []
    for run in (Path(r) for r in run_dirs(sweep)):
        if RunDir(run).final.is_dir() and not (run / DIAGNOSIS).exists():
            diagnose(run)
            print(f"diagnosed {run} ({DIAGNOSIS})", flush=True)
            done.append(run)
    return done


def sweep_dir(args: list[str]) -> Path:
    """The stage's sweep directory (its ``hydra.sweep.dir=`` override): jobs ``0 .. N-1`` live below it."""
    return Path(next(a for a in args if a.startswith(SWEEP_DIR))[len(SWEEP_DIR):])


def sweep_jobs(args: list[str]) -> int:
    """The number of jobs Hydra's basic sweeper makes of ``args``: the product of each override's comma-separated
    values (``hydra.*`` keys configure the launcher, not the sweep; a ``{...}`` or ``[...]`` value is one value)."""
    values = [a.split("=", 1)[1] for a in args if "=" in a and not a.startswith("hydra.")]
    return math.prod(1 if v.startswith(("{", "[")) else len(v.split(",")) for v in values)


@dataclass(frozen=True)
class StageStatus:
    name: str
    sweep: Path
    jobs: int
    done: list[int]
    unfinished: dict[int, int | None]  # started, no summary.json (running, or stopped): its last checkpoint's step

    @property
    def left(self) -> int:
        return self.jobs - len(self.done)


def stage_status(*, name: str, args: list[str]) -> StageStatus:
    sweep = sweep_dir(args)
    jobs = sweep_jobs(args)
    done = [i for i in range(jobs) if RunDir(sweep / str(i)).summary.is_file()]
    unfinished = {i: (checkpoints(sweep / str(i)) or [(None, None)])[-1][0]
                  for i in range(jobs) if i not in done and (sweep / str(i)).is_dir()}
    return StageStatus(name=name, sweep=sweep, jobs=jobs, done=done, unfinished=unfinished)


def status_lines(*, stages: list[tuple[str, list[str]]], only: list[str] | None) -> list[str]:
    """One line per selected stage (name, finished/jobs, the unfinished jobs: where each would go on from) and a
    total of the jobs left."""
    rows = [stage_status(name=name, args=args) for name, args in stages if selected(name, only)]
    width = max((len(r.name) for r in rows), default=0)

    def from_(step: int | None) -> str:
        return "from step 0" if step is None else f"from its checkpoint at step {step}"
    out = [f"{r.name:<{width}}  {len(r.done):>3}/{r.jobs:<3} done"
           + ("  started, unfinished (running, or stopped: resumes "
              + "; ".join(f"job {i} {from_(step)}" for i, step in r.unfinished.items()) + ")" if r.unfinished else "")
           + ("" if r.left else "  (complete)") for r in rows]
    left = sum(r.left for r in rows)
    out.append(f"{left} of {sum(r.jobs for r in rows)} jobs left in {sum(1 for r in rows if r.left)} of {len(rows)} stages")
    return out
