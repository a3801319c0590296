"""``sdp-bench harness-overhead`` (:mod:`sdp.bench.harness_overhead`): ``python benchmarks/harness_overhead.py [options]`` runs the same suite, as
the commands recorded in committed reports and older docs name it."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["harness-overhead", *sys.argv[1:]]))
