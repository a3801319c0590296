"""A stop signal ends a local sweep, not just its current job.

torch elastic's agent turns SIGTERM / SIGINT into ``SignalException``, an ``Exception``; Hydra's multirun
catches every ``Exception`` of a job as that job's failure and starts the next job. So ``kill`` (or Ctrl-C)
of a local ``sdp-train -m`` sweep stopped one job and the sweep went on (seen when the CPU study's sweep was
stopped). :func:`sdp.driver.launch.stopped` re-raises the stop as what Hydra does not catch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sdp.driver import launch
from tests.helpers.jobs import QUIET, REPO, sdp_env, survivors


@pytest.mark.parametrize("sig, kind, code", [(signal.SIGTERM, SystemExit, 128 + signal.SIGTERM),
                                             (signal.SIGINT, KeyboardInterrupt, None)])
def test_a_stop_reaching_the_agent_is_not_an_exception(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      sig: signal.Signals, kind: type, code: int | None) -> None:
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def agent(config, entrypoint):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        return run

    monkeypatch.setattr(api, "elastic_launch", agent)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(kind) as caught:
        launch.launch(cfg=OmegaConf.create({"cluster": {"world_size": 2}}), run_dir=tmp_path)
    assert not isinstance(caught.value, Exception), "Hydra's run_job records an Exception and runs the next job"
    if code is not None:
        assert caught.value.code == code, caught.value.code


@pytest.mark.dist
@pytest.mark.slow  # slow tier (CI time)
@pytest.mark.timeout(240)
def test_sigterm_to_a_local_sweep_ends_the_sweep(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "sdp.driver.train", "-m", f"hydra.sweep.dir={root}", *QUIET, "parallelism=ddp", "seed=0,1",
           "model=mlp", "cluster.world_size=2", "train.steps=100000", "train.warmup_steps=1", "train.eval_every=0"]
    token = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, cwd=REPO, env=sdp_env(token=token), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        metrics, deadline = root / "0" / "metrics.jsonl", time.time() + 150
        while not (metrics.exists() and any('"loss"' in x for x in metrics.read_text().splitlines())):
            assert proc.poll() is None and time.time() < deadline, f"job 0 never trained:\n{proc.communicate()[0][-4000:]}"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # to the sweep's own process, as `kill PID` or a time limit does
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-4000:]
    assert not (root / "1").exists(), f"the sweep went on to job 1 after SIGTERM:\n{out[-4000:]}"
    assert not (root / "0" / "summary.json").exists(), "job 0 was stopped, not finished"
    assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1
    assert survivors(token) == [], "the stopped job's ranks are gone"
