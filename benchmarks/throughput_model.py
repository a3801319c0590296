"""``sdp-bench throughput-model`` (:mod:`sdp.bench.throughput_model`): ``python benchmarks/throughput_model.py [options]``
runs the same suite."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["throughput-model", *sys.argv[1:]]))
