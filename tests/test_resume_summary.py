"""A resumed run's ``summary.json`` equals the uninterrupted run's in every count that does not measure time
(issue 35, item 7): the plan a resume rebuilds is not a re-draw of the run (no ``strategy_info.redraw`` entry,
no comm phase ``resample``, no ``redraw_peaks_bytes`` entry), and what the run measured before its checkpoint
(comm records, memory peaks, activation bytes, re-draws) comes back with the checkpoint.

The run is interrupted at a checkpoint: its later checkpoints and its summary are removed, which is what a
job killed right after writing step 6 leaves (``train.resume=auto`` then resumes from step 6, after the first
re-draw at step 4 and before the second at step 8).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

JOB = ["experiment=smoke", "cluster.world_size=2", "train.steps=12", "train.eval_every=5", "parallelism=sdp",
       "parallelism.resample_every=4", "train.checkpoint_every=3", "train.checkpoint_keep=0"]
# What measures time or the process rather than the run: wall-clock figures, pids, where it ran, and the
# resident set size the OS reports (it differs between two uninterrupted runs too).
NOT_COUNTS = ("time", "launcher", "run_dir")
PROCESS = ("baseline_rss_bytes", "peak_rss_delta_bytes")


def counts(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` without what measures time or the process."""
    out = {k: v for k, v in summary.items() if k not in NOT_COUNTS}
    out["memory"] = {"per_rank": [{k: v for k, v in m.items() if k not in PROCESS} for m in summary["memory"]["per_rank"]]}
    return out


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every leaf where ``a`` and ``b`` differ, as ``path: a != b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [*a, *(k for k in b if k not in a)]
        return [d for k in keys for d in differences(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_resumed_summary_counts_what_the_uninterrupted_run_counts(tmp_path: Path) -> None:
    full = run_train(tmp_path / "full", *JOB)
    assert full.summary["strategy_info"]["redraw"]["count"] == 2, full.summary["strategy_info"]["redraw"]
    resumed = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed)
    for step in (9, 12):
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    (resumed / "summary.json").unlink()
    job = run_train(resumed, *JOB, "train.resume=auto")
    assert "step_00000006" in job.output, job.output[-3000:]
    again = json.loads((resumed / "summary.json").read_text())
    diff = differences(counts(full.summary), counts(again))
    assert not diff, "the resumed run's summary differs from the uninterrupted run's:\n" + "\n".join(diff)
