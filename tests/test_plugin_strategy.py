"""A strategy that exists only in this test: one module and one YAML outside ``sdp/``, and sdp-train,
sdp-plan, sdp-report and the FLOP-matched budget all run with it (no file in ``sdp/`` names it).

The module holds both halves of a strategy: the spec the driver asks (SDP's, under a new name and label,
registered with ``@register``) and the runtime class it names, which the ranks run (it marks summary.json);
its YAML lives in a conf dir of the test added to Hydra's search path (``hydra.searchpath``) and inherits ``parallelism/sdp.yaml`` from the package's conf;
``plugins=[...]`` makes the driver and every spawned rank import the module (its directory is on
PYTHONPATH). The report runs in a process that never imports the module: it reads the label and
coverage that the strategy wrote into summary.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, sdp_env

MODULE = '''
from sdp.parallel import register
from sdp.parallel.sdp import SDPSpec, SDPStrategy


class PluginRuntime(SDPStrategy):
    """What each rank runs: SDP's step, evaluation and checkpoints, plus a mark in summary.json."""

    def summary_extra(self):
        return {**super().summary_extra(), "plugin_runtime": True}


@register("sdp_plugin_test")
class PluginSDP(SDPSpec):
    """SDP under another name: what the planner, budget and report know of it, they ask this spec."""

    label = "Plugin-SDP"
    runtime = PluginRuntime
'''

YAML = """# a strategy preset outside sdp's conf/: SDP's keys, another name
defaults:
  - sdp
  - _self_
name: sdp_plugin_test
"""


def _run(args: list[str], *, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[:2]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.slow  # slow tier (CI time: ~20-35 s)
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_strategy_defined_outside_sdp_trains_plans_reports_and_is_flop_matched(tmp_path: Path) -> None:
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "plugin_strategy.py").write_text(MODULE)
    (tmp_path / "conf" / "parallelism").mkdir(parents=True)
    (tmp_path / "conf" / "parallelism" / "sdp_plugin_test.yaml").write_text(YAML)
    env = sdp_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "plugin"), env["PYTHONPATH"]])
    common = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "parallelism=sdp_plugin_test", "plugins=[plugin_strategy]",
              "model=mlp", "dataset=digits", "model.hidden=32", "model.depth=2", "train.batch_size=8",
              "train.eval_batch_size=64", "cluster.world_size=2", "parallelism.coverage=0.5"]
    run_dir = tmp_path / "sweep" / "0"
    _run(["-m", "sdp.driver.train", f"hydra.run.dir={run_dir}", *common, "train.steps=2", "train.budget=flops",
          "train.eval_every=0", "train.warmup_steps=0", "logger.wandb.mode=disabled", "logger.progress=false",
          "cluster.timeout_s=60"], env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "sdp_plugin_test" and summary["label"] == "Plugin-SDP", summary.get("label")
    assert summary["coverage"] == {"key": "parallelism.coverage", "symbol": "C", "value": 0.5, "fraction": 0.5}, summary["coverage"]
    # FLOP-matched: k = 1 of 2 workers holds each unit, so r = 1/2 and DDP's 2 steps become 4
    budget = summary["budget"]
    assert budget["coverage"] == 0.5 and budget["steps"] == 4 and summary["steps"] == 4, budget
    assert summary["strategy_info"]["plan"]["k"] == 1, summary["strategy_info"]["plan"]
    assert summary["strategy_info"].get("plugin_runtime") is True, "the ranks must run the spec's runtime class"

    plan_file = tmp_path / "plan.json"
    _run(["-m", "sdp.planning.planner", *common, f"plan.output={plan_file}"], env=env)
    plan = json.loads(plan_file.read_text())
    assert plan["strategy"] == "sdp_plugin_test" and plan["plan"]["k"] == 1, plan.get("plan")
    predicted = [m["param_bytes"] for m in plan["memory"]["per_rank"]]
    measured = [m["param_bytes"] for m in summary["memory"]["per_rank"]]
    assert predicted == measured, (predicted, measured)

    report_env = sdp_env()  # the report never imports the plugin: summary.json carries label and coverage
    out = tmp_path / "report"
    _run(["-m", "sdp.report.build", str(tmp_path / "sweep"), "--out", str(out)], env=report_env)
    rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| Plugin-SDP |")]
    assert len(rows) == 1 and "| 0.5 |" in rows[0], rows
