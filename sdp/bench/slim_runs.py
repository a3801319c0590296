"""``sdp-bench slim-runs PATH...``: make committed run directories lighter, keeping what is read back.

    sdp-bench slim-runs benchmarks/results            # every run directory below, in place
    sdp-bench slim-runs benchmarks/results --dry-run  # what it would do

Why: a committed study keeps its runs so that the report can be written again from them
(``--render-only``, ``sdp-report``), ``sdp-rerun`` can run one again and a re-run of the study
(``train.skip_done=true``) skips them; each of those reads ``config.yaml``, ``summary.json`` and the
metrics rows (:func:`sdp.results.contract.read_metrics`), nothing else. The rest a run directory holds is
either a log no report reads or a copy of what those files hold, so in a run directory (found by the
report's own rule, :func:`sdp.report.runs.run_dirs`) this

- removes ``rank_logs/`` (torch elastic's per-rank output), ``.hydra/`` (Hydra's copy of the config
  and the command line; ``config.yaml`` is the resolved one every reader uses), the ``*.log`` files
  (Hydra's job log), ``wandb/`` and ``wandb_run_id`` (the W&B mirror; reports read the run directory);
- removes ``plan.json`` when its ``summary`` is ``summary.json``'s ``strategy_info.plan`` (``sdp-plan``
  with the run's ``config.yaml`` writes the whole file again), and keeps it otherwise;
- compresses ``metrics.jsonl`` into ``metrics.jsonl.gz`` (gzip without a time stamp, so the same rows
  give the same bytes), which every reader reads through :func:`sdp.results.contract.read_metrics`.

``config.yaml`` and ``summary.json`` are never touched, so ``train.skip_done`` still finds the run
complete under the same config. ``final/`` (the final weights of a run with ``train.save_final``) and
``diagnosis.json`` are kept: ``sdp-bench diagnose`` reads the one (with ``config.yaml``; the plan is in
``final/meta.json``, so ``plan.json`` may go) and writes the other. A run directory without a complete ``summary.json`` (failed or
unfinished: a re-run resumes or restarts it) or holding ``checkpoints/`` (a resume or
``train.extend_steps`` reads them and appends to ``metrics.jsonl``) is left as it is. Running it
again changes nothing: each step is done only where its input is still there.
"""

from __future__ import annotations

import gzip
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sdp.bench.runs import parser
from sdp.report.runs import run_dirs
from sdp.results.rundir import RANK_LOGS, WANDB_RUN_ID, RunDir
from sdp.results.summary import read_json

DROPPED_DIRS = (RANK_LOGS, ".hydra", "wandb")  # read by no report, rerun or skip_done
DROPPED_FILES = (WANDB_RUN_ID,)
DROPPED_GLOBS = ("*.log",)


@dataclass
class Slimmed:
    """What :func:`slim_run` did (or, under ``dry_run``, would do) to one run directory."""

    path: Path
    removed: list[str] = field(default_factory=list)
    compressed: bool = False
    left: str | None = None  # why the directory was left as it is
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.removed) or self.compressed


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files below ``path`` (links not followed)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def pack(data: bytes) -> bytes:
    """gzip of ``data`` with no time stamp or file name: the same rows always give the same bytes."""
    return gzip.compress(data, compresslevel=9, mtime=0)


def plan_is_copy(*, paths: RunDir, summary: dict) -> bool:
    """Whether ``plan.json``'s summary is what ``summary.json`` records as the strategy's plan."""
    plan = read_json(paths.plan)
    recorded = (summary.get("strategy_info") or {}).get("plan")
    return plan is not None and recorded is not None and plan.get("summary") == recorded


def why_left(*, paths: RunDir, summary: dict | None) -> str | None:
    """The reason a run directory must stay as it is, or None when it may be slimmed."""
    if summary is None or "final" not in summary:  # sdp.driver.sweep.complete_summary's rule
        return "no complete summary.json (failed or unfinished: a re-run resumes or restarts it)"
    if paths.checkpoints.is_dir() and any(paths.checkpoints.iterdir()):
        return "holds checkpoints/ (a resume or train.extend_steps reads them and appends to metrics.jsonl)"
    return None


def slim_run(run_dir: Path, *, dry_run: bool = False) -> Slimmed:
    """Slim one run directory (module docstring); idempotent."""
    paths = RunDir(run_dir)
    summary = read_json(paths.summary)
    done = Slimmed(path=paths.root, bytes_before=tree_bytes(paths.root))
    done.left = why_left(paths=paths, summary=summary)
    if done.left is not None:
        done.bytes_after = done.bytes_before
        return done
    assert summary is not None
    doomed = [paths.root / d for d in DROPPED_DIRS if (paths.root / d).is_dir()]
    doomed += [paths.root / f for f in DROPPED_FILES if (paths.root / f).is_file()]
    doomed += sorted(p for g in DROPPED_GLOBS for p in paths.root.glob(g) if p.is_file())
    if paths.plan.is_file() and plan_is_copy(paths=paths, summary=summary):
        doomed.append(paths.plan)
    saved = sum(tree_bytes(p) if p.is_dir() else p.stat().st_size for p in doomed)
    done.removed = [p.name + ("/" if p.is_dir() else "") for p in doomed]
    if paths.metrics.is_file():
        raw = paths.metrics.read_bytes()
        packed = pack(raw)
        assert gzip.decompress(packed) == raw, f"{paths.metrics}: gzip round trip differs"
        done.compressed = True
        saved += len(raw) - len(packed)
        if not dry_run:
            tmp = paths.metrics_gz.with_name(paths.metrics_gz.name + ".tmp")
            tmp.write_bytes(packed)
            os.replace(tmp, paths.metrics_gz)  # a stale .gz (an interrupted earlier slim) is replaced
            paths.metrics.unlink()
    if not dry_run:
        for p in doomed:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    done.bytes_after = done.bytes_before - saved
    return done


def slim(paths: list[Path], *, dry_run: bool = False) -> list[Slimmed]:
    """Slim every run directory below each of ``paths`` (each path: a run directory or any folder above some)."""
    return [slim_run(d, dry_run=dry_run) for p in paths for d in run_dirs(p)]


def describe(results: list[Slimmed], *, dry_run: bool) -> str:
    """One line per run directory changed or left as is, then the totals."""
    verb = "would slim" if dry_run else "slimmed"
    lines = []
    for r in results:
        if r.left is not None:
            lines.append(f"left as is: {r.path}: {r.left}")
        elif r.changed:
            what = r.removed + (["metrics.jsonl -> metrics.jsonl.gz"] if r.compressed else [])
            lines.append(f"{verb}: {r.path}: {', '.join(what)}")
    changed = sum(r.changed for r in results)
    left = sum(r.left is not None for r in results)
    before, after = sum(r.bytes_before for r in results), sum(r.bytes_after for r in results)
    lines.append(f"{len(results)} run directories: {changed} {verb}, {len(results) - changed - left} already slim, "
                 f"{left} left as is; {before} -> {after} bytes")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser(suite="slim-runs", doc=__doc__)
    ap.add_argument("paths", nargs="+", type=Path, help="run directories, or folders above them (e.g. benchmarks/results)")
    ap.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.is_dir()]
    if missing:
        raise SystemExit(f"sdp-bench slim-runs: PATH={missing} is invalid: no such directory; allowed: existing "
                         f"run directories or folders above them")
    results = slim(args.paths, dry_run=args.dry_run)
    print(describe(results, dry_run=args.dry_run), flush=True)
    return 0

