#!/usr/bin/env bash
# Download exactly the wheels the GPU check needs (benchmarks/gpu/wheels.txt) for a machine with no package index:
#   bash benchmarks/gpu/wheels.sh DIR [PYTHON_VERSION]     (PYTHON_VERSION default 3.12, the lent H200's)
# then on that machine: WHEELS=DIR bash benchmarks/gpu/h200_check.sh (installed with --no-index --no-deps into a
# folder of their own, put on PYTHONPATH; nothing else is installed). Needs a package index here, not there.
# Pure-Python wheels are taken as binaries for that Python and a manylinux x86_64 platform; an sdist-only package
# (antlr4-python3-runtime) is built into a wheel here with `pip wheel --no-deps` (pure Python: any platform).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:?usage: wheels.sh DIR [PYTHON_VERSION]}; PYV=${2:-3.12}
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
grep -v '^\s*#' benchmarks/gpu/wheels.txt | grep -v '^\s*$' | while read -r req; do
  if ! $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLATFORMS \
       -d "$DIR" "$req" 2>/dev/null; then
    $PY -m pip wheel -q --no-deps -w "$DIR" "$req"  # no wheel on the index: build one (pure Python only)
  fi
done
ls "$DIR"/*.whl | while read -r w; do
  case "$(basename "$w")" in *-none-any.whl|*-cp${PYV/./}-*.whl|*-abi3-*.whl) ;;
    *) echo "wheels.sh: $(basename "$w") does not fit Python $PYV on x86_64 Linux" >&2; exit 1;; esac
done
echo "wheels for Python $PYV in $DIR: $(ls "$DIR" | tr '\n' ' ')"
