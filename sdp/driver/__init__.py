"""Driver side, the first stage of a run's data flow: what runs once per job, before any rank starts.

:mod:`sdp.driver.train` is ``sdp-train``: Hydra composes the config, typed by the schemas
(:mod:`sdp.driver.schema`; each strategy's own, beside it in :mod:`sdp.parallel`) and parsed once (:mod:`sdp.driver.typed`);
:mod:`sdp.driver.config` keeps the cross-key rules and :mod:`sdp.driver.preflight` builds data, model (on meta,
once) and the strategy's prepared plan; :mod:`sdp.driver.budget` turns ``train.budget`` into steps and
:mod:`sdp.driver.checkpoint_resume` decides what ``train.resume`` continues; :mod:`sdp.driver.launch` then starts
the ranks locally, under an external launcher (read by :mod:`sdp.rank.rankenv`) or on Slurm
(:mod:`sdp.driver.slurm`); sweeps (:mod:`sdp.driver.sweep`) and re-runs of a recorded run (:mod:`sdp.driver.rerun`)
go through the same path. It imports the rank side (:mod:`sdp.rank`) and everything below it, never the commands
above it (:mod:`sdp.report`, :mod:`sdp.planning`, :mod:`sdp.bench`).
"""
