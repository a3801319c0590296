"""The paper's published values (``paper_values.yaml``) placed next to ours.

Why a data file: the only numbers the paper gives are few and of mixed provenance; keeping them in one
reviewed file, each with its version and source tag, makes every cell in our tables traceable and
makes it impossible for a report to show a paper number that nobody wrote down. Cells the paper does
not give stay empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sdp.report.tables import Row, Stat, Table

PAPER_VALUES = Path(__file__).resolve().parent / "paper_values.yaml"


def load_paper_values(path: Path = PAPER_VALUES) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    for i, t in enumerate(data.get("tables", [])):
        for key in ("id", "version", "provenance", "match", "rows"):
            assert key in t, f"{path}: tables[{i}] lacks {key!r}: {t}"
    return data


def _table_matches(table: Table, match: dict[str, Any]) -> bool:
    runs = [r for row in table.rows for r in row.runs]
    return bool(runs) and all(r.flat.get(k) == v for r in runs for k, v in match.items())


def _row_matches(row: Row, entry: dict[str, Any]) -> bool:
    if row.method != entry["method"]:
        return False
    return "coverage" not in entry or row.coverage == entry["coverage"]


def attach_paper_values(tables: list[Table], *, data: dict[str, Any]) -> None:
    """Fill ``row.paper`` where the paper gives a value; add paper-only rows for methods we lack."""
    arxiv = data.get("paper", {}).get("arxiv", "")
    for table in tables:
        for entry in data.get("tables", []):
            if not _table_matches(table, entry["match"]):
                continue
            table.paper_notes.append(f"paper values: arXiv {arxiv} {entry['version']} ({entry['id']}); "
                                     f"{' '.join(str(entry['provenance']).split())}")
            for p in entry["rows"]:
                ours = [row for row in table.rows if _row_matches(row, p)]
                if not ours:
                    extra = Row(method=f"{p['method']} [paper only]", coverage=p.get("coverage"),
                                keys={k: None for k in table.extra_keys}, runs=[], expected_seeds=[])
                    extra.stats = {m: Stat(None, None, 0) for m in table.rows[0].stats} if table.rows else {}
                    table.rows.append(extra)
                    ours = [extra]
                for row in ours:
                    row.paper.update(p["values"])


def claims_markdown(data: dict[str, Any]) -> str:
    """The paper's claims that have no table cell, as a markdown list with their sources."""
    claims = data.get("claims", [])
    if not claims:
        return ""
    arxiv = data.get("paper", {}).get("arxiv", "")
    lines = [f"Paper claims for context (arXiv {arxiv}; not table cells):", ""]
    lines += [f"- {c['version']}: {c['text']} ({c['source']})" for c in claims]
    return "\n".join(lines)
