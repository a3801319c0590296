"""Turning a sweep's run directories into the paper's tables (``sdp-report``, and a Hydra callback at
the end of every multirun). Reads only the results contract (:mod:`sdp.results.contract`); W&B is a mirror."""
