"""kvrs's CUDA kernels against the device's copy bandwidth (and FlashInfer when present).

Run on a GPU: `python benches/bench_gpu.py`. Prints one table; record the device, driver,
date and figures in benches/RESULTS.md. Rows: a device-to-device copy of the same bytes
(the ceiling), prefill scatter of 32k tokens, a decode step writing 256 sequences x 32
layers, gather of a 32k-token sequence, and block copies.
"""

from __future__ import annotations

import sys

import kvrs


def timed(torch, fn, reps: int = 20) -> float:
    """Median seconds per call, with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    if not kvrs.cuda_available():
        print("bench_gpu: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    import torch

    heads, dim, bs = 8, 128, 16
    rows = []

    # Prefill: 32k tokens scattered into one layer's pages.
    n = 32768
    pool = kvrs.BlockPool(1, heads, dim, bs, n // bs + 8, dtype="float16", device="cuda")
    seq = pool.new_sequence()
    k = torch.randn(n, heads, dim, device="cuda", dtype=torch.float16)
    slots = pool.reserve([seq.id], [n])
    nbytes = 2 * k.numel() * 2
    ceiling = timed(torch, lambda: k.clone())
    rows.append(("device copy (ceiling)", nbytes / ceiling / 1e9, "GB/s"))
    rows.append(
        (
            "prefill scatter 32k tokens",
            nbytes / timed(torch, lambda: pool.write(0, k, k, slots)) / 1e9,
            "GB/s",
        )
    )

    # Gather of the whole sequence.
    pool.write(0, k, k, slots)
    seq.advance(n)
    out = (torch.empty(heads, n, dim, device="cuda", dtype=torch.float16),) * 2
    rows.append(("gather 32k tokens", nbytes / timed(torch, lambda: seq.get(0, out=out)) / 1e9, "GB/s"))

    # Decode step: 256 sequences x 32 layers, one token each.
    dec = kvrs.BlockPool(32, heads, dim, bs, 256 * 2 + 8, dtype="float16", device="cuda")
    ids = [dec.new_sequence().id for _ in range(256)]
    step = dec.reserve(ids, [1] * 256)
    x = torch.randn(256, heads, dim, device="cuda", dtype=torch.float16)

    def decode() -> None:
        for layer in range(32):
            dec.write(layer, x, x, step)

    rows.append(("decode write 256 seqs x 32 layers", timed(torch, decode) * 1e6, "us"))

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, value, unit in rows:
        print(f"{name:40s} {value:10.1f} {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
