"""Prefix hashing and matching: kvrs against vLLM's two hashing schemes, in one process.

A 32k-token prompt (2048 blocks of 16) whose blocks are all cached. kvrs:
`pool.match_prefix(tokens)` (hash every block in Rust, look each up). Peers, written the
way vLLM's `hash_block_tokens` does it: `sha256(pickle.dumps((parent, block_tokens,
extra_keys)))` (its default) and `xxh3_128` of the same pickle, each followed by a dict
lookup. Prints tokens per second and ratios as a markdown table. Run: `make bench`.
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


def measure() -> dict[str, float]:
    """Tokens per second of each scheme on a 32k-token prompt whose blocks are all cached."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, TOKENS, dtype=np.int64)
    as_list = tokens.tolist()
    probe = np.append(tokens, 1)  # one more token, so every block of the prompt can hit
    rates = {}
    for kind in ("blake3", "xxh3"):
        pool = kvrs.BlockPool(1, 1, 1, block_size=BS, num_blocks=TOKENS // BS + 1, hash=kind, seed=0)
        seq = pool.new_sequence(tokens=tokens)
        seq.set_seq_len(TOKENS)  # registers all 2048 blocks
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


if __name__ == "__main__":
    main()
