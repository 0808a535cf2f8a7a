"""kvrs.BlockPool against vLLM v1's KVCacheManager and NumPy, in one process.

1. Decode scheduling step for 256 sequences: a slot for one new token in each, then the
   slot mapping and FlashInfer's page table. kvrs: `pool.reserve(seqs, counts)` +
   `pool.page_table(seqs)`; and the full batched path `start_forward` + `page_table` +
   `finish`. Peer: vLLM 0.33's real `KVCacheManager` (benches/peers.py, unpacked by `make
   bench-peers`; without it these rows are left out): `allocate_slots(request, 1)` for each
   request and the request's step bookkeeping (`num_computed_tokens`, the output token), then
   the same slot mapping and page table built with NumPy from `get_block_ids`. Prefix caching
   is off on both sides (no block hashing).
2. Gather of a 4096-token sequence (8 KV heads x 128, float16) into contiguous K/V with
   `seq.get(layer, out=...)`, against a NumPy copy of the same bytes.

Run: `make bench` (the gather rows), `make bench-peers` (every row).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

import kvrs

sys.path.insert(0, str(Path(__file__).parent))
import peers

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


def kvrs_reserve_only(state):
    pool, seqs, ones, _ = state
    pool.reserve(seqs, ones)


def kvrs_forward_step(state):
    pool, seqs, _, positions = state
    batch = pool.start_forward(seqs, positions)
    pool.page_table(seqs)
    batch.finish()
    positions += 1


def vllm_setup():
    """256 running requests of PROMPT tokens in vLLM's KVCacheManager, as its scheduler leaves
    them after their prefill."""
    mgr = peers.vllm_manager(SEQS * 24, BS, caching=False)
    reqs = [peers.vllm_request(str(i), list(range(PROMPT))) for i in range(SEQS)]
    for r in reqs:
        assert mgr.allocate_slots(r, PROMPT) is not None
        r.num_computed_tokens += PROMPT
    return mgr, reqs


def vllm_allocate(state):
    """vLLM's scheduler for one decode step: a slot for one token per request."""
    mgr, reqs = state
    for r in reqs:
        if mgr.allocate_slots(r, 1) is None:
            raise MemoryError("pool full")
        r.num_computed_tokens += 1
        r.append_output_token_ids(0)


def vllm_step(state):
    """`vllm_allocate`, then the slot mapping and FlashInfer's page table of every request,
    from the manager's block ids."""
    vllm_allocate(state)
    mgr, reqs = state
    slots, indices, indptr, last = [], [], [0], []
    for r in reqs:
        (blocks,) = mgr.get_block_ids(r.request_id)
        pos = r.num_computed_tokens - 1
        slots.append(blocks[pos // BS] * BS + pos % BS)
        indices.extend(blocks)
        indptr.append(len(indices))
        last.append(pos % BS + 1)
    return (
        np.array(slots, np.int64),
        np.array(indptr, np.int32),
        np.array(indices, np.int32),
        np.array(last, np.int32),
    )


def interleaved(runs: dict, rounds: int = 5) -> dict[str, float]:
    """Seconds per step of each `(setup, step)` in `runs`: the least over `rounds` fresh runs
    of STEPS steps, the implementations taking turns (the machine is shared: what is compared
    is measured side by side, and the least is the run the least disturbed)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (setup, step) in runs.items():
            times[name].append(timed(setup, step, repeat=1))
    return {name: min(t) for name, t in times.items()}


def scheduling_rows() -> list[str]:
    """The decode scheduling rows against vLLM, measured side by side (needs the peers)."""
    t = interleaved(
        {
            "vllm": (vllm_setup, vllm_step),
            "alloc": (vllm_setup, vllm_allocate),
            "reserve": (kvrs_setup, kvrs_reserve_step),
            "reserve_only": (kvrs_setup, kvrs_reserve_only),
            "forward": (kvrs_setup, kvrs_forward_step),
        }
    )
    t_vllm, t_alloc, t_reserve, t_reserve_only, t_forward = (
        t[k] for k in ("vllm", "alloc", "reserve", "reserve_only", "forward")
    )
    peers.check_untouched()
    peer = f"vLLM {peers.VLLM_VERSION} KVCacheManager"
    return [
        f"| decode scheduling step, 256 sequences: reserve + page_table | {t_reserve * 1e6:.0f} us "
        f"| {t_vllm * 1e6:.0f} us ({peer}: allocate_slots + page table) "
        f"| **{t_vllm / t_reserve:.0f}x** faster | >= 20x |",
        f"| same, batched path: start_forward + page_table + finish | {t_forward * 1e6:.0f} us "
        f"| {t_vllm * 1e6:.0f} us | **{t_vllm / t_forward:.0f}x** faster | - |",
        f"| slots only, 256 sequences: reserve | {t_reserve_only * 1e6:.0f} us "
        f"| {t_alloc * 1e6:.0f} us ({peer}: allocate_slots) "
        f"| **{t_alloc / t_reserve_only:.0f}x** faster | - |",
    ]


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
    print("| workload | kvrs | peer | ratio | target |")
    print("|---|---|---|---|---|")
    if peers.available():
        for row in scheduling_rows():
            print(row)
    for layout in ("NHD", "HND"):
        bw_k, bw_n = gather(layout)
        print(
            f"| gather 4096 tokens x 8 heads x 128 fp16 ({layout}) into contiguous K/V | {bw_k:.1f} GB/s "
            f"| {bw_n:.1f} GB/s (NumPy copy) | **{bw_k / bw_n:.0%}** of copy bandwidth | >= 70% |"
        )
    if not peers.available():
        print("\n(the scheduling rows against vLLM's KVCacheManager need its wheel: `make bench-peers`)")


if __name__ == "__main__":
    main()
