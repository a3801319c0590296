"""Every Python module of the repository stays within 300 lines: past that a module holds more than one concern,
and the code rule is to split it along a seam (one concern per module, tests by the feature they check) rather than
let it grow (docs/strategies.md: a strategy's schema in a sibling module where its own would pass 300 lines)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 300
FOLDERS = ("sdp", "tests", "benchmarks", "scripts")  # where the repository keeps Python


def test_no_module_passes_300_lines() -> None:
    files = [p for folder in FOLDERS for p in sorted((REPO / folder).rglob("*.py")) if "__pycache__" not in p.parts]
    assert len(files) >= 100, f"only {len(files)} modules found under {FOLDERS}: the walk misses the code"
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, f"modules over {LIMIT} lines (split each along a seam): {long}"
