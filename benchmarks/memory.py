"""``sdp-bench memory`` (:mod:`sdp.bench.memory`): ``python benchmarks/memory.py [options]`` runs the same suite, as
the commands recorded in committed reports and older docs name it."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["memory", *sys.argv[1:]]))
