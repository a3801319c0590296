"""summary.json typed (:mod:`sdp.results.summary`) and the run directory's names (:mod:`sdp.results.rundir`): every
committed run reads back and writes out unchanged, older runs read with their absent fields as None,
keys a newer writer adds survive, no module spells an output file's name outside ``sdp/results/rundir.py``,
and ``train.run`` runs a composed config into a directory it is given, with no Hydra app around it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from sdp.results import rundir
from sdp.report.stats import ratio
from sdp.results.rundir import RunDir
from sdp.results.summary import Final, Summary, format_summary, read_summary

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = sorted((ROOT / "benchmarks" / "results").rglob("summary.json"))


def test_committed_summaries_read_back_and_write_out_unchanged() -> None:
    current = older = 0
    for path in COMMITTED:
        raw = json.loads(path.read_text())
        out = Summary.from_json(raw).to_json()
        if set(out) == set(raw) and set(out["final"]) == set(raw["final"]):
            assert json.dumps(out) == json.dumps(raw), f"{path}: to_json differs from the file"  # key order too
            current += 1
            continue
        older += 1  # written before some fields existed: what it has is unchanged, the rest reads as empty
        assert {k: out[k] for k in raw if k != "final"} == {k: v for k, v in raw.items() if k != "final"}, path
        assert {k: out["final"][k] for k in raw["final"]} == raw["final"], path
        added = {k: out[k] for k in set(out) - set(raw)}
        assert all(v in (None, [], {}, {"per_rank": []}) for v in added.values()), (path, added)
        if set(out["final"]) == set(raw["final"]):  # the keys it has come back in the file's order
            assert [k for k in out if k in raw] == list(raw), path
    assert current + older == len(COMMITTED) and older, f"committed runs: current={current} older={older}"


def test_unknown_keys_survive_after_the_known_ones() -> None:
    raw = {"strategy": "sdp", "final": {"eval_loss": 1.5, "new_metric": 3.0}, "future_key": "x", "other": 0.5}
    s = Summary.from_json(raw)
    assert s.extra == {"future_key": "x", "other": 0.5} and s.final.extra == {"new_metric": 3.0}
    assert s.final.eval_loss == 1.5 and s.steps is None and s.memory_per_rank == []
    out = s.to_json()
    assert list(out)[-2:] == ["future_key", "other"] and out["final"]["new_metric"] == 3.0
    assert Summary.from_json(out).to_json() == out


def test_written_summary_reads_back_and_a_broken_one_reads_as_none(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert read_summary(run) is None  # no summary.json: a failed or unfinished run
    s = Summary(strategy="ddp", world_size=2, steps=3, final=Final(train_loss=0.5, eval_loss=0.75),
                memory_per_rank=[{"rank": 0, "param_bytes": 8}], time={"step_s_median": 0.1})
    s.write(run)
    on_disk = json.loads(run.summary.read_text())
    assert on_disk["memory"] == {"per_rank": [{"rank": 0, "param_bytes": 8}]} and on_disk["final"]["eval_loss"] == 0.75
    assert read_summary(tmp_path) == s
    run.summary.write_text('{"strategy": "ddp", "fin')  # half written
    assert read_summary(run) is None
    run.summary.write_text("[1, 2]")  # not an object
    assert read_summary(run) is None


def test_format_summary_of_a_committed_run() -> None:
    path = next(p for p in COMMITTED if "budget" in json.loads(p.read_text()))
    s = read_summary(path.parent)
    text = format_summary(s)
    assert text.startswith(f"strategy={s.strategy} model={s.model}") and f"steps={s.steps}" in text, text
    assert text.count("\nrank ") == s.world_size and text.endswith(f"results: {s.run_dir}"), text
    assert f"budget={s.budget['budget']}" in text


def test_ratio_is_absent_without_both_figures() -> None:
    assert ratio(1.0, 4.0) == 0.25 and ratio(0.0, 2.0) == 0.0
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


# The run directory's file and folder names (a constant of sdp.results.rundir that names a file or folder)
NAMES = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and ("." in v or k in ("CHECKPOINTS", "RANK_LOGS"))}
# (file, name): a file of the same name that is not the run directory's
ELSEWHERE = {("sdp/results/loggers.py", "config.yaml"),  # W&B's own run files directory
             ("sdp/bench/frontier.py", "config.yaml")}  # the repository's conf/config.yaml (its plan.mfu), not a run's


def test_output_names_are_spelled_only_in_rundir() -> None:
    assert {"config.yaml", "metrics.jsonl", "summary.json", "plan.json", "meta.json", "checkpoints"} <= NAMES
    files = [*(ROOT / "sdp").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    found = []
    for f in files:
        rel = str(f.relative_to(ROOT))
        if rel == "sdp/results/rundir.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in NAMES and (rel, node.value) not in ELSEWHERE:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, f"output names spelled outside sdp/results/rundir.py (use sdp.results.rundir.RunDir): {found}"


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_train_run_writes_into_the_directory_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Hydra app, no HydraConfig: a composed config and a directory are all ``train.run`` needs."""
    from hydra.core.hydra_config import HydraConfig

    from sdp.driver import train
    from tests.hydra_cfg import compose_config

    monkeypatch.setenv("WANDB_MODE", "disabled")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    cfg = compose_config("parallelism=ddp", "cluster.world_size=1", "model.width=8", "dataset.image_size=8", "train.steps=4",
                         "train.eval_every=0", "train.warmup_steps=1", "logger.wandb.mode=disabled",
                         "logger.progress=false")
    assert not HydraConfig.initialized()
    summary = train.run(cfg, run_dir=tmp_path / "job")
    run = RunDir(tmp_path / "job")
    assert isinstance(summary, Summary) and summary.run_dir == str(run.root) and summary.steps == 4
    assert read_summary(run).to_json() == json.loads(json.dumps(summary.to_json(), default=str))  # as written
    assert run.config.is_file() and run.metrics.is_file()
