"""One evaluation's figures, typed: what :meth:`sdp.rank.trainer.Trainer.evaluate` returns, what the summary's
``final`` embeds (:class:`sdp.results.summary.Final` is an :class:`EvalResult` plus the training loss) and
what the report reads by field.

Why one dataclass: a figure of the evaluation used to be carried as loose dict keys, named again by the
trainer's row, the worker's copy into ``Final``, the report's per-run figures, its aggregated metrics and its
table columns (about six edits per new metric). Now a metric is two edits: its field here (with
:func:`metric`'s metadata saying whether and how the report's table shows it) and its computation in
:func:`sdp.rank.evaluation.result`. Everything else enumerates the fields: the metrics row (:meth:`EvalResult.row`),
summary.json's ``final``, the report's figures (:meth:`EvalResult.figures`), the aggregated metrics and the
table's columns (:func:`columns`). ``tests/test_evalresult.py`` adds a field and its computation and nothing else,
and finds it in summary.json and in the report's table and CSV.

Older records keep loading: a field a recorded summary or checkpoint lacks reads as its default (None: not
measured), the one table of defaults being the fields' own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


def metric(*, column: str | None = None, digits: int = 4, percent: bool = False, always: bool = False,
           lead: bool = False) -> Any:
    """A figure of :class:`EvalResult` (None where not measured). ``column``: its header in the report's table
    (None: recorded in summary.json and metrics.jsonl, not aggregated nor shown), ``digits`` after the point
    there; ``percent``: a fraction the report shows x 100; ``always``: written to every metrics row even as
    None (the figures every evaluation has a place for), where the others are written only when measured;
    ``lead``: its column comes first in the table (the paper's headline figure), the rest follow in field order."""
    return field(default=None, metadata={"column": column, "digits": digits, "percent": percent, "always": always,
                                         "lead": lead})


@dataclass
class EvalResult:
    """One evaluation under the run's protocol (``Summary.eval_protocol``). Field order is summary.json's and the
    metrics row's key order; the table's columns follow it, a ``lead`` field first."""

    eval_loss: float | None = metric(column="eval loss", always=True)
    """Eval loss of the evaluated (assembled) model on the whole validation set."""
    eval_accuracy: float | None = metric(column="eval acc (%)", digits=2, percent=True, always=True, lead=True)
    """Top-1 accuracy as a fraction (classification only)."""
    eval_loss_workers: float | None = metric(column="workers' own eval loss")
    """``eval.subnetworks`` (forward-masked SDP): mean over workers of each one's own subnetwork's eval loss."""
    eval_accuracy_workers: float | None = metric(percent=True)
    """Same, accuracy."""
    assembly_gap: float | None = metric(column="assembly gap")
    """``eval_loss`` of the assembled model minus ``eval_loss_workers``."""
    eval_loss_ensemble: float | None = metric(column="workers' ensemble eval loss")
    """``eval.ensemble`` (forward-masked SDP): eval loss of the workers' subnetworks' ensemble, the cross-entropy
    of the mean of their predicted probabilities (:mod:`sdp.rank.eval_ensemble`); None where not evaluated (older
    runs, strategies whose workers train one model)."""
    eval_accuracy_ensemble: float | None = metric(percent=True)
    """Same, accuracy (arg-max of the mean probability)."""
    eval_loss_by_group: dict[str, Any] | None = metric()
    """Where the dataset declares evaluation groups (:class:`sdp.data.base.EvalGroups`: automaton's ``k``, pointer's
    ``lookups``): ``{"name": .., "loss": {label: mean loss of the group's scored targets}, "count": {label: scored
    targets}}`` of the evaluated model (whole or part by part), and with ``eval.subnetworks`` ``"workers"``: {label:
    the workers' mean of their own subnetworks' group loss}; a group without a scored target's loss is None. The
    counts weight the groups' losses back to ``eval_loss``. Not a table column (a report reads it by name,
    :mod:`sdp.bench.gate_groups`); None for a dataset without groups and in older runs."""

    @classmethod
    def of(cls, obj: Mapping[str, Any] | None) -> Any:
        """The fields of ``cls`` found in ``obj`` (a metrics row, a checkpoint's last evaluation); the rest default."""
        obj = obj or {}
        return cls(**{f.name: obj[f.name] for f in fields(cls) if f.name in obj})

    def row(self) -> dict[str, Any]:
        """The evaluation's metrics row (without its step): every measured figure, and the ``always`` ones."""
        return {f.name: getattr(self, f.name) for f in _metrics(self)
                if getattr(self, f.name) is not None or f.metadata["always"]}

    def figures(self) -> dict[str, Any]:
        """The per-run figures the report aggregates, one per field (accuracies in percent; a breakdown such as
        ``eval_loss_by_group`` as recorded)."""
        return {f.name: _shown(getattr(self, f.name), f.metadata) for f in _metrics(self)}


def _metrics(record: Any) -> list[Any]:
    """The fields of ``record`` made by :func:`metric` (a :class:`~sdp.results.summary.Final` also has others)."""
    return [f for f in fields(record) if "always" in f.metadata]


def _shown(value: Any, meta: Mapping[str, Any]) -> Any:
    return None if value is None else 100.0 * value if meta["percent"] else value


def columns() -> list[tuple[str, str, int]]:
    """(field, header, digits) of each figure the report's table shows, ``lead`` first, then in field order: what the
    report aggregates over seeds and renders (:data:`sdp.report.tables.AGGREGATED`, :data:`sdp.report.render.COLUMNS`)."""
    shown = sorted((f for f in _metrics(EvalResult) if f.metadata["column"]), key=lambda f: not f.metadata["lead"])
    return [(f.name, f.metadata["column"], f.metadata["digits"]) for f in shown]
