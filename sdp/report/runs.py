"""Reading a sweep's run directories (the results contract of :mod:`sdp.results.contract`) into :class:`Run`\\ s.

A run directory is any directory below the sweep with a ``config.yaml`` (Hydra's own copies under
``.hydra/`` are skipped). ``summary.json`` may be missing: the run failed or has not finished; such
runs are kept, flagged, and reported, never averaged. The per-run figures every report needs (final
losses, model-state and peak memory and comm bytes on the rank where each is largest, step time,
FLOPs) are extracted in one place, :func:`run_figures`, shared by the paper tables and the
measurement report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sdp.results.contract import read_metrics
from sdp.results.rundir import CONFIG, RANK_LOGS, RunDir
from sdp.results.summary import Summary, read_summary

SKIP_DIRS = (RANK_LOGS, "wandb", "report")  # "report": sdp-report's default output below a sweep


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; lists are kept as values (a list is one setting)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def _natural(path: Path) -> list[Any]:
    """Sort key so job 10 comes after job 9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


@dataclass
class Run:
    """One run directory: its config (nested and flat), Hydra overrides, summary (None if missing)."""

    path: Path
    config: dict[str, Any]
    overrides: list[str]
    summary: Summary | None
    flat: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.flat = flatten(self.config)
        if "eval.bn" not in self.flat:  # written before the evaluation protocol was one key for all strategies:
            # SDP chose its own (parallelism.bn), every other strategy averaged its running statistics
            self.flat["eval.bn"] = self.flat.pop("parallelism.bn", "average")
            self.flat["eval.bn_batches"] = self.flat.pop("parallelism.bn_batches", None)

    @property
    def ok(self) -> bool:
        return self.summary is not None

    @property
    def seed(self) -> Any:
        return self.flat.get("seed")

    def last_logged_step(self) -> int | None:
        """Last training step in metrics.jsonl (how far a failed run got)."""
        steps = [row["step"] for row in read_metrics(self.path) if "step" in row]
        return max(steps) if steps else None

    def tokens_per_sample(self) -> int | None:
        """Targets one sample trains (None: a classifier's sample, one target). The trainer's own count, recorded in
        ``summary.json`` (``time.tokens_per_sample``: a batch's targets per row, whatever the dataset); a summary
        without it (older or rebuilt) falls back to the config's ``dataset.seq_len``, which only sequence datasets
        have. One definition for every report (the gate's table, the frontier's per-token traffic)."""
        recorded = (self.summary.time or {}).get("tokens_per_sample") if self.summary else None
        if recorded:
            return int(recorded)
        seq = self.flat.get("dataset.seq_len")
        return int(seq) if seq else None

    def tokens_per_step(self) -> int | None:
        """Tokens (samples for a non-LM task) one step trains over all ranks: the trainer's recorded global batch
        (``summary.global_batch``) x :meth:`tokens_per_sample`; a run without a summary falls back to the config's
        ``train.batch_size`` x ``cluster.world_size`` (None where the config does not say either)."""
        batch = self.summary.global_batch if self.summary else None
        if batch is None:
            f = self.flat
            if f.get("train.batch_size") is None or f.get("cluster.world_size") is None:
                return None
            batch = int(f["train.batch_size"]) * int(f["cluster.world_size"])
        return int(batch) * (self.tokens_per_sample() or 1)

    def status(self) -> str:
        """``ok`` or a one-line reason, e.g. ``no summary.json (failed or unfinished; last step 3 of 10)``."""
        if self.ok:
            return "ok"
        last = self.last_logged_step()
        planned = self.flat.get("train.steps")
        where = "nothing logged" if last is None else f"last logged step {last} of {planned}"
        return f"no summary.json (failed or unfinished; {where})"


def load_run(path: Path) -> Run:
    """Read one run directory; a malformed summary.json counts as missing (and says so)."""
    paths = RunDir(Path(path))
    config = yaml.safe_load(paths.config.read_text()) or {}
    overrides_file = paths.hydra_overrides
    overrides = list(yaml.safe_load(overrides_file.read_text()) or []) if overrides_file.exists() else []
    return Run(path=paths.root, config=config, overrides=overrides, summary=read_summary(paths))


def run_dirs(sweep_dir: Path) -> list[Path]:
    """The paths of every run directory below ``sweep_dir`` (or ``sweep_dir`` itself if it is one), in job
    order: what :func:`find_runs` reads and ``sdp-bench slim-runs`` slims, found by the same rule."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory {sweep_dir} does not exist")
    found = []
    for cfg_file in sweep_dir.rglob(CONFIG):
        rel = cfg_file.parent.relative_to(sweep_dir).parts
        if any(p.startswith(".") or p in SKIP_DIRS for p in rel):
            continue
        found.append(cfg_file.parent)
    return sorted(found, key=_natural)


def find_runs(sweep_dir: Path) -> list[Run]:
    """Every run directory below ``sweep_dir`` (or ``sweep_dir`` itself if it is one), in job order."""
    return [load_run(p) for p in run_dirs(sweep_dir)]


def _max_over_ranks(per_rank: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in per_rank if r.get(key) is not None]
    return float(max(values)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def run_figures(summary: Summary) -> dict[str, float | None]:
    """The per-run numbers reports aggregate; every per-rank figure is taken on the rank where it is
    largest (the memory that decides whether a job fits is the fullest rank's)."""
    mem, comm, final, t = summary.memory_per_rank, summary.comm_per_rank, summary.final, summary.time
    budget = summary.budget or {}
    state = [sum(r.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optim_bytes")) for r in mem]
    grad_optim = [sum(r.get(k) or 0 for k in ("grad_bytes", "optim_bytes")) for r in mem]
    cuda_peak = _max_over_ranks(mem, "cuda_max_allocated_bytes")
    train_peak = _max_over_ranks(mem, "train_peak_bytes")
    return {
        # every evaluation figure by field (accuracies in percent); None where a run did not measure it (absent, not 0)
        **final.figures(),
        "train_loss": final.train_loss,
        "model_state_bytes": float(max(state)) if state else None,
        "param_bytes": _max_over_ranks(mem, "param_bytes"),
        "grad_optim_bytes": float(max(grad_optim)) if grad_optim else None,  # what SDP's masking shrinks
        "model_state_mean_bytes": _mean(state),  # the fullest rank's floor under any assignment
        "train_peak_bytes": train_peak,  # the measured steps' peak per rank, where the run records it
        # The measured steps' peak (live tensors on CPU, the allocator on CUDA); older runs: CUDA max or RSS.
        "peak_bytes": train_peak if train_peak is not None else (
            cuda_peak if cuda_peak is not None else _max_over_ranks(mem, "peak_rss_delta_bytes")),
        "peak_kind": f"train_peak ({mem[0].get('peak_source')})" if train_peak is not None else (
            "cuda_max_allocated" if cuda_peak is not None else "peak_rss_delta"),
        "setup_peak_bytes": _max_over_ranks(mem, "setup_peak_bytes"),
        "eval_peak_bytes": _max_over_ranks(mem, "eval_peak_bytes"),
        "peak_rss_delta_bytes": _max_over_ranks(mem, "peak_rss_delta_bytes"),
        "comm_bytes_per_step": _max_over_ranks(comm, "bytes_per_step"),
        "wire_bytes_per_step": _max_over_ranks(comm, "wire_bytes_per_step"),
        "collectives_per_step": _max_over_ranks(comm, "collectives_per_step"),
        "activation_bytes": _max_over_ranks(mem, "activation_bytes"),
        "activation_mean_bytes": _mean([r["activation_bytes"] for r in mem if r.get("activation_bytes") is not None]),
        "cuda_max_reserved_bytes": _max_over_ranks(mem, "cuda_max_reserved_bytes"),
        "eval_assembled_bytes": _max_over_ranks(mem, "eval_assembled_bytes") or _max_over_ranks(mem, "eval_full_copy_bytes"),
        "tokens_per_s": t.get("tokens_per_s"),
        "mfu": t.get("mfu"),
        "step_s": t.get("step_s_median"),
        "samples_per_s": t.get("samples_per_s"),
        "straggler_spread": t.get("straggler_spread"),
        "steps": summary.steps,
        "total_flops": budget.get("total_flops"),
    }
