"""The prepared GPU check (benchmarks/gpu/h200_check.sh) runs as written from a fresh checkout.

Default tier (cheap): the script parses, installs with the README's command and nothing outside the
repository, bounds every run with ``timeout -k``, and its row writer appends each run's row (or the run's
error) as it ends, re-opening the table after a verdict. Slow tier: the whole script in its CPU dry run
(``DRY_RUN=1``: the same commands at tiny sizes on gloo) from a copy of the files git would check out,
every run finishing and no check failing.
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

from tests.helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu" / "h200_check.sh"
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import rows  # noqa: E402


def test_script_parses_installs_from_the_repo_and_bounds_every_run() -> None:
    text = SCRIPT.read_text()
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert ".whl" not in text, "the script installs from a wheel folder that is not in the repository"
    assert re.search(r"pip install (-q )?-e \.", text), "install with the README's command: pip install -e ."
    launches = [ln for ln in text.splitlines() if re.search(r"-m sdp\.(driver\.train|planning\.planner)|rows\.py", ln) and not ln.lstrip().startswith("#")]
    assert launches, "no sdp.driver.train launch found"
    unbounded = [ln for ln in launches if "timeout -k" not in ln]
    assert not unbounded, f"launches without timeout -k (SIGTERM alone leaves the elastic grace period): {unbounded}"
    assert "DRY_RUN" in text and "TOTAL_S" in text


def _summary(*, state: int, setup: int) -> dict:
    per_rank = [{"rank": r, "param_bytes": state // 4, "grad_bytes": state // 4, "optim_bytes": state // 2,
                 "activation_bytes": 10, "setup_peak_bytes": setup, "cuda_max_allocated_bytes": 100,
                 "cuda_max_reserved_bytes": 200, "cuda_device_used_bytes": 300} for r in range(2)]
    return {"world_size": 2, "memory": {"per_rank": per_rank}, "time": {"tokens_per_s": 1000.0},
            "final": {"eval_loss": 1.5}, "backends": {"device_type": "cuda", "tf32_matmul": True}}


def _write_run(runs: Path, name: str, summary: dict | None, log: str = "") -> None:
    (runs / name).mkdir(parents=True)
    (runs / name / "config.yaml").write_text("cluster:\n  device: cuda\n  backend: gloo\n")
    if summary is not None:
        (runs / name / "summary.json").write_text(json.dumps(summary))
    (runs / f"{name}.log").write_text(log)


def test_rows_are_appended_as_runs_end_and_verdicts_read_them(tmp_path: Path) -> None:
    results, runs = tmp_path / "results.md", tmp_path / "runs"
    runs.mkdir()
    common = ["--results", str(results), "--runs", str(runs)]
    rows.main([*common, "header", "--title", "t0", "--line", "device: test"])
    _write_run(runs, "ddp", _summary(state=1000 * 2**20, setup=600 * 2**20))
    rows.main([*common, "row", "--name", "ddp", "--rc", "0", "--secs", "5"])
    first = results.read_text()
    assert first.count("| ddp | 0 | 5 | 2 | gloo |") == 1, first
    _write_run(runs, "fsdp", _summary(state=500 * 2**20, setup=100 * 2**20))
    rows.main([*common, "row", "--name", "fsdp", "--rc", "0", "--secs", "6"])
    rows.main([*common, "verdict", "fsdp_setup", "ddp", "fsdp"])
    rows.main([*common, "verdict", "device_figures", "ddp", "fsdp"])
    _write_run(runs, "hung", None, log="step 3\nRuntimeError: something broke | here\n")
    rows.main([*common, "row", "--name", "hung", "--rc", "137", "--secs", "110"])
    text = results.read_text()
    assert text.startswith(first), "a later row rewrote earlier output instead of appending"
    assert "**fsdp_setup: PASS**" in text and "**device_figures: PASS**" in text, text
    tables = text.count("| run | rc |")
    assert tables == 2, f"the table is re-opened after the verdicts: {tables} headers\n{text}"
    assert "| hung | 137 | 110 |" in text and "RuntimeError: something broke / here" in text, text


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_dry_run_from_a_fresh_checkout(tmp_path: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    clone = tmp_path / "clone"
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / f)
    out = tmp_path / "results"
    env = {**os.environ, "DRY_RUN": "1", "RESULTS_DIR": str(out), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", "benchmarks/gpu/h200_check.sh"], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=840)
    text = (out / "h200_check.md").read_text() if (out / "h200_check.md").exists() else ""
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{text}"
    run_rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| run |")]
    assert len(run_rows) == 7 and all(ln.split("|")[2].strip() == "0" for ln in run_rows), text
    assert "Plan floor" in text and "FAIL" not in text and text.count("**") >= 2 * 5, text
