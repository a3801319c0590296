"""Old name of the harness, kept only so that tests written against it before tests/helpers/ keep
working through a merge; new tests import :mod:`tests.helpers` (keyword ``run_dir=``, ``world=``, ``args=``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from tests.helpers import batch, compose, config_dict, make_strategy  # noqa: F401 (re-exported)
from tests.helpers import run_job as _run_job
from tests.helpers import spawn as _spawn


def run_job(overrides: list[str], run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return _run_job(overrides, run_dir=run_dir)


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240) -> list[Any]:
    return _spawn(fn, world=world_size, args=args, timeout_s=timeout_s)
