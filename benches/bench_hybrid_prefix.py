"""Prefix caching for a hybrid model's pool: state checkpoints against no prefix cache,
and hits and memory against the peers' rules (vLLM's `all` and `align` modes, SGLang's
per-node states), on one workload of requests served one at a time.

1,000 requests over 8 shared system prompts (lengths 301 to 1,201 tokens: none a
multiple of the block size), each with its own question (16 to 128 tokens) and 8 decode
tokens, arriving in a random order, run one at a time through a pool shaped like a
small hybrid model (4 attention layers, 2 KV heads x 64, float16; 12 state layers, each a
float32 recurrent state of 8 x 32 x 32 and a bfloat16 convolution state of 1,024 x 4).
The model is replaced by writes of the same sizes (the K/V of every computed token, the
states once per chunk), so the time is the cache's own work; a request's prefill ends a
chunk where the pool asks (`checkpoint_due`: every `checkpoint_interval` tokens, the
prompt's last block boundary, the branch point), as `generate_batch` does.

The peers' rows are their documented rules applied to the same request sequence (their
managers are not run here): vLLM `--mamba-cache-mode all` keeps a state at every block
boundary (hits at block ends: every request after the first of its system prompt hits
the prompt's whole blocks; a state per cached block); `align` keeps the state at each
prefill's last aligned chunk end (blocks of B = the interval's tokens), so a request hits
an earlier one's aligned state only where it lies inside their common prefix; SGLang's
MambaRadixCache keeps a state per tree node (at each prompt's end) and, when a request
splits a node without a state, one at the branching point aligned to its chunk of 64
tokens, so the third request of a system prompt hits it (the second recomputes it).

Reported per pool: prompt tokens hit (not computed), time per request (the cache's work
alone: a pool with checkpoints copies states and hashes chunks a pool without a prefix
cache does not), and the state memory that holds the checkpoints: kvrs's checkpoint
slots in use at their peak (`--checkpoints`, default 64), against
what vLLM's `--mamba-cache-mode all` keeps for the same cached blocks (one state per
cached block). The second request of each system prompt is reported apart: a chat
service's second request. Run: `python benches/bench_hybrid_prefix.py` (`--requests N`,
`--interval T`).
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


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The prompts (a system prompt, a question, a unique token) and each one's system
    prompt."""
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(1000, 30000, size=m)) for m in SYSTEM_LENS]
    out, which = [], []
    for i in range(n):
        k = int(rng.integers(len(systems)))
        q = list(rng.integers(30000, 60000, size=int(rng.integers(16, 129))))
        out.append([int(t) for t in systems[k] + q] + [i])
        which.append(k)
    return out, which


def peer_rules(prompts: list[list[int]], which: list[int], interval: int) -> dict[str, dict[str, int]]:
    """Hit tokens (all requests, and the second of each system prompt) and states kept by
    the peers' rules on the same sequence (see the module)."""
    rules = {name: {"hit": 0, "second": 0, "states": 0} for name in ("all", "align", "sglang")}
    aligned: dict[int, list[int]] = {}  # system prompt -> aligned chunk ends stored
    seen: dict[int, int] = {}
    for prompt, k in zip(prompts, which, strict=True):
        s, n = SYSTEM_LENS[k], seen.get(k, 0)
        hits = {
            "all": s // BS * BS if n else 0,
            "align": max((p for p in aligned.get(k, []) if p <= s), default=0),
            "sglang": s // 64 * 64 if n >= 2 else 0,
        }
        for name, h in hits.items():
            rules[name]["hit"] += h
            rules[name]["second"] += h if n == 1 else 0
        aligned.setdefault(k, []).append(len(prompt) // interval * interval)
        rules["align"]["states"] += 1
        rules["sglang"]["states"] += 1 + (n == 1)
        seen[k] = n + 1
    return rules


def pool(prefix: bool, checkpoints: int, interval: int) -> kvrs.BlockPool:
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
        checkpoint_interval=interval if prefix else None,
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


def serve(p: kvrs.BlockPool, prompts: list[list[int]], which: list[int]) -> dict[str, float]:
    kv = np.ones((2048, HEADS, DIM), np.float16)
    hit = total = second = 0
    seen: dict[int, int] = {}
    peak_ckpt = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        seq = p.new_sequence(tokens=prompt)
        hit += seq.seq_len
        total += len(prompt)
        if seen.get(which[i], 0) == 1:
            second += seq.seq_len
        seen[which[i]] = seen.get(which[i], 0) + 1
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
        "second": second,
        "total": total,
        "ms_per_request": 1e3 * elapsed / len(prompts),
        "peak_checkpoints": peak_ckpt,
        "cached_blocks": st["cached_blocks"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--checkpoints", type=int, default=64, help="the pool's state_checkpoints")
    ap.add_argument("--interval", type=int, default=256, help="the pool's checkpoint_interval")
    args = ap.parse_args()
    prompts, which = workload(args.requests)
    rows = {}
    for name, prefix in (("checkpoints", True), ("none", False)):
        rows[name] = serve(pool(prefix, args.checkpoints, args.interval), prompts, which)
    ck, no = rows["checkpoints"], rows["none"]
    peers = peer_rules(prompts, which, args.interval)
    seconds = sum(SYSTEM_LENS[k] for k in set(which) if which.count(k) > 1)
    mib = state_bytes() / 2**20
    print(f"{args.requests} requests over {len(SYSTEM_LENS)} system prompts, one at a time, blocks of {BS}")
    print(f"one state (every state layer of a sequence): {mib:.2f} MiB; checkpoint_interval {args.interval}")
    print()
    print(
        "| pool | prompt tokens hit | 2nd request of each system prompt: hit | computed | "
        "time per request | state memory for the prefixes |"
    )
    print("|---|---|---|---|---|---|")

    def pct(h: int, of: int) -> str:
        return f"{h:,} ({h / of:.0%})"

    print(
        f"| kvrs, checkpoints | {pct(ck['hit'], ck['total'])} | {pct(ck['second'], seconds)} | "
        f"{ck['total'] - ck['hit']:,} | {ck['ms_per_request']:.2f} ms | "
        f"{ck['peak_checkpoints']} of {args.checkpoints} checkpoint slots at the peak: "
        f"{ck['peak_checkpoints'] * mib:.1f} MiB |"
    )
    computed = no["total"] - no["hit"]
    print(f"| kvrs, no prefix cache | 0 | 0 | {computed:,} | {no['ms_per_request']:.2f} ms | none |")
    labels = {
        "all": ("vLLM `all` (a state per cached block)", ck["cached_blocks"], "cached blocks"),
        "align": (f"vLLM `align` (B = {args.interval})", peers["align"]["states"], "states stored"),
        "sglang": ("SGLang per-node states", peers["sglang"]["states"], "states stored"),
    }
    for name, (label, states, what) in labels.items():
        r = peers[name]
        print(
            f"| {label} | {pct(r['hit'], ck['total'])} | {pct(r['second'], seconds)} | "
            f"{ck['total'] - r['hit']:,} | | {states:,} {what}: {states * mib:,.1f} MiB before eviction |"
        )


if __name__ == "__main__":
    main()
