"""``sdp-bench slim-runs`` (:mod:`sdp.bench.slim_runs`): ``python benchmarks/slim_runs.py PATH...`` runs the same
command, as every suite has its script here."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["slim-runs", *sys.argv[1:]]))
