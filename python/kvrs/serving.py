"""The serving part of the demo: chat requests that share a system prompt, arriving at
different times, continuously batched through one :class:`kvrs.BlockPool` with prefix
caching, and checked against recomputation without a cache.

Every step places one batch with ``start_forward``: the uncached rest of each newly
arrived prompt (prefill) beside one token of each running request (decode), with each
token's id. The model writes K/V with ``batch.put`` and attends over ``batch.get``'s
history with its mask; ``batch.finish`` commits, which caches every block the batch
filled. A finished request frees its sequence: its blocks stay cached (evictable) and
serve the system prompt of later requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

import kvrs
from kvrs.demo import ModelConfig, TinyLlama, recompute


@dataclass
class Request:
    """A chat request: its prompt, when it arrives and how many tokens it generates."""

    rid: int
    prompt: list[int]
    arrival: int
    max_new: int
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    cached: int = 0


def make_requests(cfg: ModelConfig, n: int, system_len: int, new_tokens: int, seed: int) -> list[Request]:
    """`n` requests: a shared system prompt, then a question of 8 to 40 tokens each."""
    rng = np.random.default_rng(seed + 2)
    system = rng.integers(0, cfg.vocab, system_len).tolist()
    return [
        Request(
            rid=i,
            prompt=system + rng.integers(0, cfg.vocab, int(rng.integers(8, 41))).tolist(),
            arrival=int(i * 3),
            max_new=int(rng.integers(new_tokens // 2, new_tokens + 1)),
        )
        for i in range(n)
    ]


def serve(model: TinyLlama, pool: kvrs.BlockPool, requests: list[Request]) -> dict[str, float]:
    """Runs every request to completion; returns counters of the run."""
    pending = sorted(requests, key=lambda r: r.arrival)
    running: list[tuple[Request, kvrs.Sequence]] = []
    step, tokens_computed, peak_used = 0, 0, 0
    while pending or running:
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            seq = pool.new_sequence(tokens=r.prompt)
            r.cached = seq.num_cached_tokens
            r.tokens = list(r.prompt)
            running.append((r, seq))
        seqs: list[kvrs.Sequence] = []
        ids: list[int] = []
        last: list[int] = []
        for r, seq in running:
            todo = r.tokens[seq.seq_len :]  # the uncached prompt, or the one token generated last
            seqs += [seq] * len(todo)
            ids += todo
            last.append(len(ids) - 1)
        if ids:
            # Positions default to where each sequence continues.
            with pool.start_forward(seqs, tokens=ids) as batch:

                def through_pool(layer, k, v, batch=batch):
                    batch.put(layer, k, v)
                    return batch.get(layer)

                logits = model.forward(np.array(ids), batch.positions, through_pool)
            tokens_computed += len(ids)
            peak_used = max(peak_used, pool.stats()["used_blocks"])
            for (r, _), i in zip(running, last, strict=True):
                r.logits.append(logits[i])
                if len(r.tokens) - len(r.prompt) < r.max_new:
                    r.tokens.append(int(logits[i].argmax()))
        for r, seq in [(r, s) for r, s in running if len(r.tokens) - len(r.prompt) >= r.max_new]:
            seq.free()  # its blocks stay cached for the next requests
            running.remove((r, seq))
        step += 1
    return {"steps": step, "tokens_computed": tokens_computed, "peak_used_blocks": peak_used}


def run(requests_n: int, system_len: int, new_tokens: int, dtype: str, seed: int) -> int:
    """Runs the serving workload and its check; returns the exit code."""
    cfg = ModelConfig()
    model = TinyLlama(cfg, seed)
    requests = make_requests(cfg, requests_n, system_len, new_tokens, seed)
    pool = kvrs.BlockPool(
        cfg.layers, cfg.kv_heads, cfg.head_dim, block_size=16, memory_bytes="4MiB", dtype=dtype
    )
    print(f"\nserving {requests_n} chat requests through {pool!r}")
    t0 = time.perf_counter()
    counters = serve(model, pool, requests)
    elapsed = time.perf_counter() - t0
    st = pool.stats()
    served = sum(len(r.prompt) + r.max_new for r in requests)
    print(f"{'request':>7} {'arrives':>7} {'prompt':>6} {'cached':>6} {'generated':>9}")
    for r in requests:
        print(
            f"{r.rid:>7} {r.arrival:>7} {len(r.prompt):>6} {r.cached:>6} {len(r.tokens) - len(r.prompt):>9}"
        )
    print(
        f"pool: {st['num_blocks']} blocks, peak {counters['peak_used_blocks']} used, "
        f"{st['cached_blocks']} cached at the end; prefix hit rate {st['hit_rate']:.0%} "
        f"({st['prefix_hit_tokens']} of {st['prefix_query_tokens']} prompt tokens)"
    )
    print(
        f"computed {counters['tokens_computed']} of {served} tokens in {counters['steps']} steps, "
        f"{served / elapsed:,.0f} tokens/s"
    )
    np_dtype = pool.kv_cache(0).dtype
    worst, same = 0.0, True
    for r in requests:
        expected = recompute(model, r.tokens, len(r.prompt), np_dtype)[: len(r.logits)]
        got = np.stack(r.logits)
        worst = max(worst, float(np.abs(expected - got).max() / np.abs(expected).max()))
        same &= [int(x) for x in expected.argmax(-1)] == r.tokens[len(r.prompt) :][: len(expected)]
    print(
        "check against recomputation of each request alone, without a cache: "
        f"max relative logit diff {worst:.1e}, tokens {'identical' if same else 'DIFFER'}"
    )
    if worst > 1e-3 or not same:
        print("FAILED: served outputs differ from recomputation")
        return 1
    print("OK")
    return 0
