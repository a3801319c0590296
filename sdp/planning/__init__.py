"""Planning: what a run will cost, predicted before launch from the same config.

``sdp-plan`` (:mod:`sdp.planning.planner`) prints per-rank memory, communication and step time
(:mod:`sdp.planning.throughput`). The command only: each strategy makes its own prediction beside its code, with the
rules they share (:mod:`sdp.parallel.plan_entries`, the peak rehearsal :mod:`sdp.parallel.plan_peaks`), and the
step budget it resolves as the driver does (:mod:`sdp.driver.budget`).
"""
