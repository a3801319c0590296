"""``sdp-bench eval-protocols`` (:mod:`sdp.bench.eval_protocols`): ``python benchmarks/eval_protocols.py [options]`` runs the same suite, as
the commands recorded in committed reports and older docs name it."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["eval-protocols", *sys.argv[1:]]))
