#!/usr/bin/env bash
# Everything that needs a GPU, from a built wheel, one log per step under $OUT:
#
#     make wheel && benches/gpu_wheels.sh          # here: dist/kvrs-*.whl, gpu-wheels/ (12 MB)
#     STEPS=perf OUT=gpu-logs benches/gpu_session.sh dist/kvrs-*-abi3-*.whl   # there
#
# Installs the kvrs wheel into /tmp/kvrs-site and, when gpu-wheels/ was carried along,
# FlashInfer and its precompiled sm_90a modules into /tmp/fi-site (both --no-deps
# --no-index: no Rust, no registry, no compiler needed there). Each step has its own time
# limit, so one that hangs cannot take the others with it. STEPS names the steps to run,
# or a set: quick (env fi_build bench_gpu, about 4 min), perf (quick + ncu, at most 9.5 min),
# tests (env cuda_tests demo demo_concurrency memcheck, about 8 min), tensor (issue 41: env
# tc_tests bench_tc ncu_tc, about 6 min, at most 9), suite; all steps when unset (more
# than the device tool's 600 s per call: split them as above).
#
# Steps: env (device, driver, toolkit, versions); cuda_tests (test_cuda.py and the
# device-against-host state machine); fi_build (loads or builds FlashInfer's modules,
# timed); bench_gpu (benches/bench_gpu.py --json $OUT/bench_gpu.json); ncu (each kvrs
# kernel of the bench profiled alone: time, DRAM bytes, local-memory traffic, occupancy,
# registers; $OUT/ncu-kvrs.ncu-rep, ncu-kvrs.csv, and ncu-kvrs-rows.csv: the same rows named
# after the bench row that launched them); demo and demo_concurrency (the demo on the
# GPU, checked against DynamicCache); memcheck (compute-sanitizer on test_cuda.py); suite
# (the whole Python suite). Issue 41's tensor-core kernels: tc_tests (test_cuda_tensor_cores.py:
# extend on kvrs_paged_attention_mma_* and MLA on kvrs_paged_attention_mla_* against the host
# and SDPA, BlockPool.set_stream; then test_cuda.py), bench_tc (bench_gpu.py --cases
# extend,prefill,mla --json $OUT/bench_tc.json: 16 x (2k + 512) and 1 x 32k prefill against
# SDPA and FlashInfer's prefill, MLA decode 1 x 32k and 256 x 2k against FlashInfer's MLA;
# FlashInfer's prefill and MLA modules are JIT-built within 120 s or their rows dropped),
# ncu_tc (those kvrs calls' kernels under ncu: $OUT/ncu-tc.ncu-rep, ncu-tc.csv, ncu-tc-rows.csv,
# with tensor-pipe utilisation and shared-memory bank conflicts beside the bench metrics).
set -u
OUT=${OUT:-gpu-logs}
FI_WHEELS=${FI_WHEELS:-gpu-wheels}
mkdir -p "$OUT"
case "${STEPS:-all}" in
quick) STEPS="env fi_build bench_gpu" ;;
perf) STEPS="env fi_build bench_gpu ncu" ;;
tests) STEPS="env cuda_tests demo demo_concurrency memcheck" ;;
tensor) STEPS="env tc_tests bench_tc ncu_tc" ;;
all) STEPS="env cuda_tests fi_build bench_gpu ncu demo demo_concurrency memcheck suite" ;;
esac
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/kvrs-site "$1" || exit 1
export PYTHONPATH=/tmp/kvrs-site PYTHONUNBUFFERED=1
FI_PATH=/tmp/kvrs-site
if compgen -G "$FI_WHEELS/*.whl" >/dev/null; then
    # One pip call into a fresh directory: a second --target install would replace bin/.
    rm -rf /tmp/fi-site
    if python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/fi-site "$FI_WHEELS"/*.whl; then
        for aot in "$FI_WHEELS"/flashinfer-aot-*.tar.gz; do
            [ -f "$aot" ] && mkdir -p /tmp/fi-site/flashinfer/data/aot && tar xzf "$aot" -C /tmp/fi-site/flashinfer/data/aot
        done
        FI_PATH=/tmp/kvrs-site:/tmp/fi-site
    fi
fi
# FlashInfer compiles a missing module with the toolkit's nvcc, into a cache under /tmp.
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws PATH="/tmp/fi-site/bin:$PATH"
step() {  # step NAME SECONDS COMMAND...: runs COMMAND into $OUT/NAME.txt, prints its status
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s"
}
step env 60 bash -c 'date -u; nvidia-smi; which nvcc ncu compute-sanitizer; nvcc --version | tail -n 2
echo "CUDA_HOME=${CUDA_HOME:-}"; python3 -c "import sys, torch, transformers, kvrs
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda)
print(\"transformers\", transformers.__version__, \"kvrs cuda_available\", kvrs.cuda_available())"
PYTHONPATH='"$FI_PATH"' python3 -c "import flashinfer; print(\"flashinfer\", flashinfer.__version__)"'
step cuda_tests 150 python3 -m pytest -p no:cacheprovider -v -rs tests/python/test_cuda.py tests/python/test_cuda_state_machine.py
step fi_build 300 env PYTHONPATH="$FI_PATH" python3 benches/flashinfer_peer.py --build
step bench_gpu 300 env PYTHONPATH="$FI_PATH" python3 benches/bench_gpu.py --json "$OUT/bench_gpu.json"
NCU_METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,\
l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,\
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,\
sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread,launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic
step ncu 240 bash -c "ncu --profile-from-start off --kernel-name regex:kvrs_ --launch-count 600 \
--clock-control none --nvtx --metrics $NCU_METRICS -f -o $OUT/ncu-kvrs \
python3 benches/bench_gpu.py --ncu --cases decode,extend,scatter,gather,cow,write; \
ncu --import $OUT/ncu-kvrs.ncu-rep --csv --page raw >$OUT/ncu-kvrs.csv; \
ncu --import $OUT/ncu-kvrs.ncu-rep --csv --page raw --print-nvtx-rename kernel >$OUT/ncu-kvrs-rows.csv"
step tc_tests 100 python3 -m pytest -p no:cacheprovider -v -rs tests/python/test_cuda_tensor_cores.py tests/python/test_cuda.py
step bench_tc 300 env PYTHONPATH="$FI_PATH" python3 benches/bench_gpu.py --cases extend,prefill,mla \
    --flashinfer-prefill-timeout 120 --json "$OUT/bench_tc.json"
TC_METRICS=$NCU_METRICS,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed_op_ldsm.sum
step ncu_tc 120 bash -c "ncu --profile-from-start off --kernel-name regex:kvrs_ --launch-count 40 \
--clock-control none --nvtx --metrics $TC_METRICS -f -o $OUT/ncu-tc \
python3 benches/bench_gpu.py --ncu --cases extend,prefill,mla; \
ncu --import $OUT/ncu-tc.ncu-rep --csv --page raw >$OUT/ncu-tc.csv; \
ncu --import $OUT/ncu-tc.ncu-rep --csv --page raw --print-nvtx-rename kernel >$OUT/ncu-tc-rows.csv"
step demo 100 python3 -m kvrs demo --device cuda --no-plot --no-progress
step demo_concurrency 70 python3 -m kvrs demo --device cuda --concurrency 8,32,96,256 --no-plot
step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -p no:cacheprovider -q tests/python/test_cuda.py
step suite 300 python3 -m pytest -p no:cacheprovider -q -n 16 -rs --timeout 90 --durations 15 tests/python
tail -n 3 "$OUT"/*.txt
