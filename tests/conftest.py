"""Test tiers and the shared fixtures; the harness itself is the package :mod:`tests.helpers`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.jobs import TrainProcess, run_train


@pytest.fixture
def train_job(tmp_path: Path):
    """Factory fixture: ``train_job("parallelism=ddp", ...)`` runs a job into a fresh tmp dir."""
    counter = iter(range(1000))

    def make(*overrides: str, **kw) -> TrainProcess:
        return run_train(tmp_path / f"run{next(counter)}", *overrides, **kw)

    return make


# ---- test tiers ----------------------------------------------------------------------------------
# The multi-rank (``dist``) tests CI runs on every submission carry ``pytest.mark.core`` (``CORE`` and
# ``core_cases`` in tests/helpers/marks.py): the backbone of each part, equivalence of every strategy
# family with DDP or a single-process reference, SDP's masking and comm accounting, fail-fast, resume,
# the NaN guard, the planner and the multirun report. Every other ``dist`` test is in the slow tier
# (more ranks, more presets of the same property), run with ``pytest --runslow``; on 2 shared CPU cores
# the whole multi-rank set takes far longer than a CI run may.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the slow tier (every multi-rank test without the core mark; see tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection: `-m "not slow"` selects the default tier
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_all = config.getoption("--runslow")
    for item in items:
        core = item.get_closest_marker("core") is not None
        if core and "dist" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: the core mark is for multi-rank (dist) tests; a fast test needs none")
        if "dist" in item.keywords and not core:
            item.add_marker(pytest.mark.slow)
        if "slow" in item.keywords and not run_all:
            item.add_marker(pytest.mark.skip(reason="slow tier: run with pytest --runslow"))
