"""kvrs's CUDA kernels against the device's copy bandwidth (and FlashInfer when present).

Run on a GPU: `python benches/bench_gpu.py`. Prints one table; record the device, driver,
date and figures in benches/RESULTS.md. Rows: a device-to-device copy of the same bytes
(the ceiling), prefill scatter of 32k tokens, a decode step writing 256 sequences x 32
layers, gather of a 32k-token sequence, copy-on-write block copies of 256 forks, and
paged attention (kvrs's kernel reading the blocks in place) against torch SDPA over
contiguous K/V: decode over one 32k-token sequence, and one decode token for each of 256
sequences of 2k tokens; 8-bit storage; the offload tiers' swap-in of a 4k-token prefix
against torch's pinned and pageable host-to-device copies.
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


def swap_rows(torch) -> list[tuple[str, float, str]]:
    """A 4k-token prefix of 32 layers (float16, 8 heads of 128: 512 MiB) loaded from a
    HostTier into a CUDA pool (payload checks, the pinned buffer, one copy and one
    launch per 32 MiB), against torch copying the same bytes to the device from pinned
    and from pageable memory. Wall time, synchronized."""
    import time

    layers, heads, dim, bs, n = 32, 8, 128, 16, 4096
    host = kvrs.HostTier("2GiB")
    kw = dict(block_size=bs, num_blocks=n // bs + 16, dtype="float16", device="cuda", seed=3, tiers=[host])
    src = kvrs.BlockPool(layers, heads, dim, **kw)
    prompt = list(range(n + 1))
    s = src.new_sequence(tokens=prompt)
    x = torch.randn(n + 1, heads, dim, device="cuda", dtype=torch.float16)
    for layer in range(layers):
        s.append(layer, x, x)
    s.advance(n + 1)
    s.free()
    src.evict_all()
    src.flush_tiers()
    nbytes = 2 * layers * n * heads * dim * 2

    def wall(fn, reps: int = 5) -> float:
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    dst = kvrs.BlockPool(layers, heads, dim, **kw)

    loads = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        seq = dst.new_sequence(tokens=prompt)
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - t0)
        assert seq.cached_tokens_by_tier["host"] == n
        seq.free()
        dst.evict_all()
        dst.flush_tiers()
    t_load = sorted(loads)[len(loads) // 2]
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    t_pinned = wall(lambda: pinned.to("cuda", non_blocking=True))
    t_pageable = wall(lambda: pageable.to("cuda"))
    return [
        ("swap-in 4k tokens x 32 layers from HostTier", nbytes / t_load / 1e9, "GB/s"),
        ("host-to-device copy, pinned (torch)", nbytes / t_pinned / 1e9, "GB/s"),
        ("host-to-device copy, pageable (torch)", nbytes / t_pageable / 1e9, "GB/s"),
    ]


def main() -> int:
    if not kvrs.cuda_available():
        print("bench_gpu: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    import torch

    heads, dim, bs = 8, 128, 16
    rows = []

    # Prefill: 32k tokens scattered into one layer's pages.
    n = 32768
    pool = kvrs.BlockPool(
        1, heads, dim, block_size=bs, num_blocks=n // bs + 8, dtype="float16", device="cuda"
    )
    seq = pool.new_sequence()
    k = torch.randn(n, heads, dim, device="cuda", dtype=torch.float16)
    slots = pool.reserve([seq], [n])
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
    out = tuple(torch.empty(heads, n, dim, device="cuda", dtype=torch.float16) for _ in range(2))
    rows.append(("gather 32k tokens", nbytes / timed(torch, lambda: seq.get(0, out=out)) / 1e9, "GB/s"))

    # Decode step: 256 sequences x 32 layers, one token each.
    dec = kvrs.BlockPool(
        32, heads, dim, block_size=bs, num_blocks=256 * 2 + 8, dtype="float16", device="cuda"
    )
    dec_seqs = [dec.new_sequence() for _ in range(256)]
    step = dec.reserve(dec_seqs, [1] * 256)
    x = torch.randn(256, heads, dim, device="cuda", dtype=torch.float16)

    def decode() -> None:
        for layer in range(32):
            dec.write(layer, x, x, step)

    rows.append(("decode write 256 seqs x 32 layers", timed(torch, decode) * 1e6, "us"))

    # Copy-on-write: 256 forks of a sequence whose last block is partial each write one
    # token; start_forward copies 256 blocks x 32 layers (one kvrs_copy_blocks launch).
    cow = kvrs.BlockPool(
        32,
        heads,
        dim,
        block_size=bs,
        num_blocks=8 + 2 * 256,
        dtype="float16",
        device="cuda",
        prefix_caching=False,
    )
    parent = cow.new_sequence()
    for layer in range(32):
        parent.append(layer, x[:9], x[:9])
    parent.advance(9)
    times = []
    for _ in range(11):
        forks = [parent.fork() for _ in range(256)]
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        cow.start_forward(forks).cancel()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
        for f in forks:
            f.free()
    t_cow = sorted(times[1:])[5]
    moved = 2 * 256 * cow.bytes_per_block  # read and written
    rows.append(("copy-on-write 256 forks x 32 layers (host+GPU)", t_cow * 1e6, "us"))
    rows.append(("copy-on-write 256 forks x 32 layers", moved / t_cow / 1e9, "GB/s"))

    sdpa = torch.nn.functional.scaled_dot_product_attention
    # Decode attention over one sequence of 32k tokens (32 query heads over 8 KV heads).
    q = torch.randn(1, 32, dim, device="cuda", dtype=torch.float16)
    kc = k.transpose(0, 1)[None].contiguous()  # [1, heads, n, dim]
    tq = q.transpose(0, 1)[None]
    t_kvrs = timed(torch, lambda: seq.attention(0, q))
    t_sdpa = timed(torch, lambda: sdpa(tq, kc, kc, enable_gqa=True))
    rows.append(("attention decode 32k: kvrs", t_kvrs * 1e6, "us"))
    rows.append(("attention decode 32k: SDPA contiguous", t_sdpa * 1e6, "us"))
    rows.append(("attention decode 32k: kvrs K/V read", nbytes / t_kvrs / 1e9, "GB/s"))

    # One decode token for each of 256 sequences of 2k tokens.
    many = kvrs.BlockPool(
        1,
        heads,
        dim,
        block_size=bs,
        num_blocks=256 * 130 + 8,
        dtype="float16",
        device="cuda",
        prefix_caching=False,
    )
    hist = torch.randn(2048, heads, dim, device="cuda", dtype=torch.float16)
    seqs = []
    for _ in range(256):
        s = many.new_sequence()
        s.append(0, hist, hist)
        s.advance(2048)
        seqs.append(s)
    qb = torch.randn(256, 32, dim, device="cuda", dtype=torch.float16)
    one = torch.randn(256, heads, dim, device="cuda", dtype=torch.float16)
    batch = many.start_forward(seqs)
    batch.put(0, one, one)
    kb = torch.cat([hist, one[:1]])[None].transpose(1, 2).expand(256, -1, -1, -1).contiguous()
    t_batch = timed(torch, lambda: batch.attention(0, qb))
    t_sdpa_b = timed(torch, lambda: sdpa(qb[:, :, None], kb, kb, enable_gqa=True))
    batch.cancel()
    rows.append(("attention 256 x 2k decode: kvrs", t_batch * 1e6, "us"))
    rows.append(("attention 256 x 2k decode: SDPA padded", t_sdpa_b * 1e6, "us"))
    rows.append(("attention 256 x 2k: kvrs K/V read", 256 * 2049 * heads * dim * 4 / t_batch / 1e9, "GB/s"))

    # 8-bit storage: the same prefill scatter (float16 inputs quantized on write) and
    # decode attention over 32k tokens (float16 queries), against the float16 rows above.
    for dtype in ("fp8_e4m3", "fp8_e5m2", "int8"):
        q8 = kvrs.BlockPool(1, heads, dim, block_size=bs, num_blocks=n // bs + 8, dtype=dtype, device="cuda")
        s8 = q8.new_sequence()
        slots8 = q8.reserve([s8], [n])
        t_write = timed(torch, lambda q8=q8, slots8=slots8: q8.write(0, k, k, slots8))
        rows.append((f"prefill scatter 32k tokens: {dtype}", nbytes / t_write / 1e9, "GB/s in"))
        q8.write(0, k, k, slots8)
        s8.advance(n)
        t_att = timed(torch, lambda s8=s8: s8.attention(0, q))
        rows.append((f"attention decode 32k: kvrs {dtype}", t_att * 1e6, "us"))

    rows.extend(swap_rows(torch))

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, value, unit in rows:
        print(f"{name:40s} {value:10.1f} {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
