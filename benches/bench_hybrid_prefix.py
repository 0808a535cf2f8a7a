"""Prefix caching for a hybrid model's pool: state checkpoints against no prefix cache,
and their memory against vLLM's rule (one state per cached block), on one workload.

1,000 requests over 8 shared system prompts (lengths 301 to 1,201 tokens: none a
multiple of the block size), each with its own question (16 to 128 tokens) and 8 decode
tokens, arriving in a random order, run one at a time through a pool shaped like a
small hybrid model (4 attention layers, 2 KV heads x 64, float16; 12 state layers, each a
float32 recurrent state of 8 x 32 x 32 and a bfloat16 convolution state of 1,024 x 4).
The model is replaced by writes of the same sizes (the K/V of every computed token, the
states once per chunk), so the time is the cache's own work; a request's prefill ends a
chunk where the pool asks (`checkpoint_due`, the branch point), as `generate_batch` does.

Reported per pool: prompt tokens hit (not computed), time per request (the cache's work
alone: a pool with checkpoints copies states and hashes chunks a pool without a prefix
cache does not), and the state memory that holds the checkpoints: kvrs's checkpoint
slots in use at their peak (`--checkpoints`, default 64), against
what vLLM's `--mamba-cache-mode all` keeps for the same cached blocks (one state per
cached block). Run: `python benches/bench_hybrid_prefix.py` (`--requests N`).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvrs

BS = 16
LAYERS, HEADS, DIM = 4, 2, 64
STATE_LAYERS = 12
SHAPES = {"recurrent": (8, 32, 32), "conv": (1024, 4)}
DTYPES = {"recurrent": "float32", "conv": "bfloat16"}
SYSTEM_LENS = [301, 517, 733, 1011, 420, 650, 881, 1201]


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """The prompts, and the prompt tokens a cache hitting only at block ends (vLLM's
    Mamba cache modes) would hit: every request after the first of its system prompt
    hits that prompt's whole blocks."""
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(1000, 30000, size=m)) for m in SYSTEM_LENS]
    out, seen, block_hits = [], set(), 0
    for i in range(n):
        which = int(rng.integers(len(systems)))
        q = list(rng.integers(30000, 60000, size=int(rng.integers(16, 129))))
        out.append([int(t) for t in systems[which] + q] + [i])
        if which in seen:
            block_hits += SYSTEM_LENS[which] // BS * BS
        seen.add(which)
    return out, block_hits


def pool(prefix: bool, checkpoints: int) -> kvrs.BlockPool:
    return kvrs.BlockPool(
        LAYERS,
        HEADS,
        DIM,
        block_size=BS,
        num_blocks=2048,
        dtype="float16",
        prefix_caching=prefix,
        state_layers=STATE_LAYERS,
        state_shapes=SHAPES,
        state_dtype=DTYPES,
        state_slots=1,
        state_checkpoints=checkpoints if prefix else None,
    )


def state_bytes() -> int:
    per = {"float32": 4, "bfloat16": 2}
    return STATE_LAYERS * sum(int(np.prod(s)) * per[DTYPES[k]] for k, s in SHAPES.items())


def run_chunk(seq: kvrs.Sequence, tokens: list[int], upto: int, kv: np.ndarray) -> None:
    """What a model's forward leaves: every state layer's state, each layer's K/V."""
    n = upto - seq.seq_len
    for layer in range(STATE_LAYERS):
        st = seq.state(layer)
        st["recurrent"][...] = float(tokens[upto - 1] % 97)
        st["conv"][...] = float(upto % 13)
    for layer in range(LAYERS):
        seq.append(layer, kv[:n], kv[:n])
    seq.advance(n, tokens=tokens[seq.seq_len : upto])


def serve(p: kvrs.BlockPool, prompts: list[list[int]]) -> dict[str, float]:
    kv = np.ones((2048, HEADS, DIM), np.float16)
    hit = total = 0
    peak_ckpt = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        seq = p.new_sequence(tokens=prompt)
        hit += seq.seq_len
        total += len(prompt)
        while seq.seq_len < len(prompt):
            due = seq.checkpoint_due
            run_chunk(seq, prompt, due if due else len(prompt), kv)
        tokens = list(prompt)
        for t in range(8):
            tokens.append(70000 + t)
            run_chunk(seq, tokens, len(tokens), kv)
        seq.free()
        if i % 50 == 0:
            peak_ckpt = max(peak_ckpt, p.stats().get("state_checkpoints_used", 0))
    elapsed = time.perf_counter() - start
    st = p.stats()
    peak_ckpt = max(peak_ckpt, st.get("state_checkpoints_used", 0))
    return {
        "hit": hit,
        "total": total,
        "ms_per_request": 1e3 * elapsed / len(prompts),
        "peak_checkpoints": peak_ckpt,
        "cached_blocks": st["cached_blocks"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--checkpoints", type=int, default=64, help="the pool's state_checkpoints")
    args = ap.parse_args()
    prompts, block_hits = workload(args.requests)
    rows = {}
    for name, prefix in (("checkpoints", True), ("none", False)):
        rows[name] = serve(pool(prefix, args.checkpoints), prompts)
    ck, no = rows["checkpoints"], rows["none"]
    mib = state_bytes() / 2**20
    print(f"{args.requests} requests over {len(SYSTEM_LENS)} system prompts, blocks of {BS}")
    print(f"one state (every state layer of a sequence): {mib:.2f} MiB")
    print()
    print("| pool | prompt tokens hit | computed | time per request | state memory for the prefixes |")
    print("|---|---|---|---|---|")
    print(
        f"| kvrs, checkpoints | {ck['hit']:,} of {ck['total']:,} ({ck['hit'] / ck['total']:.0%}) | "
        f"{ck['total'] - ck['hit']:,} | {ck['ms_per_request']:.2f} ms | "
        f"{ck['peak_checkpoints']} of {args.checkpoints} checkpoint slots at the peak: "
        f"{ck['peak_checkpoints'] * mib:.1f} MiB |"
    )
    print(
        f"| kvrs, no prefix cache | {no['hit']:,} of {no['total']:,} | {no['total'] - no['hit']:,} | "
        f"{no['ms_per_request']:.2f} ms | none |"
    )
    print(
        f"| vLLM's rule (a state per cached block) | {block_hits:,} (block ends only) | "
        f"{ck['total'] - block_hits:,} | | "
        f"{ck['cached_blocks']:,} cached blocks: {ck['cached_blocks'] * mib:,.1f} MiB |"
    )


if __name__ == "__main__":
    main()
