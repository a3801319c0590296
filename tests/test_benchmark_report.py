"""``sdp-bench report`` renders the committed reference runs: ratios, the floor table, the frontier and
interleaved repeats (``--render-only`` over a copy, so nothing is launched); every committed report the
suites re-render from saved runs comes back byte-identical; the ratio-to-DDP tables of the benchmark
suites (:mod:`sdp.report.compare`) take the DDP row as reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sdp.bench.report import main
from sdp.report.compare import COMPARE_RATIOS, add_ratios, capacity_markdown, compare_markdown, memory_markdown

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks") / "results" / "cpu-4ranks"
LLAMA = ROOT / RESULTS / "llama"


def test_render_only_report_from_committed_runs(tmp_path: Path) -> None:
    out = tmp_path / "llama"
    shutil.copytree(LLAMA / "runs", out / "runs")
    # A second repeat whose SDP run was twice as slow: the median of (t, 2t) is 1.5t.
    for label in ("ddp", "fsdp", "sdp"):
        shutil.copytree(out / "runs" / label, out / "runs" / f"{label}.rep1")
    summary = out / "runs" / "sdp.rep1" / "summary.json"
    s = json.loads(summary.read_text())
    s["time"]["step_s_median"] *= 2
    summary.write_text(json.dumps(s))

    report = main(["--suite", "llama", "--render-only", "--repeat", "2", "--out", str(out)])
    rows = {r["run"]: r for r in report["rows"]}
    sdp, ddp = rows["sdp"], rows["ddp"]
    t = sdp["step_s_repeats"][0]
    assert sdp["step_s_repeats"] == [t, 2 * t] and sdp["step_s"] == 1.5 * t, sdp["step_s_repeats"]
    assert sdp["x_ddp"]["step_s"] == 1.5 * t / ddp["step_s"]
    assert sdp["x_ddp"]["model_state_bytes"] == sdp["model_state_bytes"] / ddp["model_state_bytes"] < 1
    assert sdp["model_state_mean_bytes"] <= sdp["model_state_bytes"]
    text = (out / "report.md").read_text()
    for needed in ("| run | step s per interleaved repeat |", "mean over ranks", "Run sdp: SDP plan frontier",
                   "| floor (mean over workers", "--repeat 2"):
        assert needed in text, needed
    assert {p.name for p in out.glob("*.png")} == {"memory.png", "comm.png", "step_time.png", "loss.png"}


@pytest.mark.parametrize("suite, argv, outputs, inputs", [
    ("llama", ["report", "--suite", "llama"], ("report.md", "machine.json"), ("report.json",)),
    ("memory", ["memory"], ("memory.md",), ("memory.json",)),
    ("capacity", ["capacity"], ("capacity.md",), ()),
], ids=["report", "memory", "capacity"])
def test_committed_reports_re_render_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suite: str,
                                                    argv: list[str], outputs: tuple[str, ...], inputs: tuple[str, ...]) -> None:
    """``--render-only`` over a copy, run from where the report was written (the command and the run paths it
    records are relative): every file equal to the committed one, byte for byte. The outputs are spoiled
    first and the JSON it also reads is re-indented, so a file the re-render did not write fails the test."""
    from sdp.bench.cli import main as bench

    out = tmp_path / RESULTS / suite
    shutil.copytree(ROOT / RESULTS / suite, out)
    for name in outputs:
        (out / name).write_text("stale\n")
    for name in inputs:
        (out / name).write_text(json.dumps(json.loads((out / name).read_text()), indent=1))
    monkeypatch.chdir(tmp_path)
    assert bench([*argv, "--render-only", "--out", str(RESULTS / suite)]) == 0
    for name in (*outputs, *inputs):
        new, old = (out / name).read_text(), (ROOT / RESULTS / suite / name).read_text()
        assert new == old, f"{suite}/{name} re-rendered differently:\n{new[:2000]}\n--- committed:\n{old[:2000]}"


def test_benchmark_tables_take_ratios_to_the_ddp_row() -> None:
    """report, memory and capacity divide by the DDP row wherever it stands; compare by its first run."""
    from sdp.bench.compare import row
    from sdp.results.summary import read_summary

    rows = [row(label, read_summary(LLAMA / "runs" / label)) for label in ("sdp", "fsdp", "ddp")]  # DDP last
    sdp, ddp = rows[0], rows[2]
    add_ratios(rows, keys=COMPARE_RATIOS)
    assert sdp["x_ddp"]["model_state_bytes"] == sdp["model_state_bytes"] / ddp["model_state_bytes"] < 1, sdp["x_ddp"]
    assert ddp["x_ddp"] == {k: 1.0 for k in COMPARE_RATIOS}, ddp["x_ddp"]
    add_ratios(rows, keys=COMPARE_RATIOS, base=rows[0])  # compare: the first run is the baseline
    text = compare_markdown(rows)
    assert f"| sdp | {sdp['model_state_bytes'] / 2**20:.2f} (1.000) |" in text, text
    assert f"| ddp | {ddp['model_state_bytes'] / 2**20:.2f} ({ddp['model_state_bytes'] / sdp['model_state_bytes']:.3f}) |" in text, text

    peaks = {"setup_peak_bytes": 4 * 2**20, "train_peak_bytes": 8 * 2**20, "eval_peak_bytes": None}
    mem = {"sdp": {**{k: v and v // 2 for k, v in peaks.items()}, "model_state_bytes": 2**20, "step_s": 1.0},
           "ddp": {**peaks, "model_state_bytes": 2**21, "step_s": 2.0}}
    text = memory_markdown(title="t", rows=mem, targets={"train_peak_bytes": 0.4, "setup_peak_bytes": 0.6})
    assert "| sdp | 2.00 (0.500x) | 4.00 (0.500x) | n/a (n/a) | 1.00 | 1.0000 |" in text, text
    assert "- train_peak_bytes: sdp/ddp = 0.500 (target <= 0.4) MISSED" in text and "(target <= 0.6) HIT" in text, text

    best = [{"strategy": "sdp", "depth": 8, "width": 64, "params": 3_000_000, "peak_bytes": 2**20},
            {"strategy": "none", "depth": 0, "width": 0, "params": 0, "peak_bytes": None},
            {"strategy": "ddp", "depth": 4, "width": 64, "params": 1_500_000, "peak_bytes": 2**21}]
    text = capacity_markdown(title="t", best=best)
    assert "| sdp | 8 | 64 | 3.000 | 2.00x | 1.00 |" in text and "| ddp | 4 | 64 | 1.500 | 1.00x | 2.00 |" in text, text
    assert "| none | 0 | 0 | 0.000 | n/a | n/a |" in text, text  # nothing fitted: no ratio, not 0.00x
