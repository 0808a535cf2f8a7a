#!/usr/bin/env bash
# Builds or checks the committed PTX with the pinned nvcc from PyPI (kernels/requirements.txt).
#   kernels/build.sh ptx     regenerate kernels/kvrs.ptx from kernels/kvrs.cu
#   kernels/build.sh check   fail unless kernels/kvrs.ptx matches kvrs.cu and assembles for sm_80 and sm_90
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m pip install --quiet -r kernels/requirements.txt
CUDA=$("$PY" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
nvcc() { "$CUDA/bin/nvcc" -ptx -arch=compute_80 -O3 -std=c++17 kernels/kvrs.cu -o "$1"; }
case "${1:-}" in
  ptx)
    nvcc kernels/kvrs.ptx
    echo "wrote kernels/kvrs.ptx"
    ;;
  check)
    fresh=$(mktemp --suffix=.ptx)
    trap 'rm -f "$fresh"' EXIT
    nvcc "$fresh"
    if ! cmp -s "$fresh" kernels/kvrs.ptx; then
      echo "kernels/kvrs.ptx is stale: run 'make ptx' and commit it" >&2
      exit 1
    fi
    for arch in sm_80 sm_90; do
      "$CUDA/bin/ptxas" -arch="$arch" kernels/kvrs.ptx -o /dev/null
    done
    entries=$(grep -c '^\.visible \.entry' kernels/kvrs.ptx)
    echo "kernels/kvrs.ptx: up to date, $entries kernels, assembles for sm_80 and sm_90"
    ;;
  *)
    echo "usage: kernels/build.sh ptx|check" >&2
    exit 2
    ;;
esac
