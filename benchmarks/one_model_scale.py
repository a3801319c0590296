"""``sdp-bench one-model-scale`` (:mod:`sdp.bench.one_model_scale`): ``python benchmarks/one_model_scale.py
[options]`` runs the same suite."""

import sys

from sdp.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["one-model-scale", *sys.argv[1:]]))
