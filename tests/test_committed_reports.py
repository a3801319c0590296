"""Every committed CPU study report is what today's code renders from the committed runs: a report is data generated
from its runs (``sdp-bench cpu-study --study S --render-only``), so one left behind by a code change or by runs
committed without a render is a failure, not a document that slowly disagrees with its runs (the ``lm_text``
report had missed several sections' changes before this test). Renders a copy of the tracked files (the studies and
the planner result the one-model section quotes), so runs in progress in a working tree do not count."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sdp.bench.cpu_study import STUDIES
from sdp.bench.one_model_scale import RESULT, render
from sdp.bench.verdicts import write_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks") / "results"


def _tracked(*paths: Path) -> list[Path]:
    """The files git tracks below ``paths`` (relative to the repository); empty outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *map(str, paths)], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [Path(p) for p in out.decode().split("\0") if p]


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_a_committed_report_is_what_its_committed_runs_render(study: str, tmp_path: Path) -> None:
    study_dir = RESULTS / "cpu-study" / study
    # every study (the lm report's gate reads lm_text's runs of its first task) and the planner's result
    files = _tracked(RESULTS / "cpu-study", RESULTS / "one-model-scale")
    if not files:
        pytest.skip("not a git checkout: the committed files cannot be told from others")
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    write_report(study_dir=tmp_path / study_dir, study=study, header=STUDIES[study].get("header", ""))  # as --render-only
    for name in ("REPORT.md", "table.csv"):
        committed, rendered = (ROOT / study_dir / name).read_text(), (tmp_path / study_dir / name).read_text()
        if committed != rendered:
            diff = [f"line {i + 1}:\n  committed {a[:300]}\n  rendered  {b[:300]}"
                    for i, (a, b) in enumerate(zip(committed.splitlines(), rendered.splitlines())) if a != b]
            pytest.fail(f"{study_dir / name} is not what its committed runs render (python benchmarks/cpu_study.py "
                        f"--study {study} --render-only re-writes it); first differences: " + "\n".join(diff[:3]))


def test_the_committed_one_model_scale_markdown_is_what_its_json_renders() -> None:
    """``one_model_scale.md`` is ``sdp-bench one-model-scale --render-only`` of the committed JSON beside it."""
    out = ROOT / RESULTS / "one-model-scale"
    assert (out / "one_model_scale.md").read_text() == render(json.loads((out / RESULT.name).read_text())), (
        f"{out / 'one_model_scale.md'} is stale: sdp-bench one-model-scale --out {RESULTS / 'one-model-scale'} --render-only")
