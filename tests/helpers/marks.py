"""Test tiers and machine conditions as marks.

- ``CORE`` (``pytest.mark.core``): a multi-rank (``dist``) test in the default tier, run on every CI
  submission; every other ``dist`` test is in the slow tier (``pytest --runslow``), see tests/conftest.py.
  On a parametrised test, ``core_cases`` marks the chosen cases only.
- ``run_if``: skip with a reason that says what this machine lacks, as Lightning's ``RunIf``.
"""

from __future__ import annotations

from typing import Any, Iterable

import pytest

CORE = pytest.mark.core


def core_cases(values: Iterable[Any], *, ids: list[str], core: set[str]) -> list[Any]:
    """``pytest.param`` per value (a tuple is one case's arguments), with the id ``ids[i]``; the cases
    whose id is in ``core`` carry ``CORE``. A ``core`` id that names no case is an error: a renamed
    case must not silently drop out of the default tier."""
    values = list(values)
    assert len(ids) == len(values), f"{len(ids)} ids for {len(values)} cases"
    unknown = sorted(set(core) - set(ids))
    assert not unknown, f"core names no such case: {unknown}; cases: {ids}"
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i, marks=[CORE] if i in core else [])
            for v, i in zip(values, ids)]


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_if(*, min_cuda_gpus: int = 0, no_cuda: bool = False) -> pytest.MarkDecorator:
    """``skipif`` this machine does not qualify, naming why: fewer than ``min_cuda_gpus`` CUDA devices,
    or (``no_cuda``) any CUDA device where the test is about its absence."""
    found = cuda_devices()
    reasons = []
    if found < min_cuda_gpus:
        reasons.append(f"needs {min_cuda_gpus} CUDA GPU(s), this machine has {found}")
    if no_cuda and found:
        reasons.append(f"needs a machine without CUDA, this one has {found} GPU(s)")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "the machine qualifies")
