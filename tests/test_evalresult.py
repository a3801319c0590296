"""One typed evaluation result (:mod:`sdp.results.evalresult`): a new metric is two edits, its field and its
computation (:func:`sdp.rank.evaluation.result`), and it reaches metrics.jsonl, summary.json's ``final`` and
the report's table and CSV with no other edit; a summary recorded before a field existed reads it as None."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tests.helpers.jobs import QUIET, REPO, sdp_env

# The two edits, made from outside: a sitecustomize runs them first in every interpreter of the job (the driver,
# its ranks, the report), before any other module of sdp is imported, as if they were written in the source.
TOY = '''
import dataclasses
from sdp.results import evalresult
evalresult.EvalResult = dataclasses.make_dataclass(  # edit 1: the field, shown in the table
    "EvalResult", [("toy_metric", "float | None", evalresult.metric(column="toy metric", digits=3))],
    bases=(evalresult.EvalResult,))
from sdp.rank import evaluation
computed = evaluation.result
def result(**kw):  # edit 2: the computation
    r = computed(**kw)
    return dataclasses.replace(r, toy_metric=2.0 * r.eval_loss)
evaluation.result = result
'''


@pytest.mark.slow  # slow tier (CI time)
def test_a_field_added_to_the_eval_result_reaches_the_summary_and_the_report(tmp_path: Path) -> None:
    """A toy metric (twice the eval loss) added as one field and one computation: ``sdp-train`` logs it, writes it
    into summary.json's ``final``, and ``sdp-report`` aggregates it into its own column of the table and the CSV."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TOY)
    env = sdp_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    run = tmp_path / "run"
    train = [sys.executable, "-m", "sdp.driver.train", f"hydra.run.dir={run}", *QUIET, "model=mlp", "dataset=digits",
             "parallelism=ddp", "cluster.world_size=1", "train.steps=2", "train.warmup_steps=0", "train.eval_every=0"]
    proc = subprocess.run(train, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"sdp-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    final = json.loads((run / "summary.json").read_text())["final"]
    print(f"final: {final}")
    assert final.get("toy_metric") == 2.0 * final["eval_loss"], f"toy_metric not in summary.json's final: {final}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert rows and rows[-1].get("toy_metric") == final["toy_metric"], f"last evaluation row: {rows[-1:]}"

    report = [sys.executable, "-c", "import sys; from sdp.report.build import main; sys.exit(main(sys.argv[1:]))",
              str(run), "--out", str(tmp_path / "report")]
    proc = subprocess.run(report, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"sdp-report failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    md = (tmp_path / "report" / "table.md").read_text()
    header, row = md.splitlines()[2], md.splitlines()[4]
    print(header, row, sep="\n")
    cells = dict(zip([h.strip() for h in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert cells.get("toy metric") == f"{final['toy_metric']:.3f}", f"no toy metric column with its value: {cells}"
    with open(tmp_path / "report" / "table.csv") as f:
        table = list(csv.DictReader(f))
    assert float(table[0]["toy_metric_mean"]) == final["toy_metric"], table[0]


def test_a_summary_recorded_before_a_field_reads_it_as_none_and_the_report_takes_every_field() -> None:
    """The fields' defaults are the one table an older record is read with: a ``final`` holding only the figures
    of the first runs gives None for every later one, and the report's per-run figures name every field."""
    from sdp.report.runs import run_figures
    from sdp.results import evalresult
    from sdp.results.summary import Summary

    old = Summary.from_json({"strategy": "ddp", "final": {"train_loss": 2.0, "eval_loss": 1.5, "eval_accuracy": 0.25}})
    later = {f.name: getattr(old.final, f.name) for f in fields(evalresult.EvalResult)
             if f.name not in ("eval_loss", "eval_accuracy")}
    assert later and all(v is None for v in later.values()), later
    figures = run_figures(old)
    assert {n: figures[n] for n in ("eval_loss", "eval_accuracy", "train_loss")} == {
        "eval_loss": 1.5, "eval_accuracy": 25.0, "train_loss": 2.0}, figures
    assert {f.name for f in fields(evalresult.EvalResult)} <= set(figures), sorted(figures)
