"""``sdp-bench depth-probe`` (:mod:`sdp.bench.depth_probe`): ``python benchmarks/depth_probe.py --name N --set JSON``
runs the same command, as every suite has its script here."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["depth-probe", *sys.argv[1:]]))
