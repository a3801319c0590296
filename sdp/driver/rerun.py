"""``sdp-rerun RUN_DIR [--out DIR] [key=value ...]``: run a recorded run again from its own ``config.yaml``.

Why a command and not ``sdp-train --config-path``: ``config.yaml`` holds the *resolved* config, whose
``train.steps`` already includes the budget (a FLOP-matched SDP run records its extended step count),
so composing it again would apply the budget twice. The base step count the budget started from is in
``summary.json["budget"]["base_steps"]``; this command composes the run's config with Hydra (the same
driver, validation and launcher as ``sdp-train``), puts that base back (and the base values of the
schedule keys the budget scaled, ``budget["schedule"]``), clears ``train.resume`` (a
re-run starts fresh), and writes into a new run directory. On CPU a re-run at the same commit gives
the recorded losses bit for bit (``tests/test_rerun.py``); ``summary.json["versions"]`` says which
commit a run was made at and whether the working tree differed from it (``git_dirty``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdp.results.rundir import RunDir
from sdp.results.summary import read_summary


def rerun_argv(*, run_dir: Path, out: Path, overrides: list[str]) -> list[str]:
    """The ``sdp-train`` argument list that re-runs ``run_dir`` into ``out``."""
    run_dir = run_dir.resolve()
    paths = RunDir(run_dir)
    if not paths.config.is_file():
        raise FileNotFoundError(f"{run_dir} has no config.yaml (not a run directory)")
    args = [f"--config-path={run_dir}", "--config-name=config", f"hydra.run.dir={out.resolve()}", "train.resume=null"]
    summary = read_summary(paths)
    budget = summary.budget if summary is not None else None
    if budget and budget.get("base_steps") is not None and budget.get("budget") != "tokens":
        args.append(f"train.steps={int(budget['base_steps'])}")  # the budget re-derives the recorded steps
    for key, values in ((budget or {}).get("schedule") or {}).items():
        args.append(f"{key}={int(values['base'])}")  # and the schedule keys it scaled (sdp.driver.budget.SCALED_KEYS)
    return args + overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sdp-rerun", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (config.yaml, summary.json)")
    parser.add_argument("--out", type=Path, required=True, help="the new run directory")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides (e.g. logger.wandb.mode=disabled)")
    args, rest = parser.parse_known_args(argv)  # overrides may also follow --out
    try:
        train_args = rerun_argv(run_dir=args.run_dir, out=args.out, overrides=[*args.overrides, *rest])
    except FileNotFoundError as exc:
        sys.exit(f"sdp-rerun: {exc}")
    from sdp.driver.train import main as train_main

    sys.argv = ["sdp-train", *train_args]
    train_main()


if __name__ == "__main__":
    main()
