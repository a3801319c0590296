"""``sdp-bench SUITE [options]``: pick the suite, hand it the rest of the command line.

Why a dispatcher and not one parser: each suite owns its options (``sdp-bench SUITE --help``), so adding
one is a module and a line in :data:`sdp.bench.SUITES`; the suites are imported only when run, so
``sdp-bench --help`` answers without loading torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from sdp.bench import SUITES, module_name
from sdp.errors import ConfigError, one_of


def usage() -> str:
    width = max(map(len, SUITES))
    lines = ["usage: sdp-bench SUITE [options]   (sdp-bench SUITE --help: the suite's options)", "", "suites:"]
    lines += [f"  {name:<{width}}  {what}" for name, what in SUITES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one suite; 0 when it finished, 2 (and the allowed suites) when none or an unknown one is named."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    try:
        one_of("SUITE", suite, SUITES)
    except ConfigError as exc:
        print(f"sdp-bench: {exc}\n\n{usage()}", file=sys.stderr)
        return 2
    result: Any = importlib.import_module(module_name(suite)).main(rest)
    return result if isinstance(result, int) else 0
