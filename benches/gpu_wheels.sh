#!/usr/bin/env bash
# Fills gpu-wheels/ (git-ignored) with what benches/gpu_session.sh installs beside kvrs so
# that benches/bench_gpu.py runs FlashInfer on a GPU machine that reaches no registry:
#
#     PY=.venv/bin/python benches/gpu_wheels.sh        # then carry gpu-wheels/ with the kvrs wheel
#
# - flashinfer-python 0.5.3 (7 MB; later wheels are 14-62 MB) and apache-tvm-ffi for the
#   device's Python (3.12 unless PYVER says otherwise), with the modules of theirs that
#   `import flashinfer` needs and the GPU image may lack (pynvml, einops, tabulate,
#   requests and its four), and ninja (FlashInfer builds through it when it compiles);
#   all installed there with --no-deps. nvidia-cutlass-dsl and cudnn-frontend (59 MB and
#   more) are not needed by the decode and append paths: `import flashinfer` works without.
# - flashinfer-aot-sm90a.tar.gz: FlashInfer's append and batch-decode modules (float16 and
#   fp8 E4M3 K/V, head_dim 128) compiled here for sm_90a with the pinned nvcc 13.0.88 of
#   kernels/requirements.txt (about 2 minutes on 2 cores). Unpacked into
#   flashinfer/data/aot/, FlashInfer loads them instead of compiling (no nvcc or ninja on
#   the GPU machine; it compiles only what is missing there).
# About 12 MB in all.
set -euo pipefail
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
DEST=${DEST:-gpu-wheels}
FI_VERSION=0.5.3
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps -d "$DEST" \
    "flashinfer-python==$FI_VERSION" nvidia-ml-py einops tabulate ninja requests urllib3 idna certifi
"$PY" -m pip download -q --no-deps -d "$DEST" --python-version "$PYVER" --only-binary=:all: \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    'apache-tvm-ffi>=0.1,<0.2' charset-normalizer

# Build the modules with a throwaway install of the same wheels for this machine's Python.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps -d "$work/local" 'apache-tvm-ffi>=0.1,<0.2' charset-normalizer
"$PY" -m pip install -q --no-deps --no-compile --target "$work/site" \
    "$DEST"/flashinfer_python-*.whl "$DEST"/{nvidia_ml_py,einops,tabulate,ninja,requests,urllib3,idna,certifi}-*.whl \
    "$work"/local/*.whl
# FlashInfer links with -L$CUDA_HOME/lib64 -lcudart -lcuda: give the pip toolkit that layout,
# with a stub libcuda (no driver here; the real one is found on the GPU machine).
cu=$("$PY" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
home="$work/cuda"
mkdir -p "$home/lib64/stubs"
ln -s "$cu/bin" "$cu/include" "$cu/nvvm" "$home/"
ln -s "$cu/lib/libcudart.so.13" "$home/lib64/libcudart.so"
echo 'void cuInit(void) {}' >"$work/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib64/stubs/libcuda.so" "$work/stub.c"
CUDA_HOME=$home FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$work/ws" \
    PATH="$work/site/bin:$PATH" PYTHONPATH="$work/site" \
    "$PY" benches/flashinfer_peer.py --build --pack "$DEST/flashinfer-aot-sm90a.tar.gz"
du -ch "$DEST"/* | tail -n 1
