"""What ``sdp-train`` runs: the composition its arguments name (the comparison, ``experiment=compare``: DDP next
to SDP at k = 2, one multirun; without an experiment one plain run, as ``--cfg job`` prints), the comparison table
it ends with (ratios to DDP, on the committed reference runs) and the sweep's
progress label. All fast: nothing is launched."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sdp.driver import train
from sdp.results.loggers import SWEEP_PROGRESS_ENV, SweepProgress, sweep_size
from sdp.report.callback import ReportCallback
from sdp.report.compare import comparison_markdown
from sdp.report.runs import find_runs, run_figures
from sdp.report.tables import build_tables
from sdp.subnet.plan import num_holders
from tests.hydra_cfg import compose_config

ROOT = Path(__file__).resolve().parent.parent
LLAMA_RUNS = ROOT / "benchmarks" / "results" / "cpu-4ranks" / "llama" / "runs"  # DDP, FSDP, B-SDP C=0.5, 4 ranks


COMPARE = ["experiment=compare"]  # the README's first command: the comparison, asked for by name


def test_the_comparison_is_asked_for_by_name_and_sdp_train_alone_is_the_default_composition(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_config(*COMPARE, hydra=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN" and cfg.hydra.callbacks.report.compare is True
    methods = str(cfg.hydra.sweeper.params.parallelism).split(",")
    assert methods[0] == "ddp" and "sdp" in methods, methods
    assert sweep_size(params=dict(cfg.hydra.sweeper.params), overrides=[]) == (len(methods), ["parallelism"])
    jobs = {m: compose_config(*COMPARE, f"parallelism={m}") for m in methods}
    for m, job in jobs.items():  # a fair comparison: only the strategy differs
        for key in ("seed", "train", "dataset", "model", "optim", "cluster"):
            assert job[key] == jobs["ddp"][key], (m, key)
    sdp = jobs["sdp"]
    assert (sdp.dataset.name, sdp.cluster.world_size, sdp.parallelism.level, sdp.parallelism.masking) == ("digits", 4, "block", "forward")
    assert num_holders(coverage=sdp.parallelism.coverage, world_size=sdp.cluster.world_size) == 2  # holders really share

    plain = compose_config("parallelism=sdp", hydra=True)  # one plain run: no experiment named
    assert plain.hydra.mode is None and not plain.hydra.sweeper.params and plain.hydra.callbacks.report.compare is False
    assert plain.cluster.world_size == 2 and plain.parallelism.name == "sdp"

    seen: list[list[str]] = []  # what Hydra is handed: the arguments as typed, whatever their number
    monkeypatch.setattr(train, "_hydra_main", lambda: seen.append(sys.argv[1:]))
    for argv in (["sdp-train"], ["sdp-train", "logger.progress=false"], ["sdp-train", "--cfg", "job"], ["sdp-train", *COMPARE]):
        monkeypatch.setattr(sys, "argv", list(argv))
        train.main()
        assert seen[-1] == argv[1:], (argv, seen[-1])


def _cfg_job(*args: str) -> dict:
    """What ``sdp-train <args> --cfg job`` prints, as a dict."""
    import subprocess

    import yaml

    out = subprocess.run([sys.executable, "-m", "sdp.driver.train", *args, "--cfg", "job"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return yaml.safe_load(out.stdout)


def test_cfg_job_prints_what_runs() -> None:
    """``--cfg job`` shows the job ``sdp-train`` with the same arguments runs: the bare command's one plain run
    (2 ranks, the default strategy) and, under the comparison, the comparison's 4 ranks and data."""
    from omegaconf import OmegaConf

    bare, progress_off = _cfg_job(), _cfg_job("logger.progress=false")
    assert bare == OmegaConf.to_container(compose_config(), resolve=False), "the bare --cfg job differs from the composition"
    assert progress_off["logger"]["progress"] is False and {**progress_off, "logger": bare["logger"]} == bare
    compare = _cfg_job(*COMPARE)
    assert compare["cluster"]["world_size"] == 4 and bare["cluster"]["world_size"] == 2, (compare["cluster"], bare["cluster"])


def _cells(text: str, method: str) -> dict[str, str]:
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    header = next(line for line in text.splitlines() if line.startswith("| method |"))
    row = next(line for line in text.splitlines() if line.startswith(f"| {method} |"))
    return dict(zip(split(header), split(row)))


def test_comparison_table_is_ratios_to_ddp_and_prefers_the_training_peak(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sweep = tmp_path / "sweep"
    shutil.copytree(LLAMA_RUNS, sweep)
    for path in sweep.glob("*/summary.json"):  # first as runs made before the training peak was recorded
        s = json.loads(path.read_text())
        for r in s["memory"]["per_rank"]:
            r.pop("train_peak_bytes", None)
        path.write_text(json.dumps(s))
    runs = {r.path.name: run_figures(r.summary) for r in find_runs(sweep)}
    [table] = build_tables(find_runs(sweep))
    text = comparison_markdown(table)
    sdp, ddp = runs["sdp"], runs["ddp"]
    cells = _cells(text, "B-SDP")
    assert cells["C"] == "0.5" and cells["k"] == "2" and cells["seeds"] == "1", cells
    for header, key in (("model state ×DDP", "model_state_bytes"), ("comm bytes/step ×DDP", "comm_bytes_per_step"),
                        ("step time ×DDP", "step_s"), ("peak RSS delta ×DDP", "peak_bytes")):
        assert cells[header] == f"{sdp[key] / ddp[key]:.2f}x", (header, cells[header])
    assert set(_cells(text, "DDP").values()) >= {"1.00x"} and "eval acc (%)" not in cells  # LM runs: no accuracy
    assert f"DDP itself (= 1.00x): peak RSS delta {ddp['peak_bytes'] / 2**20:.2f} MiB" in text
    assert "training peak not recorded by these runs" in text

    # Runs that record each rank's training peak: that is the memory column, on the fullest rank.
    for name, scale in (("ddp", 1.0), ("fsdp", 0.5), ("sdp", 0.25)):
        path = sweep / name / "summary.json"
        s = json.loads(path.read_text())
        for r in s["memory"]["per_rank"]:
            r["train_peak_bytes"] = int(1e8 * scale * (1 + 0.1 * r["rank"]))
        path.write_text(json.dumps(s))
    ReportCallback(compare=True)._build(sweep)
    out = capsys.readouterr().out
    assert _cells(out, "B-SDP")["train peak ×DDP"] == "0.25x" and _cells(out, "FSDP")["train peak ×DDP"] == "0.50x", out
    assert "peak RSS delta" not in out and "DDP itself (= 1.00x): train peak 123.98 MiB" in out
    assert f"comparison: {sweep / 'report' / 'comparison.md'}" in out and "## Results of" not in out  # one table
    assert {p.name for p in (sweep / "report").glob("*.png")} == {"memory.png", "comm.png", "step_time.png", "loss.png"}
    assert (sweep / "report" / "report.md").exists() and "B-SDP" in (sweep / "report" / "comparison.md").read_text()


def test_sweep_progress_labels_each_job_with_the_runs_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWEEP_PROGRESS_ENV, raising=False)
    sweep = OmegaConf.create({"hydra": {"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                                    "params": {"parallelism": "ddp,sdp"}},
                                        "overrides": {"task": ["experiment=compare", "seed=0,1"]}}})
    cb = SweepProgress()
    cb.on_job_start(OmegaConf.create({"hydra": {"overrides": {"task": ["seed=0"]}, "job": {"num": 0}}}))
    assert SWEEP_PROGRESS_ENV not in os.environ  # a single run keeps the plain "train" bar
    cb.on_multirun_start(sweep)
    labels = []
    for num, task in enumerate((["parallelism=ddp", "experiment=compare", "seed=0"], ["parallelism=sdp", "experiment=compare", "seed=0"])):
        job = OmegaConf.create({"hydra": {"overrides": {"task": task}, "job": {"num": num}}})
        cb.on_job_start(job)
        labels.append(os.environ[SWEEP_PROGRESS_ENV])
        cb.on_job_end(job)
    assert labels == ["0/4 runs done · parallelism=ddp seed=0", "1/4 runs done · parallelism=sdp seed=0"], labels
    assert SWEEP_PROGRESS_ENV not in os.environ


QUICKSTART = ROOT / "benchmarks" / "results" / "quickstart"  # the README's table: DDP, B-SDP, B_β-SDP, one seed


def test_comparison_says_what_each_plus_minus_is_and_its_title_no_false_scale(tmp_path: Path) -> None:
    """Column ``seeds`` (not ``n``); the footer says a ± after a mean is the std over seeds and a Δ's is the 95 %
    half-width; the title of a digits run does not claim ``scale=paper`` (the default), a ``scale=cpu`` run's says so."""
    from sdp.report import render

    [table] = build_tables(find_runs(QUICKSTART))
    for text in (comparison_markdown(table), render.to_markdown(table)):
        cells = _cells(text, "B-SDP")
        assert cells.get("seeds") == "1" and "n" not in cells, cells
        assert cells["Δ eval loss vs DDP (95 % CI)"].endswith(" (1 seed: no interval)"), cells
        assert render.STD_NOTE in text and render.DELTA_NOTE in text, text
        assert text.startswith("### model=resnet18_cifar, dataset=digits, workers=4, budget=iterations, eval BN="), text
    [alone] = build_tables([r for r in find_runs(QUICKSTART) if r.flat["parallelism.name"] != "ddp"])
    assert "Δ" not in comparison_markdown(alone) and render.STD_NOTE in comparison_markdown(alone)  # no DDP row: no Δ
    cpu = tmp_path / "cpu"
    shutil.copytree(QUICKSTART, cpu, ignore=shutil.ignore_patterns("report"))
    for config in cpu.glob("*/config.yaml"):
        config.write_text(config.read_text().replace("scale:\n  name: paper\n", "scale:\n  name: cpu\n"))
    [table] = build_tables(find_runs(cpu))
    assert ", scale=cpu, " in table.title, table.title
