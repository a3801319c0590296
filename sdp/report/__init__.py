"""Turning a sweep's run directories into the paper's tables (``sdp-report``, and a Hydra callback at
the end of every multirun). Reads only the results contract (:mod:`sdp.results`); W&B is a mirror."""

from sdp.report.build import Report, make_report
from sdp.report.runs import Run, find_runs, load_run, run_figures

__all__ = ["Report", "Run", "find_runs", "load_run", "make_report", "run_figures"]
