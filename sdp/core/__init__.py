"""The bottom of the rank side: what every rank's code runs on, whichever strategy or model.

:mod:`sdp.core.distctx` (the distributed context: rank, world, device, the counted process groups, timeouts),
:mod:`sdp.core.precision` (``train.precision``: the one autocast every strategy enters) and :mod:`sdp.core.loss`
(the training and evaluation losses). It imports only the leaf packages below it (the comm counter of
:mod:`sdp.metrics`), so the subnetwork code, the strategies, the trainer and the planner's rehearsals all build on it
(the layers: ``[tool.importlinter]`` in ``pyproject.toml``).
"""
