"""Results, the last stage of a run's data flow: what a run leaves in its run directory.

:mod:`sdp.results.rundir` names every path, :mod:`sdp.results.contract` writes ``config.yaml`` and reads
``metrics.jsonl`` (with the provenance every record carries), :mod:`sdp.results.summary` types
``summary.json``, :mod:`sdp.results.loggers` writes the metrics (JSONL, W&B mirror, progress). Reports
(:mod:`sdp.report`) and benchmarks (:mod:`sdp.bench`) read these files only.
"""
