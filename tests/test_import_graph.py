"""The layers of ``sdp`` hold: the import-linter contracts of ``pyproject.toml`` (``[tool.importlinter]``), the
picture of the packages a newcomer reads first, are kept.

Two contracts: ``layers`` (every package imports only from the layers below it; ``a | b`` siblings not from
each other; every package of ``sdp`` has its place) and ``modules`` (no cycle between the modules of any one
package). import-linter reads every import statement from the source, those inside functions and under
``TYPE_CHECKING`` included: a lazy import that only dodges a cycle is still a cycle of design. The second test
shows that the very same contracts break on a copy of ``sdp`` given an upward import inside a function and a
module cycle, so the first cannot pass for want of reading the code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(*, root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on ``root/pyproject.toml`` with ``root`` first on the path (no cache written into it)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", "--no-logo", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def broken(out: subprocess.CompletedProcess) -> str:
    """What lint-imports says about the broken contracts (the whole output when it has no such section)."""
    text = out.stdout + out.stderr
    return text[text.find("Broken contracts"):] if "Broken contracts" in text else text


def test_sdp_keeps_its_layers() -> None:
    out = lint_imports(root=REPO)
    assert out.returncode == 0, f"lint-imports exit code {out.returncode}:\n{broken(out)}"
    assert "Contracts: 2 kept, 0 broken." in out.stdout, out.stdout


def test_the_contracts_break_on_an_upward_import_and_a_module_cycle(tmp_path: Path) -> None:
    shutil.copytree(REPO / "sdp", tmp_path / "sdp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    loss = tmp_path / "sdp" / "core" / "loss.py"  # the bottom of the rank side reaching up into the driver, lazily
    loss.write_text(loss.read_text() + "\n\ndef _up() -> None:\n    from sdp.driver import train  # noqa: F401\n")
    rng = tmp_path / "sdp" / "rank" / "rng.py"  # the worker imports rng; rng importing the worker back is a cycle
    rng.write_text(rng.read_text() + "\n\ndef _back() -> None:\n    from sdp.rank import worker  # noqa: F401\n")
    out = lint_imports(root=tmp_path)
    text = broken(out)
    assert out.returncode == 1 and "Contracts: 0 kept, 2 broken." in out.stdout, f"exit code {out.returncode}:\n{text}"
    assert "sdp.core is not allowed to import sdp.driver" in text and "sdp.core.loss -> sdp.driver.train" in text, text
    assert "No cycles are allowed in sdp.rank" in text, text
