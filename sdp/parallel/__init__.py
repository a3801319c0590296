"""Parallel strategies, one small module each, all registered in ``STRATEGIES``.

``STRATEGIES`` maps ``parallelism.name`` to a :class:`~sdp.parallel.spec.StrategySpec` (what the driver
asks), whose ``runtime`` is the :class:`~sdp.parallel.base.Strategy` each rank runs. Importing this
package imports every strategy module in it, so adding a strategy is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil

from sdp.parallel.base import StepResult, Strategy
from sdp.core.distctx import DistContext
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import STRATEGIES, Coverage, StrategySpec, register

for _info in pkgutil.iter_modules(__path__):
    if _info.name not in ("base", "job", "spec") and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["STRATEGIES", "Coverage", "DistContext", "JobFacts", "StepResult", "Strategy", "StrategySpec", "register"]
