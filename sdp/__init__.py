"""sdp: a Hydra benchmark suite for Subnetwork Data Parallelism (arXiv 2507.09029).

The packages stand in layers, each importing only from those below it (the ``layers`` contract of
``pyproject.toml``'s ``[tool.importlinter]``, checked by ``tests/test_import_graph.py``), top to bottom:
:mod:`sdp.bench` (``sdp-bench`` and the CPU studies), :mod:`sdp.planning` (``sdp-plan``), :mod:`sdp.report`
(``sdp-report``), :mod:`sdp.driver` (``sdp-train``: compose, validate, preflight, budget, resume, sweep, launch
locally, on Slurm or under an external launcher), :mod:`sdp.rank` (what each rank runs: worker, strategy-agnostic
trainer, evaluation, checkpoints, guards), :mod:`sdp.parallel` (one module per strategy behind one registry, and the
rules their predictions share), :mod:`sdp.subnet` (coverage plan, masking, owner-set sync), :mod:`sdp.core` (the
distributed context, precision, the losses), then :mod:`sdp.data`, :mod:`sdp.metrics` (memory, communication, time)
and :mod:`sdp.results` (the run directory, ``config.yaml``, ``metrics.jsonl``, ``summary.json``, loggers) side by
side, :mod:`sdp.models`, and two leaves at the root that import nothing from ``sdp``: :mod:`sdp.errors` (config
errors) and :mod:`sdp.registry` (name -> factory lookups, ``_target_`` instantiation).
"""

__version__ = "0.1.0"
