"""The bottom of the rank side, and how a typed key is declared: what every rank's code runs on, whichever
strategy or model.

:mod:`sdp.core.distctx` (the distributed context: rank, world, device, the counted process groups, timeouts),
:mod:`sdp.core.precision` (``train.precision``: the one autocast every strategy enters), :mod:`sdp.core.loss`
(the training and evaluation losses) and :mod:`sdp.core.fields` (how a typed config key is declared and checked, so
a strategy in ``sdp/parallel`` declares its own schema without importing the driver). It imports only the leaf
packages below it (the comm counter of :mod:`sdp.metrics`), so the subnetwork code, the strategies, the trainer and
the planner's rehearsals all build on it (the layers: ``[tool.importlinter]`` in ``pyproject.toml``).
"""
