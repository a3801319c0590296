"""What a person reads when ``sdp-train`` or ``sdp-plan`` stops before its end: a config error as one line
(key, value, what is allowed) with exit code 2, and an interrupt (Ctrl-C) as the command that resumes the job.

Why here and not Hydra's report: Hydra prints a job's exception as "Error executing job with overrides" and
the stack of the driver's validation (about 20 lines for ``sdp-train train.steps=-3``), of which the last
line alone says what is wrong; a Ctrl-C printed the elastic agent's stack and no word of the checkpoint the
run left. ``HYDRA_FULL_ERROR=1``, Hydra's own switch, shows the tracebacks as before.

A sweep (``-m``) keeps Hydra's rule that a job's failure does not stop the others (under the Slurm launcher
the error travels back to the submitter as an exception): a config error there stays the job's failure,
as :class:`JobConfigError`, which Hydra prints without a stack when the sweep ends, after the line naming the
job's overrides; the sweep exits 1, as for any failed job.
"""

from __future__ import annotations

import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hydra.errors import CompactHydraException
from omegaconf.errors import MissingMandatoryValue

from sdp.errors import ConfigError
from sdp.rank.checkpoint import checkpoints

CONFIG_EXIT = 2  # a usage error, as argparse exits
INTERRUPT_EXIT = 130  # 128 + SIGINT: what a shell reports for Ctrl-C
TRACEBACK_ENV = "HYDRA_FULL_ERROR"  # "1": every traceback in full (Hydra's convention, read by Hydra too)
# The overrides a resume command sets itself: the user's own values of them are replaced, not repeated.
RESUME_OVERRIDES = ("train.resume", "train.skip_done", "hydra.run.dir", "hydra.sweep.dir")


class JobConfigError(CompactHydraException):
    """A sweep job's :class:`~sdp.errors.ConfigError`: Hydra prints its message without a stack trace."""


def full_traceback() -> bool:
    """Whether the user asked for tracebacks (``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get(TRACEBACK_ENV) == "1"


def refuse(*, prog: str, message: str) -> None:
    """Print ``prog: message`` on stderr and exit with :data:`CONFIG_EXIT`: a bad value, nothing was started."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(CONFIG_EXIT)


@contextmanager
def config_errors(*, prog: str, sweep: bool = False) -> Iterator[None]:
    """A :class:`~sdp.errors.ConfigError` raised inside becomes one line and exit 2 (a sweep's job: a
    :class:`JobConfigError`, see the module's docstring); the traceback stays with ``HYDRA_FULL_ERROR=1``."""
    try:
        yield
    except (ConfigError, MissingMandatoryValue) as exc:
        if full_traceback():
            raise
        message = str(exc) if isinstance(exc, ConfigError) else missing_message(exc)
        if sweep:
            raise JobConfigError(message) from exc
        refuse(prog=prog, message=message)


def missing_message(exc: MissingMandatoryValue) -> str:
    """A required key left at ``???`` in its YAML (``dataset.root`` of ``dataset=fineweb``), met wherever the
    config is first read: the key and what to do, as a config error's one line."""
    key = exc.full_key or "a key"
    return f"{key} is required and has no value (??? in its YAML): give it on the command line, {key}=..."


def command(*, prog: str, argv: list[str], add: list[str]) -> str:
    """``prog`` with the user's ``argv`` (minus :data:`RESUME_OVERRIDES`) and ``add``, quoted for a shell."""
    def key(arg: str) -> str:
        return arg.lstrip("+~").split("=", 1)[0]

    kept = [a for a in argv if key(a) not in RESUME_OVERRIDES]
    return " ".join(shlex.quote(a) for a in [prog, *kept, *add])


def resume_hint(*, prog: str, argv: list[str], run_dir: Path, sweep_dir: Path | None,
                checkpoint_every: object) -> str:
    """The line an interrupted job prints: the command that goes on from where it stopped.

    A sweep: the same command with its ``hydra.sweep.dir`` and ``train.skip_done=true`` (done jobs skipped,
    checkpointed ones resumed, the rest started: :mod:`sdp.driver.sweep`). One run: ``train.resume=auto``
    with its run directory when it holds a checkpoint, else the same command, which starts afresh."""
    if sweep_dir is not None:
        cmd = command(prog=prog, argv=argv, add=[f"hydra.sweep.dir={sweep_dir}", "train.skip_done=true"])
        return f"{prog}: interrupted; to finish the sweep (done jobs are skipped, the others resumed or restarted): {cmd}"
    found = checkpoints(run_dir)
    if found:
        cmd = command(prog=prog, argv=argv, add=["train.resume=auto", f"hydra.run.dir={run_dir}"])
        return f"{prog}: interrupted; {run_dir} holds a checkpoint at step {found[-1][0]}; to resume: {cmd}"
    cmd = command(prog=prog, argv=argv, add=[])
    return (f"{prog}: interrupted; no checkpoint in {run_dir} (train.checkpoint_every={checkpoint_every}), nothing "
            f"to resume; to start again: {cmd}")


@contextmanager
def interrupts(*, prog: str, run_dir: Path, sweep_dir: Path | None, checkpoint_every: object) -> Iterator[None]:
    """Ctrl-C inside prints :func:`resume_hint` (the process's own ``sys.argv``) and exits 130, without
    a traceback unless ``HYDRA_FULL_ERROR=1``. Raised as ``SystemExit``, which Hydra's sweep does not
    take for a job's failure: a sweep ends (:func:`sdp.driver.launch.stopped`)."""
    try:
        yield
    except KeyboardInterrupt:
        if full_traceback():
            raise
        print(resume_hint(prog=prog, argv=sys.argv[1:], run_dir=run_dir, sweep_dir=sweep_dir,
                          checkpoint_every=checkpoint_every), file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPT_EXIT) from None
