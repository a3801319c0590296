"""``python -m sdp.bench SUITE ...``: the same as ``sdp-bench SUITE ...``."""

from sdp.bench.cli import main

if __name__ == "__main__":  # spawned ranks import the main module again: only the command runs the suite
    raise SystemExit(main())
