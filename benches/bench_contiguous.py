"""kvrs.KVCache against NumPy on the same work, in one process.

1. Decode step: append one token to each of 32 layers (8 KV heads x 128, float16), then
   read every layer's K/V back; against NumPy slice assignment into a preallocated
   [layers, 2, heads, max_seq_len, head_dim] array and slicing it.
2. Prefill: append 4096 tokens to one layer; against a NumPy copy of the same bytes.

Prints a markdown table of ratios (kvrs time / NumPy time for the decode step; kvrs
bandwidth / NumPy copy bandwidth for the prefill). Run: `make bench`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kvrs

LAYERS, HEADS, DIM = 32, 8, 128


def best_of(fn, repeat: int, number: int) -> float:
    """Median over `repeat` runs of the mean time (seconds) of `number` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def decode_step(max_seq_len: int, context: int):
    """Times one decode step (32 layers) for kvrs and for NumPy at `context` tokens."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, HEADS, DIM)).astype(np.float16)
    v = rng.standard_normal((1, HEADS, DIM)).astype(np.float16)

    cache = kvrs.KVCache(LAYERS, HEADS, DIM, max_seq_len, dtype="float16")
    cache.set_seq_len(context)

    def kvrs_step():
        for layer in range(LAYERS):
            cache.append(layer, k, v)
            cache.get(layer)
        cache.advance(1)
        cache.truncate(context)  # stay at the same context length

    store = np.zeros((LAYERS, 2, HEADS, max_seq_len, DIM), np.float16)
    pos = context

    def numpy_step():
        for layer in range(LAYERS):
            store[layer, 0, :, pos] = k[0]
            store[layer, 1, :, pos] = v[0]
            store[layer, 0, :, : pos + 1]
            store[layer, 1, :, : pos + 1]

    return best_of(kvrs_step, 7, 300), best_of(numpy_step, 7, 300)


def prefill(tokens: int):
    """Times a `tokens`-token float16 append into one layer against a NumPy copy of the same bytes."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((tokens, HEADS, DIM)).astype(np.float16)
    v = rng.standard_normal((tokens, HEADS, DIM)).astype(np.float16)
    cache = kvrs.KVCache(1, HEADS, DIM, tokens, dtype="float16")

    def kvrs_prefill():
        cache.clear()
        cache.append(0, k, v)

    dst_k, dst_v = np.empty_like(k), np.empty_like(v)

    def numpy_copy():
        np.copyto(dst_k, k)
        np.copyto(dst_v, v)

    nbytes = k.nbytes + v.nbytes
    t_kvrs = best_of(kvrs_prefill, 9, 20)
    t_np = best_of(numpy_copy, 9, 20)
    return nbytes / t_kvrs / 1e9, nbytes / t_np / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096, help="prefill length (default 4096)")
    args = parser.parse_args()

    print("| workload | kvrs | NumPy | ratio | target |")
    print("|---|---|---|---|---|")
    for context in (1024, 4096):
        t_k, t_n = decode_step(8192, context)
        print(
            f"| decode step, 32 layers x 8 heads x 128, fp16, context {context} "
            f"| {t_k * 1e6:.1f} us | {t_n * 1e6:.1f} us | {t_k / t_n:.2f}x NumPy time | <= 2x |"
        )
    bw_k, bw_n = prefill(args.tokens)
    print(
        f"| prefill append, {args.tokens} tokens x 8 heads x 128, fp16 "
        f"| {bw_k:.2f} GB/s | {bw_n:.2f} GB/s | {bw_k / bw_n:.0%} of NumPy copy | >= 70% |"
    )


if __name__ == "__main__":
    main()
