"""Parallel strategies, one small module each, all registered in ``STRATEGIES``.

Importing this package imports every strategy module in it, so adding a strategy is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil

from sdp.parallel.base import STRATEGIES, DistContext, StepResult, Strategy, register

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base" and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["STRATEGIES", "DistContext", "StepResult", "Strategy", "register"]
