"""docs/strategies.md's recipe for a strategy, executed as written: its typed strategy (one module holding the
spec, the runtime and the schema dataclass; one YAML extending that schema) is taken from the doc's code blocks,
so the doc cannot drift from what works, and written into a copy of the repository where no other file names it.

In that copy, ``sdp-train`` trains it on 2 ranks, ``sdp-plan`` predicts what the run measured, ``sdp-report`` names
it, its schema refuses a bad value in one line before any rank starts, and the typed-config tests take it in
(every preset composes into its strategy's schema, every field documented, each choice written once). Before
strategies declared their schemas, a new typed strategy also needed a dataclass and table entries in the driver:
the YAML's schema was unknown and the preset test raised a KeyError.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CORE, REPO, sdp_env

DOC = REPO / "docs" / "strategies.md"
# a fenced block whose first line names where it goes: the module in sdp/parallel/, the YAML in conf/parallelism/
BLOCK = re.compile(r"```(?:python|yaml)\n# ((?:sdp/parallel/\w+\.py)|(?:conf/parallelism/\w+\.yaml))\n(.*?)```", re.S)
COPIED = ("sdp", "conf", "tests", "pyproject.toml")


def recipe() -> dict[str, str]:
    """The doc's files, path -> text as the doc shows them (the path comment line included)."""
    files = {path: f"# {path}\n{body}" for path, body in BLOCK.findall(DOC.read_text())}
    assert sorted(Path(p).parts[0] for p in files) == ["conf", "sdp"], f"expected one module and one YAML in {DOC}: {list(files)}"
    return files


def copy_repo(root: Path) -> None:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, root / name)


def _run(args: list[str], *, root: Path, env: dict[str, str], code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == code, f"{args[:3]}: exit {proc.returncode}, expected {code}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@CORE
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_the_docs_typed_strategy_is_one_module_and_one_yaml(tmp_path: Path) -> None:
    files = recipe()
    root = tmp_path / "repo"
    copy_repo(root)
    for path, text in files.items():
        assert not (root / path).exists(), f"{path} exists already: the recipe must add it"
        (root / path).write_text(text)
    name = Path(next(p for p in files if p.startswith("conf/"))).stem
    env = sdp_env()
    env["PYTHONPATH"] = os.pathsep.join([str(root), env["PYTHONPATH"]])  # the copy's sdp, not this checkout's

    common = [f"parallelism={name}", "model=mlp", "dataset=digits", "model.hidden=32", "model.depth=2", "train.batch_size=8",
              "train.eval_batch_size=64", "cluster.world_size=2"]
    run_dir = tmp_path / "sweep" / "0"
    _run(["-m", "sdp.driver.train", f"hydra.run.dir={run_dir}", *common, "train.steps=2", "train.eval_every=0",
          "train.warmup_steps=0", "logger.wandb.mode=disabled", "logger.progress=false", "cluster.timeout_s=60"], root=root, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == name, summary["strategy"]
    measured = summary["comm"]["per_rank"]
    params = [m["param_bytes"] for m in summary["memory"]["per_rank"]]
    # the example sums the fp32 gradients in bf16 (its YAML's reduce_dtype): half the parameter bytes, one collective
    assert [c["bytes_per_step"] for c in measured] == [p / 2 for p in params], (measured, params)
    assert [c["collectives_per_step"] for c in measured] == [1.0, 1.0], measured

    plan_file = tmp_path / "plan.json"
    _run(["-m", "sdp.planning.planner", *common, f"plan.output={plan_file}"], root=root, env=env)
    plan = json.loads(plan_file.read_text())
    assert plan["strategy"] == name, plan["strategy"]
    assert [c["bytes_per_step"] for c in plan["comm"]["per_rank"]] == [c["bytes_per_step"] for c in measured], plan["comm"]
    assert [m["param_bytes"] for m in plan["memory"]["per_rank"]] == params, plan["memory"]

    out = tmp_path / "report"
    _run(["-m", "sdp.report.build", str(tmp_path / "sweep"), "--out", str(out)], root=root, env=env)
    label = summary["label"]
    rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, f"no report row for {label!r}: {(out / 'report.md').read_text()[:2000]}"

    refused = _run(["-m", "sdp.planning.planner", *common, "parallelism.reduce_dtype=fp8"], root=root, env=env, code=2)
    line = refused.stderr.strip().splitlines()[-1]
    assert line == "sdp-plan: parallelism.reduce_dtype='fp8' is invalid: allowed: fp32, bf16, fp16", refused.stderr[-2000:]

    tests = _run(["-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_typed_config.py", "tests/test_schema_fields.py", "-k",
                  f"{name} or written_once or docstring or numeric_field"], root=root, env=env)
    for test in (f"test_every_parallelism_preset_composes_into_its_schema[{name}]", "test_each_set_of_allowed_values_is_written_once",
                 "test_every_field_has_a_type_and_a_docstring", "test_every_numeric_field_has_a_range"):
        assert f"::{test} PASSED" in tests.stdout, f"{test} did not pass on the copy:\n{tests.stdout[-3000:]}"
