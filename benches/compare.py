"""kvrs against its peers, in one process, on the same data: a markdown table of ratios and
a PNG plot (benches/compare.png). Run: `make bench` (or `python benches/compare.py`).

1. Decode step: append one token (8 KV heads x 128, float16) to each of 32 layers and
   read every layer's K/V back, at 1k, 4k and 16k context: kvrs `KVCache` (zero-copy
   views), `BlockPool` read in place (each layer's paged tensor and the page table, as a
   paged attention kernel reads them) and `BlockPool` gathered into contiguous buffers,
   against transformers' `DynamicCache` and `StaticCache` layers, with NumPy writes into
   a preallocated array as the floor. The gathered path copies the whole history every
   step, as DynamicCache does; it is compared with DynamicCache.
2. Prefill append (4096 tokens) against a NumPy copy of the same bytes.
3. A scheduling step for 256 sequences against vLLM 0.33's real KVCacheManager (when
   `make bench-peers` has unpacked it; benches/bench_peers.py has every peer row).
4. Prefix hashing of a 32k-token prompt against vLLM's sha256 and xxhash schemes.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

import kvrs

sys.path.insert(0, str(Path(__file__).parent))
import bench_contiguous
import bench_paged
import bench_prefix

LAYERS, HEADS, DIM = 32, 8, 128
CONTEXTS = (1024, 4096, 16384)


def speed(ratio: float) -> str:
    """'2.5x faster' or '1.1x slower' for a peer/kvrs time ratio."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def per_step(step, repeat: int = 5, number: int = 4) -> float:
    """Median seconds of one call of `step`."""
    step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            step()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def decode_steps(ctx: int) -> dict[str, float]:
    """Seconds of one 32-layer decode step at `ctx` tokens of context, per implementation."""
    k_np = np.ones((1, HEADS, DIM), np.float16)
    k_t = torch.ones(1, HEADS, 1, DIM, dtype=torch.float16)
    out: dict[str, float] = {}

    cache = kvrs.KVCache(LAYERS, HEADS, DIM, ctx + 8, dtype="float16")
    cache.set_seq_len(ctx)

    def kvrs_kvcache():
        for layer in range(LAYERS):
            cache.append(layer, k_np, k_np)
            cache.get(layer)
        cache.advance()
        cache.truncate(ctx)

    out["kvrs KVCache"] = per_step(kvrs_kvcache)

    pool = kvrs.BlockPool(LAYERS, HEADS, DIM, block_size=16, num_blocks=ctx // 16 + 4, dtype="float16")
    seq = pool.new_sequence()
    pool.reserve([seq], [ctx])
    seq.advance(ctx)
    buf = (np.empty((HEADS, ctx + 8, DIM), np.float16), np.empty((HEADS, ctx + 8, DIM), np.float16))

    def kvrs_pool_paged():
        # What a paged attention kernel reads: each layer's pages in place, and the page table.
        for layer in range(LAYERS):
            seq.append(layer, k_np, k_np)
            pool.kv_cache(layer)
        pool.page_table([seq])
        seq.advance()
        seq.truncate(ctx)

    def kvrs_pool_gather():
        for layer in range(LAYERS):
            seq.append(layer, k_np, k_np)
            seq.get(layer, out=buf)  # the history copied into contiguous K/V
        seq.advance()
        seq.truncate(ctx)

    out["kvrs BlockPool (pages)"] = per_step(kvrs_pool_paged)
    out["kvrs BlockPool (gathered)"] = per_step(kvrs_pool_gather)

    prefill = torch.zeros(1, HEADS, ctx, DIM, dtype=torch.float16)
    dynamic = [DynamicLayer() for _ in range(LAYERS)]
    static = [StaticLayer(max_cache_len=ctx + 8) for _ in range(LAYERS)]
    for d, s in zip(dynamic, static, strict=True):
        d.update(prefill, prefill)
        s.update(prefill, prefill)

    def hf_dynamic():
        for d in dynamic:
            d.update(k_t, k_t)  # concatenates: the whole history is copied
        for d in dynamic:
            d.crop(-1)  # back to ctx for the next step

    def hf_static():
        for s in static:
            s.update(k_t, k_t)
        for s in static:
            s.cumulative_length.sub_(1)

    out["transformers DynamicCache"] = per_step(hf_dynamic)
    out["transformers StaticCache"] = per_step(hf_static)

    store = np.zeros((LAYERS, 2, HEADS, ctx + 8, DIM), np.float16)

    def numpy_floor():
        for layer in range(LAYERS):
            store[layer, 0, :, ctx] = k_np[0]
            store[layer, 1, :, ctx] = k_np[0]
            store[layer, 0, :, : ctx + 1]
            store[layer, 1, :, : ctx + 1]

    out["NumPy floor"] = per_step(numpy_floor)
    return out


def main() -> None:
    rows = []
    decode = {ctx: decode_steps(ctx) for ctx in CONTEXTS}
    for ctx, times in decode.items():
        peers = {k: v for k, v in times.items() if k.startswith("transformers")}
        best = min(peers, key=peers.get)
        # The gathered path copies the whole history, like DynamicCache: compare it with that.
        for name, peer in (
            ("kvrs KVCache", best),
            ("kvrs BlockPool (pages)", best),
            ("kvrs BlockPool (gathered)", "transformers DynamicCache"),
        ):
            rows.append(
                (
                    f"decode step, {ctx // 1024}k context, {name}",
                    f"{times[name] * 1e6:,.0f} us",
                    f"{times[peer] * 1e6:,.0f} us ({peer.split()[1]})",
                    f"{speed(times[peer] / times[name])}; "
                    f"{times[name] / times['NumPy floor']:.1f}x NumPy floor's time",
                )
            )
    bw_kvrs, bw_numpy = bench_contiguous.prefill(4096)
    rows.append(
        (
            "prefill append, 4096 tokens",
            f"{bw_kvrs:.1f} GB/s",
            f"{bw_numpy:.1f} GB/s (NumPy copy)",
            f"{bw_kvrs / bw_numpy:.0%} of copy bandwidth",
        )
    )
    if bench_paged.peers.available():
        t_vllm = bench_paged.timed(bench_paged.vllm_setup, bench_paged.vllm_step)
        t_kvrs = bench_paged.timed(bench_paged.kvrs_setup, bench_paged.kvrs_reserve_step)
        bench_paged.peers.check_untouched()
        rows.append(
            (
                "scheduling step, 256 sequences",
                f"{t_kvrs * 1e6:.0f} us",
                f"{t_vllm * 1e6:.0f} us (vLLM {bench_paged.peers.VLLM_VERSION} KVCacheManager)",
                f"{t_vllm / t_kvrs:.0f}x faster",
            )
        )
    rates = bench_prefix.measure()
    rows.append(
        (
            "prefix hashing, 32k tokens",
            f"{rates['kvrs blake3'] / 1e6:.0f} M tok/s (BLAKE3)",
            f"{rates['vLLM sha256'] / 1e6:.1f} M tok/s (vLLM sha256)",
            f"{rates['kvrs blake3'] / rates['vLLM sha256']:.0f}x faster",
        )
    )

    print("| workload | kvrs | best peer | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if not bench_paged.peers.available():
        print("\n(the scheduling step against vLLM's KVCacheManager needs its wheel: `make bench-peers`)")
    plot(decode, Path(__file__).parent / "compare.png")


def plot(decode: dict[int, dict[str, float]], path: Path) -> None:
    """Decode-step time against context for every implementation, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in next(iter(decode.values())):
        ax.plot(CONTEXTS, [decode[c][name] * 1e3 for c in CONTEXTS], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(CONTEXTS, [f"{c // 1024}k" for c in CONTEXTS])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step, 32 layers (ms)")
    ax.set_title("Append one token to every layer and read K/V back (fp16, 8 x 128)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
