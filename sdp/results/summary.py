"""``summary.json``, typed: what rank 0 writes at the end of a run and every report reads back.

The worker (:func:`sdp.rank.worker.collect_summary`) fills one :class:`Summary`; the report
(:mod:`sdp.report`), :func:`format_summary` (the digest ``sdp-train`` prints) and the benchmarks read
it through :func:`read_summary`, never the JSON by hand. Why typed: the file is the results contract
(reports are re-rendered from committed runs years later), so its fields are documented once, here.

Backward compatible both ways: the JSON keeps the shape it always had (the per-rank sections are
``{"memory": {"per_rank": [...]}}``; :meth:`Summary.to_json` of a summary read from a current file
gives that file back key for key), and a field an older run did not record reads as None (or empty).
Keys this module does not know are kept in ``extra`` and written back after the known ones, so a
newer run read by older code loses nothing. The per-rank records and the ``time`` section stay plain
dicts: their keys come from the measuring modules (:mod:`sdp.metrics`), listed below with each field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sdp.results.contract import write_json
from sdp.results.evalresult import EvalResult
from sdp.results.rundir import RunDir

PER_RANK = "per_rank"


@dataclass
class Final(EvalResult):
    """The run's final figures (``final`` in the JSON): its last evaluation (every :class:`EvalResult` field, under
    the run's protocol, ``Summary.eval_protocol``) and the last step's training loss; None where not measured (no
    accuracy for an LM, a figure an older run did not record)."""

    train_loss: float | None = None
    """Training loss of the last step (rank 0's, before the step's update)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of ``final`` not listed above (written back after them)."""

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> Final:
        return cls(**_split(cls, obj or {}))

    def to_json(self) -> dict[str, Any]:
        out = _join(self)
        return {"train_loss": out.pop("train_loss"), **out}  # first, as the file always had it


def _per_rank(name: str) -> Any:
    """A field holding ``<name>.per_rank`` of the JSON (one record per rank, in rank order)."""
    return field(default_factory=list, metadata={"json": name})


@dataclass
class Summary:
    """Every field of ``summary.json``, in the order the file has them."""

    strategy: str | None = None
    """``parallelism.name``."""
    label: str | None = None
    """The method's name in reports (:meth:`sdp.parallel.spec.StrategySpec.method_label`); None in older runs."""
    coverage: dict[str, Any] | None = None
    """The strategy's coverage (:class:`sdp.parallel.spec.Coverage` as a dict: key, symbol, value,
    realised fraction), or None for a strategy without one and in older runs."""
    model: str | None = None
    """``model.name``."""
    dataset: str | None = None
    """``dataset.name``."""
    world_size: int | None = None
    steps: int | None = None
    """Optimizer steps trained (the resolved ``train.steps``)."""
    skipped_steps: int | None = None
    """Steps whose update was skipped (non-finite loss guard)."""
    global_batch: int | None = None
    seed: int | None = None
    precision: str | None = None
    """``train.precision``: fp32 | bf16 (autocast forward, fp32 master weights)."""
    dataset_notes: list[str] = field(default_factory=list)
    """What the dataset wants said, e.g. files loaded without their checksum check."""
    data: dict[str, Any] | None = None
    """How much data the run had: ``train_samples``, ``val_samples``, ``train_tokens``, ``val_tokens``."""
    final: Final = field(default_factory=Final)
    eval_protocol: dict[str, Any] | None = None
    """How ``final.eval_*`` were obtained (:func:`sdp.rank.evaluation.protocol`)."""
    memory_per_rank: list[dict[str, Any]] = _per_rank("memory")
    """``memory.per_rank``: ``rank``, the strategy's ``param_bytes``/``grad_bytes``/``optim_bytes``,
    ``activation_bytes``, the tracker's ``setup|train|eval_peak_bytes``, ``peak_source``,
    ``peak_categories``, ``peak_rss_delta_bytes``, ``eval_assembled_bytes`` (older runs:
    ``eval_full_copy_bytes``), ``param_digest``, ``cuda_max_allocated_bytes`` / ``cuda_max_reserved_bytes``
    on CUDA; with SDP plan re-draws ``redraw_peak_bytes`` (the largest) and ``redraw_peaks_bytes`` (each
    re-draw's peak, in order: a memory phase of its own, outside ``train_peak_bytes``)."""
    comm_per_rank: list[dict[str, Any]] = _per_rank("comm")
    """``comm.per_rank``: ``rank``, ``bytes_per_step``, ``wire_bytes_per_step``, ``collectives_per_step``,
    ``by_kind`` (:mod:`sdp.metrics.collectives`)."""
    process_groups_per_rank: list[dict[str, Any]] = _per_rank("process_groups")
    """``process_groups.per_rank``: the groups each rank created, the default one included."""
    time: dict[str, Any] = field(default_factory=dict)
    """``step_s_median`` (the slowest rank's median step), ``samples_per_s``, ``straggler_spread``
    (max/min of the rank medians), ``tokens_per_sample``, ``tokens_per_s``, ``per_rank`` (each rank's
    :class:`sdp.metrics.timing.PhaseTimer` summary: ``step_s_median``, ``phases_s_median``, host,
    device), ``warmup_steps``, ``median_of_rank_medians``, and the throughput figures of
    :func:`sdp.metrics.flops.throughput` (``flops_per_step``, ``flops_per_s``, ``mfu``, ...)."""
    launcher_per_rank: list[dict[str, Any]] = _per_rank("launcher")
    """``launcher.per_rank``: which process / task each rank was (host, pid, SLURM_* and torchrun variables)."""
    strategy_info: dict[str, Any] = field(default_factory=dict)
    """The strategy's own facts (:meth:`sdp.parallel.base.Strategy.summary_extra`), e.g. SDP's ``plan`` and
    ``redraw`` (count, the first re-draws' bytes every rank sent and received, totals ``bytes_moved`` and maxima
    ``largest_draw_bytes`` over every re-draw)."""
    versions: dict[str, Any] = field(default_factory=dict)
    """python, torch, sdp, ``git_commit``, ``git_dirty``, cuda (:func:`sdp.results.contract.versions`)."""
    machine: dict[str, Any] = field(default_factory=dict)
    """Host facts (:func:`sdp.results.contract.machine`)."""
    run_dir: str | None = None
    """Where the run wrote its outputs (:class:`sdp.results.rundir.RunDir`)."""
    budget: dict[str, Any] | None = None
    """The driver's step-count resolution (:func:`sdp.driver.budget.apply`): ``budget``, ``base_steps``,
    ``steps``, ``step_ratio``, ``flops_per_step``, ``total_flops``, ``schedule`` (each schedule key scaled
    with the steps: ``{"optim.warmup_steps": {"base": asked for, "scaled": run}, ...}``; absent in older runs), ..."""
    nodes: Any = None
    """Hosts the ranks ran on (:func:`sdp.rank.rankenv.nodes_of`)."""
    backends: dict[str, Any] | None = None
    """The numerics switches rank 0 set (:func:`sdp.rank.rankenv.set_backends`): ``device_type``, ``deterministic``,
    and on CUDA ``tf32_matmul``, ``tf32_cudnn``, ``cudnn_benchmark``, ``cudnn_deterministic`` (None on CPU);
    None in older runs."""
    rebuilt: str | None = None
    """None for a summary rank 0 wrote at the end of its run. Set (saying what is absent) where the driver rebuilt it
    from what a finished run recorded, its final checkpoint and config, because the run ended without writing one
    (:mod:`sdp.driver.finished`): what only the live ranks measured (per-rank memory, communication, time) is absent."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Top-level keys not listed above (a newer writer's, or a strategy's own): written after them."""

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Summary:
        values = _split(cls, obj)
        values["final"] = Final.from_json(obj.get("final"))
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        out = _join(self)
        out["final"] = self.final.to_json()
        return out

    def write(self, run_dir: RunDir) -> None:
        """Write ``summary.json`` atomically (a reader never sees half of it)."""
        write_json(run_dir.summary, self.to_json())


def _split(cls: type, obj: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments of dataclass ``cls`` from its JSON object; unknown keys go to ``extra``."""
    values: dict[str, Any] = {}
    known = set()
    for f in fields(cls):
        if f.name == "extra":
            continue
        key = f.metadata.get("json", f.name)
        known.add(key)
        if key in obj:
            values[f.name] = (obj[key] or {}).get(PER_RANK, []) if "json" in f.metadata else obj[key]
    values["extra"] = {k: v for k, v in obj.items() if k not in known}
    return values


def _join(record: Any) -> dict[str, Any]:
    """The JSON object of ``record`` (the inverse of :func:`_split`)."""
    out: dict[str, Any] = {}
    for f in fields(record):
        if f.name == "extra":
            continue
        value = getattr(record, f.name)
        out[f.metadata["json"] if "json" in f.metadata else f.name] = {PER_RANK: value} if "json" in f.metadata else value
    out.update(record.extra)
    return out


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing, half-written or not an object."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_summary(run_dir: Path | RunDir) -> Summary | None:
    """The run's summary; None when the run has none (failed, unfinished) or it cannot be read."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    obj = read_json(rd.summary)
    return None if obj is None else Summary.from_json(obj)


def format_summary(summary: Summary) -> str:
    """A short human-readable digest of a summary, printed at the end of a run; a figure the summary lacks
    (a rebuilt summary's measurements, an older run's fields) reads ``n/a``."""
    f, t = summary.final, summary.time

    def num(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    def mib(b: float | None) -> str:
        return "n/a" if b is None else f"{b / 2**20:.2f} MiB"

    lines = [
        f"strategy={summary.strategy} model={summary.model} dataset={summary.dataset} "
        f"world_size={summary.world_size} steps={summary.steps} global_batch={summary.global_batch}",
        f"final train_loss={num(f.train_loss, '.4f')} eval_loss={num(f.eval_loss, '.4f')} "
        f"eval_accuracy={num(f.eval_accuracy, '.4f')}",
        f"time step_s_median={num(t.get('step_s_median'), '.4f')} samples_per_s={num(t.get('samples_per_s'), '.1f')} "
        f"straggler_spread={num(t.get('straggler_spread'), '.3f')}"
        + (f" tokens_per_s={t['tokens_per_s']:.0f}" if t.get("tokens_per_s") else "")
        + (f" mfu={t['mfu']:.3f}" if t.get("mfu") is not None else ""),
    ]
    for m, c in zip(summary.memory_per_rank, summary.comm_per_rank):
        lines.append(
            f"rank {m['rank']}: params {mib(m['param_bytes'])} grads {mib(m['grad_bytes'])} "
            f"optim {mib(m['optim_bytes'])} activations {mib(m.get('activation_bytes'))} "
            f"peaks setup/train/eval {mib(m.get('setup_peak_bytes'))}/{mib(m.get('train_peak_bytes'))}/"
            f"{mib(m.get('eval_peak_bytes'))} peak_rss_delta {mib(m['peak_rss_delta_bytes'])} | "
            f"comm {mib(c['bytes_per_step'])}/step in {c['collectives_per_step']:.1f} collectives"
        )
    cal = (summary.strategy_info or {}).get("calibrate")
    if cal:  # SDP's assembly calibration: the final evaluation is of the model with its gates folded in
        peaks = "/".join(mib(m.get("calibrate_peak_bytes")) for m in summary.memory_per_rank)
        lines.append(f"calibrate: {cal['steps']} steps lr {cal['lr']:g}, loss {num(cal['losses'][0], '.4f')} -> "
                     f"{num(cal['losses'][-1], '.4f')}, gates from {cal['init']:g} folded into the weights (evaluated "
                     f"without rescale), peak per rank {peaks}")
    b = summary.budget or {}
    if b:
        lines.append(f"budget={b['budget']} steps={b['steps']} (base {b['base_steps']}, ratio {b['step_ratio']:.3g}) "
                     f"total_flops={num(b.get('total_flops'), '.3e')}")
    lines.extend(f"note: {n}" for n in summary.dataset_notes)
    if summary.rebuilt:
        lines.append(f"note: {summary.rebuilt}")
    lines.append(f"results: {summary.run_dir}")
    return "\n".join(lines)
