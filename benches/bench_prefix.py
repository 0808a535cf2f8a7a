"""Prefix hashing and matching: kvrs against vLLM's two hashing schemes, in one process.

A 32k-token prompt (2048 blocks of 16) whose blocks are all cached. kvrs:
`pool.match_prefix(tokens)` (hash every block in Rust, look each up). Peers, written the
way vLLM's `hash_block_tokens` does it: `sha256(pickle.dumps((parent, block_tokens,
extra_keys)))` (its default) and `xxh3_128` of the same pickle, each followed by a dict
lookup. Prints tokens per second and ratios as a markdown table.

Then the prefix index's scaling, kvrs against itself: evicting (`evict_all`) 100k cached
one-block prompts, every one a child of the root (siblings), per block against 100k
blocks in chains of 1000; and a lookup of a prompt the cache lacks (`match_prefix`, and
`new_sequence` with a partial hit) with 40k cached one-block prompts against 100. Caches
are filled the way a server fills them: `new_sequence(tokens)`, `reserve`, `advance`.
Run: `make bench`.
"""

from __future__ import annotations

import hashlib
import pickle
import statistics
import time

import numpy as np
import xxhash

import kvrs

TOKENS, BS = 32768, 16


def vllm_style(hash_fn):
    """Hash-and-match as vLLM does it in Python, with `hash_fn` over the pickled tuple."""

    def run(tokens: list[int], cached: dict[bytes, int]) -> int:
        parent = b"seed" * 8
        hits = 0
        for i in range(0, len(tokens) - BS + 1, BS):
            parent = hash_fn(
                pickle.dumps((parent, tuple(tokens[i : i + BS]), None), protocol=pickle.HIGHEST_PROTOCOL)
            )
            if parent not in cached:
                break
            hits += BS
        return hits

    return run


def sha256(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def xxh3(b: bytes) -> bytes:
    return xxhash.xxh3_128_digest(b)


def cached_table(hash_fn, tokens):
    """The dict of every block hash of `tokens` (all cached)."""
    table, parent = {}, b"seed" * 8
    for i in range(0, len(tokens), BS):
        parent = hash_fn(
            pickle.dumps((parent, tuple(tokens[i : i + BS]), None), protocol=pickle.HIGHEST_PROTOCOL)
        )
        table[parent] = i // BS
    return table


def best(fn, repeat=7):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fill(pool: kvrs.BlockPool, prompts) -> None:
    """Caches every whole block of each prompt: the sequence knows its ids
    (`new_sequence(tokens=...)`), reserves and commits its positions, and is freed."""
    for tokens in prompts:
        seq = pool.new_sequence(tokens=tokens)
        n = len(tokens) - seq.num_cached_tokens
        pool.reserve([seq], [n])
        seq.advance(n)
        seq.free()


def root_prompts(n: int, length: int = BS) -> list[list[int]]:
    """`n` distinct prompts, each a child of the root: they differ in their first token."""
    tail = list(range(1, length))
    return [[1_000_000 + i, *tail] for i in range(n)]


def small_pool(num_blocks: int) -> kvrs.BlockPool:
    return kvrs.BlockPool(1, 1, 1, block_size=BS, num_blocks=num_blocks, dtype="float16", seed=0)


def eviction_per_block(prompts) -> float:
    """Seconds per block of `evict_all` over the cached blocks of `prompts`."""
    blocks = sum(len(t) // BS for t in prompts)
    pool = small_pool(blocks)
    fill(pool, prompts)
    assert pool.stats()["evictable_blocks"] == blocks
    t0 = time.perf_counter()
    assert pool.evict_all() == blocks
    return (time.perf_counter() - t0) / blocks


def lookup_calls(cached: int, calls: int = 2000):
    """Two loops of `calls` lookups in a pool caching `cached` root prompts: `match_prefix`
    of a prompt the cache lacks, and `new_sequence` (+ `free`) of a prompt sharing half a
    block with one cached prompt (a partial hit)."""
    pool = small_pool(cached + 8)
    prompts = root_prompts(cached)
    fill(pool, prompts)
    missing = [7, *range(1, 3 * BS)]
    partial = [*prompts[cached // 2][: BS // 2], *range(500, 500 + 2 * BS)]
    assert pool.match_prefix(missing) == 0 and pool.match_prefix(partial) == BS // 2

    def match():
        for _ in range(calls):
            pool.match_prefix(missing)

    def start():
        for _ in range(calls):
            pool.new_sequence(tokens=partial).free()

    return {"match": match, "start": start}, calls


def scaling(rounds: int = 9) -> dict[str, float]:
    """The prefix index's scaling rows: seconds per operation, the least of interleaved
    rounds (the machine is shared; what is compared is measured side by side)."""
    chains = [list(range(c * 16_000, (c + 1) * 16_000)) for c in range(100)]
    times: dict[str, list[float]] = {}
    for _ in range(3):
        times.setdefault("evict siblings", []).append(eviction_per_block(root_prompts(100_000)))
        times.setdefault("evict chains", []).append(eviction_per_block(chains))
    loops = {n: lookup_calls(n) for n in (100, 40_000)}
    for _ in range(rounds):
        for n, (fns, calls) in loops.items():
            for op, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times.setdefault(f"{op} {n}", []).append((time.perf_counter() - t0) / calls)
    return {k: min(v) for k, v in times.items()}


def measure() -> dict[str, float]:
    """Tokens per second of each scheme on a 32k-token prompt whose blocks are all cached."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, TOKENS, dtype=np.int64)
    as_list = tokens.tolist()
    probe = np.append(tokens, 1)  # one more token, so every block of the prompt can hit
    rates = {}
    for kind in ("blake3", "xxh3"):
        pool = kvrs.BlockPool(1, 1, 1, block_size=BS, num_blocks=TOKENS // BS + 1, hash=kind, seed=0)
        fill(pool, [tokens])  # caches all 2048 blocks
        assert pool.match_prefix(probe) == TOKENS
        rates[f"kvrs {kind}"] = TOKENS / best(lambda p=pool: p.match_prefix(probe))
    for name, fn in (("sha256", sha256), ("xxhash", xxh3)):
        table = cached_table(fn, as_list)
        run = vllm_style(fn)
        assert run(as_list, table) == TOKENS
        rates[f"vLLM {name}"] = TOKENS / best(lambda r=run, t=table: r(as_list, t))
    return rates


def main() -> None:
    rates = measure()
    sha, xx = rates["vLLM sha256"], rates["vLLM xxhash"]
    names = {
        "kvrs blake3": "kvrs `match_prefix`, blake3 (default)",
        "kvrs xxh3": "kvrs `match_prefix`, xxh3",
        "vLLM sha256": "vLLM-style Python, sha256 of pickled block tuple",
        "vLLM xxhash": "vLLM-style Python, xxhash of pickled block tuple",
    }
    print("| 32k-token prompt, hash + match every block | tokens/s | vs vLLM sha256 | vs vLLM xxhash |")
    print("|---|---|---|---|")
    for key, label in names.items():
        r = rates[key]
        print(f"| {label} | {r / 1e6:.1f} M | {r / sha:.1f}x | {r / xx:.1f}x |")

    t = scaling()
    print()
    print("| prefix index scaling (kvrs against itself) | time | ratio | target |")
    print("|---|---|---|---|")
    rows = [
        ("`evict_all`, 100k root prompts (siblings), per block", "evict siblings", "evict chains", "chains"),
        ("`evict_all`, 100k blocks in chains of 1000, per block", "evict chains", None, ""),
        ("`match_prefix` of a missing prompt, 40k cached root prompts", "match 40000", "match 100", "100"),
        ("`match_prefix` of a missing prompt, 100 cached root prompts", "match 100", None, ""),
        ("`new_sequence` + `free`, partial hit, 40k cached root prompts", "start 40000", "start 100", "100"),
        ("`new_sequence` + `free`, partial hit, 100 cached root prompts", "start 100", None, ""),
    ]
    for label, key, base, name in rows:
        ratio = f"**{t[key] / t[base]:.2f}x** {name} | <= 2x" if base else "1.00x |"
        print(f"| {label} | {t[key] * 1e6:.2f} us | {ratio} |")


if __name__ == "__main__":
    main()
