"""What a person reads when a job stops early (sdp/driver/messages.py): a config error is one line naming
key, value and what is allowed, exit 2, no traceback (``HYDRA_FULL_ERROR=1`` brings it back); Ctrl-C names
the command that resumes the job. The command-line tests start no rank: validation refuses first."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sdp.driver import messages
from sdp.results.rundir import RunDir, checkpoint_meta
from tests.helpers.jobs import QUIET, REPO, sdp_env

BAD = "train.steps=-3"
LINE = "sdp-train: train.steps=-3 is invalid: must be an integer >= 1"


def _train(*args: str, full_error: bool = False) -> subprocess.CompletedProcess:
    env = sdp_env()
    env.pop(messages.TRACEBACK_ENV, None)
    if full_error:
        env[messages.TRACEBACK_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "sdp.driver.train", *args, *QUIET], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_config_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = _train(f"hydra.run.dir={tmp_path / 'run'}", BAD)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == messages.CONFIG_EXIT, (proc.returncode, lines)
    assert lines == [LINE], lines
    full = _train(f"hydra.run.dir={tmp_path / 'full'}", BAD, full_error=True)
    assert full.returncode != 0 and "Traceback" in full.stderr, full.stderr[-3000:]
    assert "sdp.errors.ConfigError: train.steps=-3 is invalid" in full.stderr, full.stderr[-3000:]


def test_a_required_key_left_unset_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """``dataset=fineweb`` without ``dataset.root`` (``???`` in its YAML): OmegaConf's MissingMandatoryValue, met
    where validation first reads the node, is a config error too, naming the key."""
    proc = _train(f"hydra.run.dir={tmp_path / 'run'}", "dataset=fineweb", "model=llama_tiny")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == messages.CONFIG_EXIT, (proc.returncode, lines)
    assert lines == ["sdp-train: dataset.root is required and has no value (??? in its YAML): give it on the "
                     "command line, dataset.root=..."], lines


def test_a_sweep_job_with_a_config_error_fails_without_a_stack(tmp_path: Path) -> None:
    """``-m``: the job's failure stays Hydra's (the sweep's other jobs are run, as before), printed as the
    job's overrides and the message only."""
    proc = _train("-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "parallelism=ddp,sdp", BAD)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "Traceback" not in out and "\ntrain.steps=-3 is invalid: must be an integer >= 1\n" in out, out[-3000:]
    assert "#1 : parallelism=sdp train.steps=-3" in out, "the sweep goes on to its next job"


def _checkpoint(run_dir: Path, step: int) -> None:
    ckpt = RunDir(run_dir).checkpoint(step)
    ckpt.mkdir(parents=True)
    checkpoint_meta(ckpt).write_text("{}")


def _command(line: str, marker: str) -> list[str]:
    assert marker in line, line
    return shlex.split(line.split(marker, 1)[1])


def test_the_resume_hint_of_one_run(tmp_path: Path) -> None:
    """With a checkpoint: train.resume=auto and the run's own directory replace what the user gave for
    them; without one: the same command (nothing to resume), saying why."""
    run_dir = tmp_path / "run dir"  # a space: the command is quoted for a shell
    argv = ["parallelism=ddp", "train.resume=null", "hydra.run.dir=elsewhere", "train.checkpoint_every=20"]
    bare = messages.resume_hint(prog="sdp-train", argv=argv, run_dir=run_dir, sweep_dir=None, checkpoint_every=0)
    assert "no checkpoint in" in bare and "train.checkpoint_every=0" in bare, bare
    assert _command(bare, "to start again: ") == ["sdp-train", "parallelism=ddp", "train.checkpoint_every=20"], bare
    _checkpoint(run_dir, 20)
    _checkpoint(run_dir, 40)
    line = messages.resume_hint(prog="sdp-train", argv=argv, run_dir=run_dir, sweep_dir=None, checkpoint_every=20)
    assert "a checkpoint at step 40" in line, line
    assert _command(line, "to resume: ") == ["sdp-train", "parallelism=ddp", "train.checkpoint_every=20",
                                             "train.resume=auto", f"hydra.run.dir={run_dir}"], line


def test_the_resume_hint_of_a_sweep(tmp_path: Path) -> None:
    argv = ["-m", "parallelism=ddp,sdp", "hydra.sweep.dir=old", "+train.skip_done=false"]
    line = messages.resume_hint(prog="sdp-train", argv=argv, run_dir=tmp_path / "sweep" / "0",
                                sweep_dir=tmp_path / "sweep", checkpoint_every=0)
    assert _command(line, "to finish the sweep (done jobs are skipped, the others resumed or restarted): ") == [
        "sdp-train", "-m", "parallelism=ddp,sdp", f"hydra.sweep.dir={tmp_path / 'sweep'}", "train.skip_done=true"], line


def test_ctrl_c_prints_the_hint_and_exits_130(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(messages.TRACEBACK_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["sdp-train", "parallelism=ddp"])
    _checkpoint(tmp_path, 6)
    with pytest.raises(SystemExit) as stop:
        with messages.interrupts(prog="sdp-train", run_dir=tmp_path, sweep_dir=None, checkpoint_every=3):
            raise KeyboardInterrupt
    assert stop.value.code == messages.INTERRUPT_EXIT, stop.value.code
    err = capsys.readouterr().err
    assert err.startswith("sdp-train: interrupted;") and f"train.resume=auto hydra.run.dir={tmp_path}" in err, err
    monkeypatch.setenv(messages.TRACEBACK_ENV, "1")
    with pytest.raises(KeyboardInterrupt):
        with messages.interrupts(prog="sdp-train", run_dir=tmp_path, sweep_dir=None, checkpoint_every=3):
            raise KeyboardInterrupt


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_ctrl_c_of_a_run_names_its_resume_command(tmp_path: Path) -> None:
    """End to end, as a terminal's Ctrl-C: SIGINT to the whole process group (driver, elastic agent, ranks)
    once the run has a checkpoint: no traceback, exit 130, the last line the resume command."""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    args = ["parallelism=ddp", "model=mlp", "cluster.world_size=2", "train.steps=100000", "train.checkpoint_every=5",
            "train.warmup_steps=1", "train.eval_every=0"]
    env = sdp_env()
    env.pop(messages.TRACEBACK_ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "sdp.driver.train", f"hydra.run.dir={run_dir}", *QUIET, *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 150
        while not RunDir(run_dir).checkpoints.is_dir() or not any(RunDir(run_dir).checkpoints.glob("*/meta.json")):
            assert proc.poll() is None and time.time() < deadline, f"no checkpoint:\n{proc.communicate()[0][-3000:]}"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert proc.returncode == messages.INTERRUPT_EXIT and "Traceback" not in out, (proc.returncode, out[-3000:])
    assert _command(lines[-1], "; to resume: ") == ["sdp-train", *QUIET, *args, "train.resume=auto",
                                                    f"hydra.run.dir={run_dir}"], lines[-1]


def test_a_fresh_start_into_a_directory_holding_a_run_is_refused_and_nothing_is_lost(tmp_path: Path) -> None:
    """The metrics logger appends: a second fresh run into the same directory used to add its rows to the first
    run's (12 rows for a 5-step run), and beside a slimmed run's metrics.jsonl.gz the directory could not be read.
    Refused in one line, before any rank starts, the directory left as it was."""
    run = tmp_path / "run"
    tiny = ["parallelism=ddp", "cluster.world_size=1", "train.steps=3", "train.eval_every=0", "train.warmup_steps=1"]
    first = _train(f"hydra.run.dir={run}", *tiny)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    again = _train(f"hydra.run.dir={run}", *tiny)
    lines = [ln for ln in (again.stdout + again.stderr).splitlines() if ln.strip()]
    assert again.returncode == messages.CONFIG_EXIT and len(lines) == 1, (again.returncode, lines)
    assert lines[0].startswith(f"sdp-train: hydra.run.dir={str(run)!r} is invalid for a fresh start: it holds "
                               "another run's metrics.jsonl, summary.json; allowed: a new directory"), lines
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    skipped = _train(f"hydra.run.dir={run}", *tiny, "train.skip_done=true")  # the documented way to re-use it
    assert skipped.returncode == 0 and "skipped" in skipped.stdout, (skipped.stdout + skipped.stderr)[-3000:]
