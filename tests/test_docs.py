"""README.md and docs/*.md stay true to the repository they describe.

Why: the docs name files, anchors and config keys by hand, and the code they name moves (packages split,
keys renamed). Each check below fails naming the doc, the reference and what is missing, so a change that
moves a file or renames a key also updates the sentence that points at it. Figures are not checked here:
the docs link to the result files the benchmarks write instead of quoting them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
PATH_ROOTS = ("sdp/", "conf/", "benchmarks/", "tests/", "slurm/", "docs/", ".ci/")
# files the docs name as what a run writes, not as something committed
WRITTEN_BY_RUNS = {"benchmarks/results/gpu/h200_check.md"}
CONFIG_ROOTS = ("train", "eval", "memory", "plan", "logger", "cluster", "parallelism", "model", "dataset", "optim")
FILE_SUFFIXES = (".json", ".jsonl", ".yaml", ".md", ".py", ".txt", ".csv", ".png", ".sh", ".bin")
QUICK_START_MAX_README_LINES = 200


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    body = FENCE.sub("", md.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", body, re.M)}


def prose(md: Path) -> str:
    """The text outside fenced code blocks (commands in fences may name placeholders and outputs)."""
    return FENCE.sub("", md.read_text())


def config_keys() -> set[str]:
    """Every dotted key any conf/ YAML sets: a group file's keys under its group, _global_ files as written."""
    def flat(node: object, prefix: str) -> set[str]:
        out: set[str] = set()
        if isinstance(node, dict):
            for key, value in node.items():
                if key != "defaults":
                    out |= {f"{prefix}{key}"} | flat(value, f"{prefix}{key}.")
        return out

    keys: set[str] = set()
    for f in (REPO / "conf").rglob("*.yaml"):
        text = f.read_text()
        data = yaml.safe_load(text) or {}
        rel = f.relative_to(REPO / "conf")
        top_level = len(rel.parts) == 1 or "@package _global_" in text or rel.parts[0] == "scale_model"
        keys |= flat(data, "" if top_level else f"{rel.parts[0]}.")
    return keys


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(md: Path) -> None:
    broken = []
    for target in LINK.findall(prose(md)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target}: no such file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)} (has {sorted(anchors(dest))})")
    assert not broken, f"{md.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_in_inline_code_exists(md: Path) -> None:
    missing = []
    for token in INLINE.findall(prose(md)):
        path = token.split()[0].rstrip(".,;:")
        if not path.startswith(PATH_ROOTS) or any(c in path for c in "<>*{}[]$") or path in WRITTEN_BY_RUNS:
            continue
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{md.relative_to(REPO)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_key_in_inline_code_is_set_by_some_conf_file(md: Path) -> None:
    known = config_keys()
    unknown = []
    for token in INLINE.findall(prose(md)):
        key = token.split("=")[0].strip()
        if not re.fullmatch(r"[a-z_]+(\.[a-z0-9_]+)+", key) or key.split(".")[0] not in CONFIG_ROOTS:
            continue
        if key.endswith(FILE_SUFFIXES):
            continue  # plan.json and the like: a file, not a key
        if key not in known:
            unknown.append(key)
    assert not unknown, f"{md.relative_to(REPO)} names config keys no conf/ file sets: {unknown}"


def test_readme_is_short_and_its_quick_start_is_two_commands() -> None:
    """.ci/run runs the bash block under '## Quick start' as exactly two commands; the rest lives in docs/."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= QUICK_START_MAX_README_LINES, f"README.md has {len(lines)} lines (at most {QUICK_START_MAX_README_LINES}: move the rest to docs/)"
    start = lines.index("## Quick start")
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```bash"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    block = lines[fence + 1:end]
    assert len(block) == 2 and all(cmd.strip() for cmd in block), f"the Quick start block must be two commands, got {block}"
    assert block[0].endswith("sdp-train experiment=compare") and block[1].endswith("pytest -q"), block  # the comparison, by name
