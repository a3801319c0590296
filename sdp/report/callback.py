"""Hydra callback: at the end of every multirun, build the sweep's tables and print them.

Registered in ``conf/config.yaml`` under ``hydra.callbacks.report``. Single runs are untouched (only
the multirun hooks are implemented). With ``compare: true`` (``experiment=compare``, the README's first
command) it prints one table of ratios to DDP instead (:mod:`sdp.report.compare`), writes it
and the plots next to the full report, and prints where each file is. When a job fails, Hydra's sweeper raises before
``on_multirun_end``; the tables are then built at interpreter exit instead, so the failed run is
reported in them rather than the whole table being lost. With W&B on (online or offline: ``logger.wandb.mode``,
else ``WANDB_MODE``, :func:`sdp.results.loggers.wandb_mode`) each table is also logged as a ``wandb.Table`` in the sweep's W&B group: best effort, a W&B
problem never fails the sweep (the files under ``<sweep>/report`` are the record).
"""

from __future__ import annotations

import atexit
import warnings
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from sdp.results.loggers import wandb_mode


class ReportCallback(Callback):
    def __init__(self, *, out: str | None = None, print_tables: bool = True, compare: bool = False) -> None:
        self.out = out
        self.print_tables = print_tables
        self.compare = compare
        self._sweep_dir: Path | None = None
        self._done = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        atexit.register(self._after_aborted_sweep)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        report = self._build(sweep_dir)
        if report is not None:
            log_to_wandb(report=report, wandb_cfg=config.get("logger", {}).get("wandb"), sweep_dir=sweep_dir)

    def _after_aborted_sweep(self) -> None:
        if not self._done and self._sweep_dir is not None and self._sweep_dir.exists():
            print("sdp-report: the sweep stopped early; tables of what ran:", flush=True)
            self._build(self._sweep_dir)

    def _build(self, sweep_dir: Path) -> Any:
        from sdp.report.build import make_report

        self._done = True
        try:
            report = make_report(sweep_dir=sweep_dir, out_dir=Path(self.out) if self.out else None)
        except Exception as exc:  # noqa: BLE001 - a report problem must not turn finished runs into a failure
            warnings.warn(f"sdp-report could not build the tables of {sweep_dir}: {type(exc).__name__}: {exc}")
            return None
        if self.compare:
            from sdp.report.build import print_comparison

            try:
                print_comparison(report)
            except Exception as exc:  # noqa: BLE001 - as above
                warnings.warn(f"sdp-report could not build the comparison of {sweep_dir}: {type(exc).__name__}: {exc}")
        elif self.print_tables:
            print(report.markdown, flush=True)
            print(f"tables written to {report.out_dir} (rebuild: sdp-report {sweep_dir})", flush=True)
        return report


def log_to_wandb(*, report: Any, wandb_cfg: Any, sweep_dir: Path) -> bool:
    """Log every table as a ``wandb.Table`` to a ``report`` run in the sweep's group; True if logged."""
    if wandb_cfg is None:
        return False
    mode = wandb_mode(wandb_cfg.get("mode"))  # the key, else WANDB_MODE, else offline: as the sweep's runs did
    if mode == "disabled":
        return False
    try:
        import wandb

        from sdp.report.render import records, slug

        run = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                         group=wandb_cfg.get("group") or sweep_dir.name, job_type="report", name=f"report-{sweep_dir.name}",
                         dir=str(report.out_dir), mode=mode, reinit="create_new")
        try:
            for i, table in enumerate(report.tables):
                header, rows = records(table)
                data = [[v if isinstance(v, (int, float, type(None))) else str(v) for v in row] for row in rows]
                run.log({slug(table, index=i, count=len(report.tables)): wandb.Table(columns=header, data=data)})
        finally:
            run.finish()
        return True
    except Exception as exc:  # noqa: BLE001 - W&B is a mirror
        warnings.warn(f"W&B ({mode}): the report tables were not logged: {type(exc).__name__}: {exc}")
        return False
