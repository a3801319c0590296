"""The table builder on fixture run directories (results contract), and the multirun callback on a real
tiny sweep. Fixtures include a missing seed and a failed run: both reported, never averaged."""

from __future__ import annotations

from sdp.results.summary import Summary

import csv
import json
import statistics
from pathlib import Path

import pytest
import yaml

from sdp.report.build import make_report
from sdp.report.paper import load_paper_values
from sdp.report.tables import build_tables, group_keys, method_label
from tests.helpers import CORE, run_train
from sdp.report.runs import Run, find_runs

MIB = 2**20


def fake_run(root: Path, job: int, *, seed: int, parallelism: dict, acc: float | None, state_mib: float,
             comm_mib: float, step_s: float, steps: int = 10, model: str = "resnet18_cifar",
             dataset: str = "cifar10", world: int = 4, scale: str = "cpu", failed: bool = False) -> Path:
    """A run directory as sdp-train writes it (config.yaml, .hydra/overrides.yaml, metrics.jsonl, summary.json)."""
    d = root / str(job)
    (d / ".hydra").mkdir(parents=True)
    config = {"seed": seed, "model": {"name": model, "width": 8}, "dataset": {"name": dataset},
              "parallelism": parallelism, "cluster": {"world_size": world},
              "train": {"steps": steps, "budget": "flops"}, "scale": {"name": scale},
              "logger": {"wandb": {"mode": "disabled"}}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))  # Hydra's copy: must be skipped
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"seed={seed}"]))
    last = 3 if failed else steps
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, last + 1)))
    if failed:
        return d
    per_rank = [{"rank": r, "param_bytes": state_mib * MIB / 3 * (1 + 0.1 * r), "grad_bytes": state_mib * MIB / 3,
                 "optim_bytes": state_mib * MIB / 3, "peak_rss_delta_bytes": 2 * state_mib * MIB} for r in range(world)]
    summary = {"strategy": parallelism["name"], "world_size": world, "steps": steps, "seed": seed,
               "final": {"train_loss": 0.5, "eval_loss": 1.0 - (acc or 0), "eval_accuracy": acc},
               "memory": {"per_rank": per_rank},
               "comm": {"per_rank": [{"rank": r, "bytes_per_step": comm_mib * MIB * (1 + 0.5 * r)} for r in range(world)]},
               "time": {"step_s_median": step_s, "samples_per_s": 64 / step_s, "straggler_spread": 1.1},
               "budget": {"budget": "flops", "total_flops": 1e12}}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


DDP = {"name": "ddp", "bucket_cap_mb": 25}
BSDP = {"name": "sdp", "level": "block", "masking": "forward", "coverage": 0.5}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """DDP x 3 seeds; B-SDP C=0.5 with seed 1 failed and seed 2 never started (no directory)."""
    root = tmp_path / "sweep"
    job = 0
    for seed, acc in enumerate((0.90, 0.92, 0.94)):
        fake_run(root, job, seed=seed, parallelism=DDP, acc=acc, state_mib=30, comm_mib=10, step_s=1.0)
        job += 1
    fake_run(root, job, seed=0, parallelism=BSDP, acc=0.88, state_mib=15, comm_mib=4, step_s=0.5, steps=20)
    fake_run(root, job + 1, seed=1, parallelism=BSDP, acc=None, state_mib=15, comm_mib=4, step_s=0.5, steps=20, failed=True)
    return root


def test_reader_finds_runs_and_skips_hydra_copies(sweep: Path):
    runs = find_runs(sweep)
    assert [r.path.name for r in runs] == ["0", "1", "2", "3", "4"], [str(r.path) for r in runs]
    assert [r.ok for r in runs] == [True, True, True, True, False]
    assert runs[0].overrides == ["seed=0"]
    assert "last logged step 3 of 20" in runs[4].status(), runs[4].status()


def test_group_keys_are_the_config_differences_without_seed(sweep: Path):
    keys = group_keys(find_runs(sweep))
    # bucket_cap_mb/level/masking/coverage exist in one preset only (one value): implied by parallelism.name
    assert keys == ["parallelism.name", "train.steps"], keys


def test_table_aggregates_seeds_and_reports_missing_and_failed(sweep: Path):
    (table,) = build_tables(find_runs(sweep))
    ddp, bsdp = table.rows
    assert (ddp.method, bsdp.method, bsdp.coverage) == ("DDP", "B-SDP", 0.5)
    acc = ddp.stats["eval_accuracy"]
    assert acc.n == 3 and acc.mean == pytest.approx(92.0)
    assert acc.std == pytest.approx(statistics.stdev([90.0, 92.0, 94.0]))  # sample std (n - 1)
    # the failed seed and the missing seed are named, and only seed 0 is averaged
    assert bsdp.n_ok == 1 and bsdp.stats["eval_accuracy"].mean == pytest.approx(88.0)
    assert any("seed 1: no summary.json" in n for n in bsdp.notes), bsdp.notes
    assert any("seed 2: no run directory" in n for n in bsdp.notes), bsdp.notes
    # ratios of means to DDP, per-rank figures taken on the largest rank
    assert bsdp.ratios["state_mem_x_ddp"] == pytest.approx(0.5)
    assert bsdp.ratios["comm_x_ddp"] == pytest.approx(0.4)
    assert bsdp.ratios["step_time_x_ddp"] == pytest.approx(0.5)
    assert ddp.ratios["state_mem_x_ddp"] == pytest.approx(1.0)


def test_report_files_markdown_and_csv(sweep: Path, tmp_path: Path):
    report = make_report(sweep_dir=sweep, out_dir=tmp_path / "out")
    md = (tmp_path / "out" / "table.md").read_text()
    assert "| B-SDP | 0.5 | 1 of 3 |" in md, md
    assert "92.00 ± 2.00" in md and "0.500x" in md, md
    assert "Runs without results (1 of 5" in report.markdown and str(sweep / "4") in report.markdown
    with open(tmp_path / "out" / "table.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["DDP", "B-SDP"]
    assert rows[1]["n"] == "1" and rows[1]["n_expected"] == "3"
    assert float(rows[0]["eval_accuracy_mean"]) == pytest.approx(92.0)
    assert "paper" not in md.split("Paper claims")[0].lower().replace("paper values", ""), "no paper cell at CPU scale"


def test_contexts_split_tables_and_ratios_stay_within_a_table(tmp_path: Path):
    root = tmp_path / "s"
    for job, (world, state) in enumerate(((2, 20), (2, 10), (4, 40), (4, 10))):
        par = DDP if job % 2 == 0 else BSDP
        fake_run(root, job, seed=0, parallelism=par, acc=0.9, state_mib=state, comm_mib=1, step_s=1, world=world)
    tables = build_tables(find_runs(root))
    assert [t.context for t in tables] == [{"cluster.world_size": 2}, {"cluster.world_size": 4}]
    assert [t.rows[1].ratios["state_mem_x_ddp"] for t in tables] == pytest.approx([0.5, 0.25])


def test_paper_values_only_next_to_matching_paper_scale_runs(tmp_path: Path):
    root = tmp_path / "s"
    fake_run(root, 0, seed=0, parallelism=DDP, acc=None, state_mib=30, comm_mib=1, step_s=1,
             model="llama_1b", dataset="fineweb", world=8, scale="paper")
    report = make_report(sweep_dir=root)
    (table,) = report.tables
    assert table.rows[0].paper == {"eval_loss": 2.452}
    assert table.rows[1].method.startswith("SDP (paper's best variant") and table.rows[1].paper["eval_loss"] == 2.437
    assert "[S]" in report.markdown and "v5" in report.markdown
    md = (root / "report" / "table.md").read_text()
    assert "paper eval loss" in md and "2.4520" in md and "paper peak mem ×DDP" in md


def test_paper_values_file_cites_versions():
    data = load_paper_values()
    assert data["paper"]["arxiv"] == "2507.09029"
    for t in data["tables"]:
        assert t["version"] and t["provenance"] and t["rows"]
    assert all(c["source"] and c["version"] for c in data["claims"])


@pytest.mark.parametrize("par,label", [({"name": "ddp"}, "DDP"), (BSDP, "B-SDP"),
                                       ({**BSDP, "masking": "backward"}, "B_β-SDP"),
                                       ({**BSDP, "level": "neuron"}, "N-SDP"),
                                       ({"name": "fsdp"}, "FSDP"), ({"name": "someone_elses"}, "someone_elses")])
def test_method_labels(par: dict, label: str):
    """Without a label in summary.json (runs written before it had one) the strategy names its method
    from the run's config; summary.json's label wins when present; an unknown strategy keeps its name."""
    run = Run(path=Path("run"), config={"parallelism": par, "cluster": {"world_size": 4}}, overrides=[], summary=None)
    assert method_label(run) == label
    run.summary = Summary(label="Recorded")
    assert method_label(run) == "Recorded"


def test_cli_on_empty_dir_fails_clearly(tmp_path: Path, capsys):
    from sdp.report.build import main

    assert main([str(tmp_path)]) == 2
    assert "no run directory" in capsys.readouterr().err


@pytest.mark.dist
@CORE
@pytest.mark.timeout(420)
def test_multirun_ends_by_printing_the_table(tmp_path: Path):
    sweep = tmp_path / "sweep"
    job = run_train(sweep, "parallelism=ddp", "seed=0,1", "model=mlp", "train.steps=5", "train.warmup_steps=1",
                    "train.eval_every=0", multirun=True, timeout=360)
    out = job.proc.stdout
    assert "## Results of" in out and "| DDP | 2 |" in out, out[-3000:]
    assert (sweep / "report" / "table.md").exists() and (sweep / "report" / "table.csv").exists()
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["budget"]["budget"] == "iterations" and summary["budget"]["total_flops"] > 0
