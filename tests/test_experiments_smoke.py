"""Every experiment runs at scale=cpu: one ``experiment=glob(*)`` multirun through the real Hydra app,
launcher and report callback, a couple of steps each, B-SDP at C = 0.5 on 2 gloo ranks.

``experiment`` is the swept key here, so each experiment's own ``hydra.sweeper.params`` are not
expanded (the sweeper reads them from the config composed without the swept keys): one job per
experiment. Slow (a job is 1-3 minutes on a loaded 2-core machine): ``pytest --runslow -m slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, run_train

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(3600)
def test_every_experiment_runs_two_steps_at_cpu_scale(tmp_path: Path):
    sweep = tmp_path / "sweep"
    job = run_train(sweep, "experiment=glob(*)", "scale=cpu", "variant=b_sdp_c50", "cluster.world_size=2",
                    "train.budget=iterations", "train.steps=2", "train.warmup_steps=0", "train.eval_batch_size=512",
                    multirun=True, timeout=3500)
    ran = {}
    for d in sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()):
        overrides = (d / ".hydra" / "overrides.yaml").read_text()
        name = next(e for e in EXPERIMENTS if f"experiment={e}\n" in overrides + "\n")
        summary = json.loads((d / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["strategy"] == "sdp", (name, summary["steps"], summary["strategy"])
        assert summary["final"]["eval_loss"] is not None, name
        ran[name] = summary["dataset"]
    assert sorted(ran) == EXPERIMENTS, f"ran {sorted(ran)}, expected {EXPERIMENTS}"
    assert set(ran.values()) == {"cpu_standin"}, ran
    assert "tables written to" in job.output and (sweep / "report").is_dir(), job.output[-3000:]
