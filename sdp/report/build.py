"""One call from a sweep directory to written tables: ``make_report`` (used by ``sdp-report`` and the
multirun callback), and the ``sdp-report`` command line."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from sdp.report.paper import PAPER_VALUES, attach_paper_values, claims_markdown, load_paper_values
from sdp.report.render import slug, to_markdown, write_table
from sdp.report.runs import Run, find_runs
from sdp.report.tables import DEFAULT_EXCLUDE, Table, build_tables


@dataclass
class Report:
    """What was built: the tables, the runs they came from, the markdown and the files written."""

    sweep_dir: Path
    out_dir: Path
    runs: list[Run]
    tables: list[Table]
    markdown: str
    files: list[Path]


def _failed_section(runs: list[Run]) -> str:
    bad = [r for r in runs if not r.ok]
    if not bad:
        return ""
    lines = [f"Runs without results ({len(bad)} of {len(runs)}; reported, not averaged):", ""]
    lines += [f"- {r.path}: seed {r.seed}, {r.status()}" for r in bad]
    return "\n".join(lines)


def make_report(*, sweep_dir: Path, out_dir: Path | None = None, exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
                paper_values: Path = PAPER_VALUES) -> Report:
    """Read every run below ``sweep_dir``, build the tables, write ``<out>/*.md|csv`` and ``report.md``."""
    sweep_dir = Path(sweep_dir)
    out_dir = Path(out_dir) if out_dir is not None else sweep_dir / "report"
    runs = find_runs(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"no run directory (a directory with config.yaml) below {sweep_dir}")
    tables = build_tables(runs, exclude=exclude)
    data = load_paper_values(paper_values)
    attach_paper_values(tables, data=data)
    files: list[Path] = []
    parts = [f"## Results of {sweep_dir} ({len(runs)} runs, {sum(r.ok for r in runs)} with results)"]
    for i, table in enumerate(tables):
        files.extend(write_table(table, out_dir=out_dir, name=slug(table, index=i, count=len(tables))))
        parts.append(to_markdown(table))
    for section in (_failed_section(runs), claims_markdown(data)):
        if section:
            parts.append(section)
    markdown = "\n\n".join(parts) + "\n"
    (out_dir / "report.md").write_text(markdown)
    files.append(out_dir / "report.md")
    return Report(sweep_dir=sweep_dir, out_dir=out_dir, runs=runs, tables=tables, markdown=markdown, files=files)


def print_comparison(report: Report) -> list[Path]:
    """Write the comparison table and the plots next to ``report``'s files; print the table and every path."""
    from sdp.report.compare import plot_title, write_comparison

    comp = write_comparison(tables=report.tables, out_dir=report.out_dir,
                            title=plot_title(report.tables, fallback=report.sweep_dir.name))
    print(comp.markdown, flush=True)
    print(f"comparison: {comp.files[0]}\nfull report: {report.out_dir / 'report.md'} (tables as md + csv: "
          f"{', '.join(f.name for f in report.files if f.name != 'report.md')})\n"
          f"plots: {', '.join(str(f) for f in comp.files[1:]) or 'none'}\nrebuild: sdp-report {report.sweep_dir} --compare",
          flush=True)
    return comp.files


def main(argv: list[str] | None = None) -> int:
    """``sdp-report SWEEP_DIR [--out DIR] [--exclude PATTERN ...] [--compare]``: print the tables, write md + csv."""
    parser = argparse.ArgumentParser(prog="sdp-report", description=main.__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (or one run directory)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: SWEEP_DIR/report)")
    parser.add_argument("--exclude", nargs="*", default=None,
                        help=f"config keys (fnmatch patterns) never used to group runs; default {' '.join(DEFAULT_EXCLUDE)}")
    parser.add_argument("--compare", action="store_true",
                        help="print one table of ratios to DDP instead (and write it with the plots): what sdp-train experiment=compare prints")
    args = parser.parse_args(argv)
    exclude = tuple(args.exclude) if args.exclude is not None else DEFAULT_EXCLUDE
    try:
        report = make_report(sweep_dir=args.sweep_dir, out_dir=args.out, exclude=exclude)
    except FileNotFoundError as exc:
        print(f"sdp-report: {exc}", file=sys.stderr)
        return 2
    if args.compare:
        print_comparison(report)
        return 0
    print(report.markdown)
    print(f"written: {', '.join(str(f) for f in report.files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
