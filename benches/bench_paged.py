"""kvrs.BlockPool against a vLLM-style pure-Python block manager and NumPy, in one process.

1. Decode scheduling step for 256 sequences: a slot for one new token in each, then the
   slot mapping and FlashInfer's page table. kvrs: `pool.reserve(seqs, counts)` +
   `pool.page_table(seqs)`; and the full batched path `start_forward` + `page_table` +
   `finish`. Peer: benches/vllm_style_manager.py (vLLM v1's design in Python).
2. Gather of a 4096-token sequence (8 KV heads x 128, float16) into contiguous K/V with
   `seq.get(layer, out=...)`, against a NumPy copy of the same bytes.

Run: `make bench`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

import kvrs

sys.path.insert(0, str(Path(__file__).parent))
from vllm_style_manager import BlockManager

SEQS, PROMPT, STEPS, BS = 256, 100, 200, 16


def timed(setup, step, repeat=5):
    """Median seconds per step over `repeat` fresh runs of STEPS steps."""
    times = []
    for _ in range(repeat):
        state = setup()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step(state)
        times.append((time.perf_counter() - t0) / STEPS)
    return statistics.median(times)


def kvrs_setup():
    pool = kvrs.BlockPool(1, 1, 8, block_size=BS, num_blocks=SEQS * 24, dtype="float16")
    seqs = [pool.new_sequence() for _ in range(SEQS)]
    pool.reserve(seqs, [PROMPT] * SEQS)
    for s in seqs:
        s.advance(PROMPT)
    return pool, seqs, np.ones(SEQS, np.int64), np.full(SEQS, PROMPT, np.int64)


def kvrs_reserve_step(state):
    pool, seqs, ones, _ = state
    pool.reserve(seqs, ones)
    pool.page_table(seqs)


def kvrs_forward_step(state):
    pool, seqs, _, positions = state
    batch = pool.start_forward(seqs, positions)
    pool.page_table(seqs)
    batch.finish()
    positions += 1


def python_setup():
    mgr = BlockManager(SEQS * 24, BS)
    ids = list(range(SEQS))
    for r in ids:
        mgr.add_request(r)
        mgr.allocate_slots(r, PROMPT)
    return mgr, ids


def python_step(state):
    mgr, ids = state
    mgr.schedule_decode(ids)


def gather(layout: str, tokens=4096, heads=8, dim=128):
    pool = kvrs.BlockPool(
        1, heads, dim, block_size=BS, num_blocks=tokens // BS + 1, dtype="float16", layout=layout
    )
    seq = pool.new_sequence()
    x = np.random.default_rng(0).standard_normal((tokens, heads, dim)).astype(np.float16)
    seq.append(0, x, x)
    out = (np.empty((heads, tokens, dim), np.float16), np.empty((heads, tokens, dim), np.float16))
    # The peer copies the same bytes between as many distinct arrays (K and V sources,
    # K and V destinations), so both sides move through the same working set.
    src = (x.copy(), x.copy())
    dst = (np.empty_like(x), np.empty_like(x))
    nbytes = 2 * out[0].nbytes

    def kv():
        seq.get(0, out=out)

    def copy():
        np.copyto(dst[0], src[0])
        np.copyto(dst[1], src[1])

    t_k = min(timeit(kv) for _ in range(9))
    t_n = min(timeit(copy) for _ in range(9))
    return nbytes / t_k / 1e9, nbytes / t_n / 1e9


def timeit(fn, number=20):
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def main() -> None:
    t_py = timed(python_setup, python_step)
    t_reserve = timed(kvrs_setup, kvrs_reserve_step)
    t_forward = timed(kvrs_setup, kvrs_forward_step)
    print("| workload | kvrs | peer | ratio | target |")
    print("|---|---|---|---|---|")
    print(
        f"| decode scheduling step, 256 sequences: reserve + page_table | {t_reserve * 1e6:.1f} us "
        f"| {t_py * 1e6:.1f} us (vLLM-style Python manager) | **{t_py / t_reserve:.0f}x** faster | >= 20x |"
    )
    print(
        f"| same, batched path: start_forward + page_table + finish | {t_forward * 1e6:.1f} us "
        f"| {t_py * 1e6:.1f} us | **{t_py / t_forward:.0f}x** faster | - |"
    )
    for layout in ("NHD", "HND"):
        bw_k, bw_n = gather(layout)
        print(
            f"| gather 4096 tokens x 8 heads x 128 fp16 ({layout}) into contiguous K/V | {bw_k:.1f} GB/s "
            f"| {bw_n:.1f} GB/s (NumPy copy) | **{bw_k / bw_n:.0%}** of copy bandwidth | >= 70% |"
        )


if __name__ == "__main__":
    main()
