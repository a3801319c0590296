"""``sdp-bench slim-runs`` (:mod:`sdp.bench.slim_runs`) drops from a committed run what no reader reads and
compresses its metrics, while everything that reads a run reads it as before: the report's rows and
figures, ``sdp-rerun``'s config and summary, and ``train.skip_done``'s verdict (complete, same config:
skipped). On a temporary copy of a committed run, restored to what a run writes (logs, Hydra's copy,
plan.json, plain metrics.jsonl) first, so the test holds before and after the committed runs are slimmed."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sdp.driver import sweep
from sdp.bench.slim_runs import main, slim, slim_run
from sdp.report.runs import load_run, run_figures
from sdp.results.contract import read_metrics
from sdp.results.rundir import RunDir
from tests.helpers import REPO

RESULTS = REPO / "benchmarks" / "results"
COMMITTED = RESULTS / "quickstart" / "1"  # an SDP run: it wrote plan.json
EXTRAS = {"rank_logs/sdp-x/attempt_0/0/stdout.log": "rank 0\n", ".hydra/overrides.yaml": "- seed=0\n",
          ".hydra/hydra.yaml": "hydra: {}\n", "train.log": "", "wandb_run_id": "abc\n"}


def as_written(dst: Path) -> RunDir:
    """A copy of the committed run as ``sdp-train`` leaves it (whether or not the committed one is slimmed)."""
    shutil.copytree(COMMITTED, dst)
    run = RunDir(dst)
    if run.metrics_gz.exists():
        run.metrics.write_bytes(gzip.decompress(run.metrics_gz.read_bytes()))
        run.metrics_gz.unlink()
    if not run.plan.exists():  # only its summary is compared; the rest of a real plan.json does not matter here
        plan = json.loads(run.summary.read_text())["strategy_info"]["plan"]
        run.plan.write_text(json.dumps({"summary": plan, "units": [], "workers": {}, "worker_costs": []}))
    for name, text in EXTRAS.items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(text)
    return run


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_slim_keeps_what_readers_read_drops_the_rest_and_is_idempotent(tmp_path: Path) -> None:
    run = as_written(tmp_path / "run")
    before = listing(run.root)
    rows, figures = read_metrics(run.root), run_figures(load_run(run.root).summary)
    assert rows and any("eval_loss" in r for r in rows), f"{COMMITTED}: no metrics rows to check"

    dry = slim_run(run.root, dry_run=True)
    assert dry.changed and listing(run.root) == before, "--dry-run changed the run directory"

    done = slim_run(run.root)
    assert sorted(done.removed) == sorted([".hydra/", "plan.json", "rank_logs/", "train.log", "wandb_run_id"]), done
    assert done.compressed and done.bytes_after < done.bytes_before, done
    after = listing(run.root)
    assert sorted(after) == ["config.yaml", "metrics.jsonl.gz", "summary.json"], sorted(after)
    for name in ("config.yaml", "summary.json"):
        assert after[name] == before[name], f"{name} changed"
    assert gzip.decompress(after["metrics.jsonl.gz"]) == before["metrics.jsonl"]
    assert read_metrics(run.root) == rows
    assert run_figures(load_run(run.root).summary) == figures

    again = slim_run(run.root)
    assert not again.changed and again.left is None and listing(run.root) == after, again


def test_a_slimmed_run_is_still_complete_for_skip_done(tmp_path: Path) -> None:
    run = as_written(tmp_path / "run")
    slim_run(run.root)
    cfg = OmegaConf.load(run.config)  # the job's resolved config, as the same sweep composes it again
    plan, summary = sweep.job_plan(cfg=cfg, run_dir=run.root)
    assert plan == "skip" and summary is not None, plan
    recorded = json.loads(run.summary.read_text())["final"]
    final = summary.final.to_json()
    assert {k: final.get(k) for k in recorded} == recorded, (final, recorded)


def test_plan_json_stays_where_it_holds_more_than_the_summary(tmp_path: Path) -> None:
    """A run that re-draws its plan records its last draw in summary.json; plan.json, the first, stays."""
    run = as_written(tmp_path / "run")
    plan = json.loads(run.plan.read_text())
    plan["summary"]["draw"] = -1
    run.plan.write_text(json.dumps(plan))
    done = slim_run(run.root)
    assert "plan.json" not in done.removed and run.plan.exists(), done


def test_incomplete_or_checkpointed_runs_are_left_as_they_are(tmp_path: Path) -> None:
    unfinished = as_written(tmp_path / "unfinished")
    summary = json.loads(unfinished.summary.read_text())
    del summary["final"]
    unfinished.summary.write_text(json.dumps(summary))
    resumable = as_written(tmp_path / "resumable")
    resumable.checkpoint(5).mkdir(parents=True)
    before = {p: listing(p) for p in (unfinished.root, resumable.root)}
    results = slim([tmp_path])
    assert [r.path.name for r in results] == ["resumable", "unfinished"], results
    assert all(r.left and not r.changed for r in results), results
    assert {p: listing(p) for p in before} == before


def test_an_interrupted_slim_is_finished_and_both_forms_are_refused_by_the_reader(tmp_path: Path) -> None:
    run = as_written(tmp_path / "run")
    rows = read_metrics(run.root)
    run.metrics_gz.write_bytes(gzip.compress(b'{"step": 999}\n'))  # stale: written before an interrupted unlink
    with pytest.raises(ValueError, match="both metrics.jsonl and metrics.jsonl.gz"):
        read_metrics(run.root)
    slim_run(run.root)
    assert not run.metrics.exists() and read_metrics(run.root) == rows


def test_a_restart_clears_the_compressed_rows_too(tmp_path: Path) -> None:
    run = as_written(tmp_path / "run")
    slim_run(run.root)
    assert sweep.clear_leftovers(run.root) == ["metrics.jsonl.gz"] and read_metrics(run.root) == []


def test_command_refuses_a_missing_path_and_prints_the_totals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match="PATH=.*no such directory"):
        main([str(tmp_path / "nowhere")])
    as_written(tmp_path / "sweep" / "0")
    assert main([str(tmp_path / "sweep")]) == 0
    assert main([str(tmp_path / "sweep")]) == 0
    assert "1 run directories: 0 slimmed, 1 already slim, 0 left as is" in capsys.readouterr().out


def test_committed_runs_are_slim() -> None:
    """Runs copied into benchmarks/results are slimmed before they are committed: ``sdp-bench slim-runs benchmarks/results``."""
    # what git tracks, not what a working tree holds beside it (rank_logs/, .hydra/ and *.log are git-ignored there)
    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    tracked = set(listed.stdout.split())

    def is_tracked(rel: str) -> bool:
        return rel in tracked or any(t.startswith(rel.rstrip("/") + "/") for t in tracked)

    pending = []
    for r in slim([RESULTS], dry_run=True):
        rel = r.path.relative_to(REPO).as_posix()
        what = [name for name in r.removed if is_tracked(f"{rel}/{name}")]
        if r.compressed and is_tracked(f"{rel}/metrics.jsonl"):
            what.append("+compress")
        if what:
            pending.append(f"{rel}: {what}")
    assert not pending, "not slimmed (run sdp-bench slim-runs benchmarks/results):\n" + "\n".join(pending)
