"""Planning: what a run will cost, predicted before launch from the same config.

``sdp-plan`` (:mod:`sdp.planning.planner`) prints per-rank memory and communication; the strategies'
predictions share :mod:`sdp.planning.plan_entries` and :mod:`sdp.planning.plan_peaks` (peaks rehearsed on the
meta device); :mod:`sdp.planning.budget` turns ``train.budget`` into steps, once in the driver.
"""
