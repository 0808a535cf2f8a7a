#!/usr/bin/env bash
# Everything that needs a GPU, in one run (the GPU issue's items), from a built wheel:
#
#     make wheel && OUT=gpu-logs benches/gpu_session.sh dist/kvrs-*-abi3-*.whl
#
# Installs the wheel into /tmp/kvrs-site (no Rust needed), then writes one log per step
# under $OUT: the environment, the CUDA tests (test_cuda.py and the device-against-host
# state machine), benches/bench_gpu.py, the demo on the GPU (checked against
# DynamicCache) and its concurrency sweep, the CUDA tests under compute-sanitizer's
# memcheck, and the whole Python suite. Each step has its
# own time limit, so one that hangs cannot take the others with it. STEPS="env suite"
# runs only the steps named (the device tool allows 600 s per call; all of them take more).
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/kvrs-site "$1" || exit 1
export PYTHONPATH=/tmp/kvrs-site PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...: runs COMMAND into $OUT/NAME.txt, prints its status
    local name=$1 limit=$2
    shift 2
    case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s"
}
step env 60 bash -c 'date -u; nvidia-smi; python3 -c "import sys, torch, transformers, kvrs
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)
print(\"transformers\", transformers.__version__, \"kvrs cuda_available\", kvrs.cuda_available())"'
step cuda_tests 150 python3 -m pytest -p no:cacheprovider -v -rs tests/python/test_cuda.py tests/python/test_cuda_state_machine.py
step bench_gpu 90 python3 benches/bench_gpu.py
step demo 100 python3 -m kvrs demo --device cuda --no-plot --no-progress
step demo_concurrency 70 python3 -m kvrs demo --device cuda --concurrency 8,32,96,256 --no-plot
step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -p no:cacheprovider -q tests/python/test_cuda.py
step suite 300 python3 -m pytest -p no:cacheprovider -q -n 16 -rs --timeout 90 --durations 15 tests/python
tail -n 3 "$OUT"/*.txt
