"""``sdp-bench diagnose`` (:mod:`sdp.bench.diagnose`): ``python benchmarks/diagnose.py RUN_DIR...`` runs the same
command, as every suite has its script here."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["diagnose", *sys.argv[1:]]))
