"""Rank side, the second stage of a run's data flow: what each rank runs once launched.

:mod:`sdp.rank.worker` joins the process group and builds data, model and strategy; :mod:`sdp.rank.trainer`
is the strategy-agnostic loop, with its clock (``schedule``: the LR, when to log, evaluate and checkpoint),
the evaluation protocol (``evaluation``, ``eval_*``), checkpoints (``checkpoint*``), per-step guards, RNG
streams, host memory and fault injection around it; ``rankenv`` reads what the launcher told the process. It
receives the config the driver (:mod:`sdp.driver`) validated, runs the strategies (:mod:`sdp.parallel`) on
:mod:`sdp.core` (distributed context, precision, the losses) and writes through :mod:`sdp.results`.
"""
