#!/usr/bin/env bash
# Builds or checks the committed PTX with the pinned nvcc from PyPI (kernels/requirements.txt).
#   kernels/build.sh ptx     regenerate kernels/kvrs.ptx from kernels/kvrs.cu
#   kernels/build.sh check   fail unless kernels/kvrs.ptx matches kvrs.cu and assembles for sm_80 and sm_90,
#                            and every attention kernel has no stack frame (ptxas -v, sm_90) and
#                            moves K/V in 16-byte pieces (cp.async ..., 16 in its PTX), and the
#                            kernels that serve extend and prefill (kvrs_paged_attention_mma_*, for
#                            float16 and bfloat16, head sizes 64, 128, 256) and the latent (MLA)
#                            ones (kvrs_paged_attention_mla_*) run on the tensor cores
#                            (mma.sync.aligned.m16n8k16 and ldmatrix in their PTX)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m pip install --quiet -r kernels/requirements.txt
CUDA=$("$PY" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
# Compiled from a copy in a fresh temporary directory, so that a PTX which depended on the
# source's path (as anonymous namespaces make it) would fail `check` here and not only in CI.
nvcc() {
  local dir
  dir=$(mktemp -d)
  cp kernels/kvrs.cu kernels/*.cuh "$dir/"
  "$CUDA/bin/nvcc" -ptx -arch=compute_80 -O3 -std=c++17 "$dir/kvrs.cu" -o "$1"
  rm -rf "$dir"
}
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
    # Attention kernels: a 0-byte stack frame for sm_90 (q, the accumulator and the scores in
    # registers), and their K/V loads 16-byte cp.async copies.
    "$CUDA/bin/ptxas" -v -arch=sm_90 kernels/kvrs.ptx -o /dev/null 2>&1 | awk '
      /Compiling entry function/ { name = $0; sub(/.*function .|. for .*/, "", name) }
      /bytes stack frame/ && name ~ /attention/ {
        n++
        if ($1 != 0) { print name ": " $1 " bytes stack frame" > "/dev/stderr"; bad = 1 }
      }
      END { if (bad || n == 0) exit 1; print n " attention kernels: no stack frame (sm_90)" }'
    awk '
      /^\.visible \.entry/ { name = $3; sub(/\(.*/, "", name); attn = name ~ /^kvrs_paged_attention/; if (attn) n++ }
      attn && /cp\.async\.cg\.shared\.global.*, 16;/ { wide[name] = 1 }
      END {
        for (k in wide) w++
        if (n == 0 || w != n) { print (n - w) " of " n " attention kernels lack 16-byte cp.async K/V loads" > "/dev/stderr"; exit 1 }
        print n " attention kernels: K/V through 16-byte cp.async"
      }' kernels/kvrs.ptx
    # Extend and prefill: tensor-core kernels for both 16-bit dtypes at every fixed head size;
    # latent (MLA) attention: one per 16-bit dtype, on the tensor cores too.
    awk '
      /^\.visible \.entry/ {
        name = $3; sub(/\(.*/, "", name)
        tc_kernel = name ~ /^kvrs_paged_attention_(mma|mla)_/
        if (name ~ /^kvrs_paged_attention_mma_/) n_mma++
        if (name ~ /^kvrs_paged_attention_mla_/) n_mla++
      }
      tc_kernel && /mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16\.f16|bf16\.bf16)\.f32/ { tc[name] = 1 }
      tc_kernel && /ldmatrix\.sync\.aligned\.m8n8\.x4/ { ld[name] = 1 }
      END {
        for (k in tc) if (k in ld) t++
        if (n_mma != 6 || n_mla != 2 || t != n_mma + n_mla) {
          print t " of " n_mma " extend (6 expected) and " n_mla " latent (2 expected) attention kernels use mma.sync and ldmatrix" > "/dev/stderr"
          exit 1
        }
        print n_mma " extend and " n_mla " latent (MLA) attention kernels: tensor cores (mma.sync m16n8k16, ldmatrix)"
      }' kernels/kvrs.ptx
    entries=$(grep -c '^\.visible \.entry' kernels/kvrs.ptx)
    echo "kernels/kvrs.ptx: up to date, $entries kernels, assembles for sm_80 and sm_90"
    ;;
  *)
    echo "usage: kernels/build.sh ptx|check" >&2
    exit 2
    ;;
esac
