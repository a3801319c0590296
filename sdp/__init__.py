"""sdp: a Hydra benchmark suite for Subnetwork Data Parallelism (arXiv 2507.09029).

Packages in the order data flows through a run: :mod:`sdp.driver` (``sdp-train``: compose, validate,
preflight, sweep, launch locally, on Slurm or under an external launcher), :mod:`sdp.rank` (what each rank
runs: worker, strategy-agnostic trainer, evaluation, checkpoints, guards, precision), :mod:`sdp.planning`
(``sdp-plan``: memory, communication and budgets predicted before launch) and :mod:`sdp.results` (the run
directory, ``config.yaml``, ``metrics.jsonl``, ``summary.json``, loggers). Beside them: :mod:`sdp.parallel`
(one module per strategy behind one registry), :mod:`sdp.subnet` (coverage plan, masking, owner-set sync),
:mod:`sdp.models`, :mod:`sdp.data`, :mod:`sdp.metrics` (memory, communication, time), :mod:`sdp.report`
(``sdp-report``) and :mod:`sdp.bench` (``sdp-bench`` and the CPU studies). Two leaves stay at the root,
because every package uses them and they import nothing from ``sdp``: :mod:`sdp.errors` (config errors)
and :mod:`sdp.registry` (name -> factory lookups, ``_target_`` instantiation).
"""

__version__ = "0.1.0"
