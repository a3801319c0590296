"""``sdp-bench cpu-study`` (:mod:`sdp.bench.cpu_study`): ``python benchmarks/cpu_study.py [options]`` runs the same suite, as
the commands recorded in committed reports and older docs name it."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["cpu-study", *sys.argv[1:]]))
