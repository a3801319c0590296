"""``sdp-bench memory-anchor`` (:mod:`sdp.bench.memory_anchor`): ``python benchmarks/memory_anchor.py [options]``
runs the same suite."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["memory-anchor", *sys.argv[1:]]))
