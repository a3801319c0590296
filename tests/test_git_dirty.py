"""``versions.git_dirty``: a run is marked as made by other code when a tracked code file differs from the
commit, not when run data (a study's REPORT.md, replaced committed runs) does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sdp.results.contract import git_dirty


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_run_data_does_not_make_the_tree_dirty(tmp_path: Path) -> None:
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    (tmp_path / "sdp").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "sdp" / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "REPORT.md").write_text("old\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert git_dirty(root=tmp_path / "sdp") is False
    (tmp_path / "benchmarks" / "results" / "REPORT.md").write_text("re-rendered\n")
    assert git_dirty(root=tmp_path / "sdp") is False
    (tmp_path / "sdp" / "code.py").write_text("x = 2\n")
    assert git_dirty(root=tmp_path / "sdp") is True
