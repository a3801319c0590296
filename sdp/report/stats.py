"""What a comparison between methods needs beyond mean ± std: paired differences with intervals, and
the time each method takes to reach the reference's quality.

Why paired: every method of one seed shares the initial weights and the data order (the seed fixes
both), so the seed-to-seed spread, often larger than the differences in question, cancels in the
per-seed difference. The interval is the 95 % Student t interval of the mean difference with
n - 1 degrees of freedom; a difference whose interval contains 0 is *not resolved* and is reported so.

Time to target: the first evaluation at which a run's eval loss is at most the reference row's mean
final eval loss times ``TARGET_FACTOR``, as a step and as the wall seconds of the training steps up
to it (summed from metrics.jsonl's ``step_s``; a row logged every N steps stands for those N steps).
A run whose evaluations never reach it is "not reached"; the resolution is ``train.eval_every``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from scipy.stats import t as student_t

from sdp.results.contract import read_metrics

CONFIDENCE = 0.95
TARGET_FACTOR = 1.02
PAIRED_METRICS = ("eval_loss", "eval_accuracy")


@dataclass(frozen=True)
class Paired:
    """Mean of per-seed differences (ours - reference) with its 95 % half-width over ``n`` seeds."""

    mean: float | None
    half_width: float | None  # None with fewer than 2 pairs: no interval, so never resolved
    n: int

    @property
    def resolved(self) -> bool:
        return self.mean is not None and self.half_width is not None and abs(self.mean) > self.half_width


def t_half_width(values: list[float], *, confidence: float = CONFIDENCE) -> float | None:
    """Half-width of the Student t interval of the mean of ``values`` (n - 1 degrees of freedom)."""
    n = len(values)
    if n < 2:
        return None
    q = float(student_t.ppf(0.5 + confidence / 2, n - 1))
    return q * statistics.stdev(values) / math.sqrt(n)


def paired_difference(ours: dict[Any, float | None], reference: dict[Any, float | None]) -> Paired:
    """Differences over the seeds present (with a value) in both ``ours`` and ``reference``."""
    diffs = [float(ours[s]) - float(reference[s]) for s in ours
             if s in reference and ours[s] is not None and reference[s] is not None]
    if not diffs:
        return Paired(None, None, 0)
    return Paired(statistics.fmean(diffs), t_half_width(diffs), len(diffs))


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``: every "x DDP" figure of the reports (tables, the study, the benchmarks).
    None when either is missing or the reference is 0: a ratio to nothing measured is absent, not 0."""
    return None if value is None or not reference else value / reference


def time_to_target(rows: list[dict[str, Any]], *, target: float) -> tuple[int | None, float | None]:
    """(step, wall seconds) of the first evaluation with ``eval_loss <= target`` in metrics rows."""
    seconds, last_step = 0.0, 0
    for row in rows:
        step = row.get("step")
        if step is None:
            continue
        if row.get("step_s") is not None and step > last_step:
            seconds += float(row["step_s"]) * (step - last_step)
            last_step = step
        if row.get("eval_loss") is not None and float(row["eval_loss"]) <= target:
            return int(step), seconds
    return None, None


def run_time_to_target(path: Any, *, target: float) -> tuple[int | None, float | None]:
    return time_to_target(read_metrics(path), target=target)


def seeds_needed(p: Paired, goal: float, *, most: int = 1000) -> str:
    """``about N``: the smallest n whose 95 % half-width t(n-1) x sd / sqrt(n) is within ``goal``, at the observed
    sd of the paired differences (sd recovered from the half-width of the n seeds run); ``more than <most>``."""
    sd = p.half_width * math.sqrt(p.n) / float(student_t.ppf(0.5 + CONFIDENCE / 2, p.n - 1))
    for n in range(2, most + 1):
        if float(student_t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * sd / math.sqrt(n) <= goal:
            return f"about {n}"
    return f"more than {most}"
