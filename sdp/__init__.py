"""sdp: a Hydra benchmark suite for Subnetwork Data Parallelism (arXiv 2507.09029).

Layout: ``sdp.train`` (Hydra entry point, composes and validates once, then launches ranks),
``sdp.launch`` (torch elastic / external launchers), ``sdp.worker`` (what each rank runs),
``sdp.trainer`` (strategy-agnostic loop), ``sdp.parallel`` (one module per strategy behind one
registry), ``sdp.subnet`` (coverage plan, masking, owner-set sync), ``sdp.models``, ``sdp.data``,
``sdp.metrics`` (memory, communication, time) and the results contract: ``sdp.results`` (config.yaml,
metrics.jsonl), ``sdp.summary`` (summary.json, typed) and ``sdp.rundir`` (every path of a run directory).
"""

__version__ = "0.1.0"
