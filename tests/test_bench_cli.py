"""``sdp-bench SUITE``: one command for every benchmark suite. Its help lists every suite, a wrong suite is
refused naming the value and the allowed ones, ``benchmarks/*.py`` are shims without ``sys.path`` edits,
and the shared rank spawner (:func:`sdp.bench.runs.spawn_ranks`) returns each rank's value or the
failing rank's traceback."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib

import pytest

from sdp.bench import SUITES, module_name
from sdp.bench.cli import main
from tests.helpers import CORE, REPO


def test_help_lists_every_suite_without_loading_torch(capsys: pytest.CaptureFixture) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == list(SUITES), out
    for name in ("memory", "overlap", "precision", "harness-overhead", "capacity", "eval-protocols", "cpu-study",
                 "report", "compare"):
        assert name in SUITES, f"{name} is not a suite: {list(SUITES)}"
    code = "import sys; from sdp.bench.cli import main; main(['--help']); assert 'torch' not in sys.modules, 'torch loaded'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_unknown_or_missing_suite_is_refused_naming_the_allowed_ones(capsys: pytest.CaptureFixture) -> None:
    assert main(["memroy", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "SUITE='memroy' is invalid" in err and f"allowed: {', '.join(SUITES)}" in err, err
    assert main([]) == 2 and "usage: sdp-bench SUITE" in capsys.readouterr().err


@pytest.mark.parametrize("suite", list(SUITES))
def test_every_suite_answers_its_own_help(suite: str, capsys: pytest.CaptureFixture) -> None:
    module = importlib.import_module(module_name(suite))
    with pytest.raises(SystemExit) as exc:
        main([suite, "--help"])
    assert exc.value.code == 0 and f"usage: sdp-bench {suite}" in capsys.readouterr().out, module.__name__


def test_console_script_and_shims() -> None:
    """``sdp-bench`` is installed; each ``benchmarks/X.py`` runs one suite; no file in benchmarks/ edits ``sys.path``."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["sdp-bench"] == "sdp.bench.cli:main", scripts
    edits = []
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        edits += [f"{path.relative_to(REPO)}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert not edits, f"sys.path edits in benchmarks/: {edits}"
    shims = {p.stem: p.read_text() for p in (REPO / "benchmarks").glob("*.py")}
    for stem, text in shims.items():
        suite = stem.replace("_", "-")
        assert suite in SUITES and f'main(["{suite}", *sys.argv[1:]])' in text, f"benchmarks/{stem}.py runs no suite"
    assert sorted(s.replace("-", "_") for s in SUITES) == sorted(shims), (sorted(SUITES), sorted(shims))


def _rank_value(rank: int, world: int, scale: int) -> dict[str, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)  # the group is up: every rank sees the sum
    return {"rank": rank, "world": world, "sum": int(t) * scale, "threads": torch.get_num_threads()}


def _rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")


@pytest.mark.dist
@CORE  # the only check that the rank-level suites (capacity, eval protocols, the DDP loop) can start
@pytest.mark.timeout(180)
def test_spawn_ranks_returns_every_rank_and_raises_the_failing_ones_traceback() -> None:
    from sdp.bench.runs import spawn_ranks

    got = spawn_ranks(_rank_value, world=2, args=(10,), threads=1, timeout_s=60)
    assert got == {r: {"rank": r, "world": 2, "sum": 30, "threads": 1} for r in (0, 1)}, got
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*rank one gives up"):
        spawn_ranks(_rank_fails, world=2, timeout_s=60)
