"""``sdp-bench precision`` (:mod:`sdp.bench.precision`): ``python benchmarks/precision.py [options]`` runs the same suite, as
the commands recorded in committed reports and older docs name it."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["precision", *sys.argv[1:]]))
