"""sdp-bench memory-anchor's checks (sdp/bench/memory_anchor.py): the 8 -> 128 GPU difference against the published
one, and the bracket of the published peak by the plans with and without activation checkpointing."""

from __future__ import annotations

from sdp.bench.memory_anchor import AC, PUBLISHED, TOLERANCE, checks, render


def grid(*, state: dict[int, float], activations: dict[str, float]) -> dict[int, dict[str, dict[str, float]]]:
    return {w: {a: {"train_peak_gib": state[w] + activations[a], "model_state_gib": state[w]} for a in AC} for w in state}


ACT = {"none": 130.0, "every 2nd block": 79.0, "every block": 28.0, "op": 60.0}


def test_a_difference_within_tolerance_passes_and_one_outside_fails() -> None:
    pub = PUBLISHED[8] - PUBLISHED[128]
    ok = checks(grid(state={8: 1.0 + pub * (1 - TOLERANCE / 2), 128: 1.0}, activations=ACT))
    assert ok["difference_ok"] and all(abs(r - (1 - TOLERANCE / 2)) < 1e-9 for r in ok["ratio"].values()), ok
    bad = checks(grid(state={8: 1.0 + pub * (1 - 2 * TOLERANCE), 128: 1.0}, activations=ACT))
    assert not bad["difference_ok"], bad


def test_the_bracket_needs_the_published_peak_between_full_ac_and_none() -> None:
    inside = checks(grid(state={8: 15.0, 128: 1.0}, activations=ACT))
    assert inside["bracket_ok"] == {8: True, 128: True}, inside
    low = checks(grid(state={8: 15.0, 128: 1.0}, activations={**ACT, "none": 67.0}))  # none: 82 < 82.4 at 8, 68 at 128
    assert low["bracket_ok"][8] is False and low["bracket_ok"][128] is True, low
    text = render({"grid": grid(state={8: 15.0, 128: 1.0}, activations={**ACT, "none": 67.0}), "checks": low,
                   "logits_copy_gib": 7.83, "provenance": {"versions": {"git_commit": "abc"}}})
    assert "| 8 | 82.4 |" in text and "| NO |" in text and "logits: 7.8 GiB" in text, text


def test_the_absolute_figure_is_compared_at_torchtitans_setting() -> None:
    """Published / predicted with train.ac=op (torchtitan's selective op AC), per world size."""
    c = checks(grid(state={8: 15.0, 128: 1.0}, activations=ACT))
    assert c["absolute_ratio"] == {w: PUBLISHED[w] / ({8: 15.0, 128: 1.0}[w] + ACT["op"]) for w in PUBLISHED}, c
