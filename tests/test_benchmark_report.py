"""benchmarks/report.py renders the committed reference runs: ratios, the floor table, the frontier and
interleaved repeats (``--render-only`` over a copy, so nothing is launched)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "benchmarks" / "results" / "cpu-4ranks" / "llama"


def test_render_only_report_from_committed_runs(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.report import main

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
