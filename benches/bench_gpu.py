"""kvrs's CUDA kernels against the device copy, torch SDPA and FlashInfer, on one GPU.

Run on a GPU: `python benches/bench_gpu.py --json out.json` (`--cases decode,scatter` for
some). Record the device, driver, date and table in benches/RESULTS.md. float16 K/V of 8
heads x 128 (32 query heads), blocks of 16, unless a row says otherwise.

Cases: the copy ceiling (a 1 GiB device-to-device copy); decode attention over one 32k
sequence and over 256 sequences x 2k tokens (pages interleaved in the pool, the pool's own
page tables) with float16, fp8 E4M3 and int8 storage; chunked prefill (16 sequences x 2k
history, 512 new tokens each, causal) and one 32k prefill (causal), on kvrs's tensor
cores, with TFLOP/s; MLA decode (bfloat16, 128 heads over 512 + 64 latents) over one 32k
sequence and 256 x 2k; the prefill scatter of 32k tokens; the gather of a
32k sequence; copy-on-write of 256 forks, each of a different parent block, x 32 layers;
the decode write of 256 sequences x 32 layers (per layer, and `pool.write_layers` in one
launch where kvrs has it); the offload tiers' swap-in of a 4k-token prefix.

Bytes count K and V, read and written: a scatter reads its input and writes the pages, a
gather the reverse, attention reads every K and V position once (int8 scales included).
Each row gives four times (benches/gpu_timing.py): `call` (one call, host work included,
L2 flushed), `stream` (back-to-back calls), `kernel` (the call's kernels alone, from
CUPTI), `graph` (CUDA-graph replay, where kvrs lets the call be captured). GB/s, % of the
copy ceiling and the ratios to SDPA and FlashInfer use the kernel time (the stream time
where no trace exists). SDPA gets separate, contiguous [batch, heads, seq, dim] K and V
(`enable_gqa=True`, what transformers runs on torch >= 2.5; `repeat_kv` beside it).
FlashInfer runs over kvrs's own pages and page table, its outputs checked against kvrs's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kvrs

sys.path.insert(0, str(Path(__file__).parent))
import flashinfer_peer
from gpu_attention_cases import decode_batch, decode_single, extend, prefill
from gpu_copy_cases import cow, decode_write, scatter_gather, swap
from gpu_mla_cases import mla_decode
from gpu_report import HEADER, STORAGE, Bench, line, ratios

CASES = ("decode", "extend", "prefill", "mla", "scatter", "gather", "cow", "write", "swap")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows and the run's facts here")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer even when importable")
    ap.add_argument(
        "--flashinfer-timeout", type=float, default=240, help="seconds for FlashInfer's JIT build"
    )
    ap.add_argument(
        "--flashinfer-prefill-timeout",
        type=float,
        default=150,
        help="seconds for FlashInfer's prefill and MLA modules' JIT build (their rows only)",
    )
    ap.add_argument(
        "--ncu",
        action="store_true",
        help="time nothing: run each kvrs call once inside cudaProfilerStart/Stop and an NVTX range "
        "named after its row, for `ncu --profile-from-start off` (benches/gpu_session.sh, step ncu)",
    )
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    if unknown := cases - set(CASES):
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    if not kvrs.cuda_available():
        print(
            "bench_gpu: no CUDA device (kvrs.cuda_available() is False); nothing to measure", file=sys.stderr
        )
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: torch sees no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    peer = flashinfer_peer.Peer(None, {"error": "--no-flashinfer"})
    if not (args.no_flashinfer or args.ncu):
        peer = flashinfer_peer.load(args.flashinfer_timeout)
    print(f"FlashInfer: {peer.info}", flush=True)
    bench = Bench(torch, args.json, peer, ncu=args.ncu)
    if cases & {"extend", "prefill", "mla"} and peer.fi is not None:
        bench.prefill_peer = flashinfer_peer.load(args.flashinfer_prefill_timeout, "prefill")
        print(f"FlashInfer prefill and MLA: {bench.prefill_peer.info}", flush=True)
        bench.meta["flashinfer_prefill"] = bench.prefill_peer.info
    if "decode" in cases:
        for dtype in STORAGE:
            decode_single(bench, dtype)
            decode_batch(bench, dtype)
            torch.cuda.empty_cache()
    if "extend" in cases:
        extend(bench)
        torch.cuda.empty_cache()
    if "prefill" in cases:
        prefill(bench)
        torch.cuda.empty_cache()
    if "mla" in cases:
        mla_decode(bench, 1, 32768)
        mla_decode(bench, 256, 2048)
        torch.cuda.empty_cache()
    if cases & {"scatter", "gather"}:
        scatter_gather(bench, cases)
    if "cow" in cases:
        cow(bench)
    if "write" in cases:
        decode_write(bench)
    if "swap" in cases:
        swap(bench)
    if args.ncu:
        return 0
    ratios(bench.rows)
    bench.save()
    print(
        f"\ndevice: {bench.meta['device']}  torch {torch.__version__}  copy ceiling "
        f"{bench.ceiling:.0f} GB/s  FlashInfer: {peer.info.get('version', peer.info.get('error'))}"
    )
    print(HEADER)
    for row in bench.rows:
        print(line(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
