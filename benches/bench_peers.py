"""kvrs against the real cache managers of vLLM and SGLang, in one process: `make bench-peers`.

The peers are the released wheels' own code (vLLM 0.33.0's v1 `KVCacheManager`, SGLang
0.5.23's `RadixCache`), downloaded and imported by benches/peers.py without their engines.
Prints markdown tables of ratios; every row is measured side by side in this run.

1. Decode scheduling step, 256 sequences (benches/bench_paged.py): kvrs `reserve` +
   `page_table` against vLLM's `allocate_slots` for each request + the same page table.
2. Prefix lookups, blocks of 16 tokens, every block cached, tokens per second of lookup:
   - a 32k-token prompt (2048 blocks);
   - a 4k-token chat prompt (a 2k-token system prompt shared by 256 cached conversations,
     then 2k tokens of its own conversation).
   kvrs: `pool.match_prefix(tokens)` (hashes every block, BLAKE3, and looks each up). vLLM:
   a `Request` with its block hasher (sha256 of each pickled block, its default; vLLM
   hashes when a request enters the engine) and `get_computed_blocks` (the lookup).
   SGLang: `match_prefix` of a `RadixKey` (a radix tree of token ids: no hashing), pages
   of 1 token (its default) and of 16.
"""

from __future__ import annotations

import sys
import time
from array import array
from pathlib import Path

import numpy as np
import torch

import kvrs

sys.path.insert(0, str(Path(__file__).parent))
import bench_paged
import peers

BS = 16


def kvrs_pool(prompts: list[list[int]]) -> kvrs.BlockPool:
    """A prefix-caching pool (BLAKE3, the default) holding every whole block of `prompts`."""
    blocks = sum(len(p) // BS + 1 for p in prompts)
    pool = kvrs.BlockPool(1, 1, 8, block_size=BS, num_blocks=blocks, dtype="float16", seed=0)
    for tokens in prompts:
        seq = pool.new_sequence(tokens=tokens)
        n = len(tokens) - seq.num_cached_tokens
        pool.reserve([seq], [n])
        seq.advance(n)
        seq.free()
    return pool


def vllm_manager(prompts: list[list[int]]):
    """vLLM's manager (prefix caching on) holding every whole block of `prompts`, and its hasher."""
    hasher = peers.vllm_block_hasher(BS)
    mgr = peers.vllm_manager(sum(len(p) // BS + 1 for p in prompts) + 1, BS, caching=True)
    for i, tokens in enumerate(prompts):
        r = peers.vllm_request(f"fill-{i}", tokens, hasher)
        hit_blocks, hit, *_ = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, len(tokens) - hit, hit, hit_blocks) is not None
        r.num_computed_tokens = len(tokens)
        mgr.free(r)
    return mgr, hasher


def sglang_cache(prompts: list[list[int]], page: int):
    """SGLang's radix cache holding every prompt (its token ids as their KV indices)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = peers.sglang_cache(page)
    for tokens in prompts:
        value = torch.tensor(tokens, dtype=torch.int64)
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))
    return cache


def lookups(prompts: list[list[int]], queries: list[list[int]], hit: int) -> dict[str, float]:
    """Tokens per second of looking up each of `queries` (each finds `hit` tokens cached),
    per implementation, in a cache holding `prompts`."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    # One more token each, so that the last whole block can hit (a prompt's last token is
    # always computed).
    probes = [[*q, 1] for q in queries]
    total = hit * len(probes)
    pool = kvrs_pool(prompts)
    mgr, hasher = vllm_manager(prompts)
    caches = {page: sglang_cache(prompts, page) for page in (1, BS)}

    def kvrs_lookup():
        return [pool.match_prefix(p) for p in probes]

    def vllm_lookup():
        return [mgr.get_computed_blocks(peers.vllm_request("q", p, hasher))[1] for p in probes]

    def sglang_lookup(page):
        return lambda: [
            caches[page].match_prefix(MatchPrefixParams(key=RadixKey(array("q", p)))).device_prefix_len
            for p in probes
        ]

    runs = {
        "kvrs match_prefix (BLAKE3)": kvrs_lookup,
        f"vLLM {peers.VLLM_VERSION} (sha256 block hashes + get_computed_blocks)": vllm_lookup,
        f"SGLang {peers.SGLANG_VERSION} RadixCache.match_prefix, page 1": sglang_lookup(1),
        f"SGLang {peers.SGLANG_VERSION} RadixCache.match_prefix, page {BS}": sglang_lookup(BS),
    }
    for name, run in runs.items():
        assert run() == [hit] * len(probes), name
    # The implementations take turns, and each keeps its least time (the machine is shared).
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(7):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: total / min(t) for name, t in times.items()}


def prefix_rows() -> list[str]:
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(0, 128_000, 32768).tolist()
    system = rng.integers(0, 128_000, 2048).tolist()
    chats = [system + rng.integers(0, 128_000, 2048).tolist() for _ in range(256)]
    rows = []
    for label, prompts, queries, hit in (
        ("32k-token prompt", [long_prompt], [long_prompt], 32768),
        ("4k-token chat prompt, 256 cached conversations", chats, chats[:32], 4096),
    ):
        rates = lookups(prompts, queries, hit)
        ours = rates.pop("kvrs match_prefix (BLAKE3)")
        for peer, rate in rates.items():
            rows.append(
                f"| {label}: kvrs match_prefix vs {peer} | {ours / 1e6:.1f} M tok/s "
                f"| {rate / 1e6:.2f} M tok/s | **{ours / rate:.1f}x** |"
            )
    return rows


def main() -> None:
    peers.load()
    print("| workload | kvrs | peer | ratio | target |")
    print("|---|---|---|---|---|")
    for row in bench_paged.scheduling_rows():
        print(row)
    print()
    print("| prefix lookup, every block cached | kvrs | peer | kvrs / peer |")
    print("|---|---|---|---|")
    for row in prefix_rows():
        print(row)
    peers.check_untouched()


if __name__ == "__main__":
    main()
