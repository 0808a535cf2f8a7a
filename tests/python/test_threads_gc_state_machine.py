"""Random pool operations from several threads at once, with a garbage collection after
every allocation (`gc.set_threshold(1, 1, 1)`) and sequences held only by reference
cycles: nothing hangs (a watchdog kills the run), nothing crashes, every thread reads back
exactly the K/V of its tokens, and the pool's invariants hold at the end.

Hypothesis draws one program of operations per thread; each program runs in a child
interpreter (a hang there fails the test instead of stopping the suite). The threads
share one pool and its prefix cache: the K/V of a position are a function of the tokens
up to it, so a prefix hit on another thread's blocks reads the same values, and any block
that shows another holder's K/V, a torn read or a stale write is caught by the checks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

WATCHDOG_S = 90

CHILD = r"""
import gc, json, sys, threading
import numpy as np
import kvrs

programs = json.loads(sys.argv[1])
gc.set_threshold(1, 1, 1)
H, D, VOCAB = 2, 4, 3
pool = kvrs.BlockPool(2, H, D, block_size=4, num_blocks=96, dtype="float32", seed=7)


def value(h, t):
    # The K/V of a position: a function of the tokens up to it (exact in float32).
    return (h * 31 + t + 1) % 1000003


class Held:
    # A sequence and its model, reachable only through a reference cycle once dropped.
    def __init__(self, seq, tokens):
        self.me = self
        self.seq, self.tokens = seq, list(tokens)

    def values(self):
        out, h = [], 0
        for t in self.tokens:
            h = value(h, t)
            out.append(float(h))
        return out


def kv_of(vals):
    x = np.asarray(vals, np.float32)[:, None, None] * np.ones((1, H, D), np.float32)
    return x, -x


def check(held, where):
    want = held.values()[: held.seq.seq_len]
    for layer in range(2):
        k, v = held.seq.get(layer)
        n = held.seq.seq_len
        got_k, got_v = k[0, :n, 0].tolist(), v[H - 1, :n, D - 1].tolist()
        if got_k != want or got_v != [-x for x in want]:
            raise AssertionError(f"{where}: layer {layer} holds {got_k[:8]}, want {want[:8]}")


def grow(held, new, how):
    # Extends a sequence by the tokens `new`, through one of three write paths; a full
    # pool leaves it as it was.
    start = held.seq.seq_len
    held.tokens = held.tokens[:start] + list(new)
    k, v = kv_of(held.values()[start:])
    n = len(new)
    try:
        if how == 0:
            for layer in range(2):
                held.seq.append(layer, k, v)
            held.seq.advance(n, tokens=new)
        elif how == 1:
            slots = pool.reserve([held.seq], [n])
            for layer in range(2):
                pool.write(layer, k, v, slots)
            held.seq.advance(n, tokens=new)
        else:
            with pool.start_forward([held.seq] * n, tokens=new) as batch:
                for layer in range(2):
                    batch.put(layer, k, v)
    except kvrs.CacheFullError:
        held.seq.remove(start)
        held.tokens = held.tokens[:start]


def run(tid, program, errors):
    rng = np.random.default_rng(tid)
    mine = []
    try:
        for op, arg in program:
            if op == "new" or not mine:
                prompt = [int(x) for x in rng.integers(0, VOCAB, 2 + arg % 9)]
                seq = pool.new_sequence(tokens=prompt)
                held = Held(seq, prompt)
                mine.append(held)
                grow(held, prompt[seq.num_cached_tokens :], arg % 3)
                check(held, "after new")
                continue
            held = mine[arg % len(mine)]
            try:
                if op == "grow":
                    grow(held, [int(x) for x in rng.integers(0, VOCAB, 1 + arg % 5)], arg % 3)
                elif op == "truncate":
                    held.seq.truncate(arg % (held.seq.seq_len + 1))
                elif op == "fork":
                    mine.append(Held(held.seq.fork(), held.tokens))
                elif op == "free":
                    held.seq.free()
                    mine.remove(held)
                    continue
                elif op == "drop":
                    mine.remove(held)  # garbage in a cycle: the collector frees it
                    continue
                elif op == "read":
                    pool.stats(), pool.page_table([held.seq]), held.seq.views(0), held.seq.scales(1)
                elif op == "evict":
                    pool.evict_all()
            except kvrs.CacheFullError:
                pass
            check(held, op)
    except BaseException as e:
        errors.append(f"thread {tid}: {type(e).__name__}: {e}")


errors = []
threads = [threading.Thread(target=run, args=(i, p, errors)) for i, p in enumerate(programs)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
pool.check_invariants()
gc.collect()
pool.check_invariants()
assert pool.stats()["num_sequences"] == 0, pool.stats()["num_sequences"]
"""

ops = st.tuples(
    st.sampled_from(["new", "grow", "grow", "truncate", "fork", "free", "drop", "read", "evict"]),
    st.integers(0, 1000),
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(programs=st.lists(st.lists(ops, min_size=5, max_size=30), min_size=2, max_size=4))
def test_threads_collections_and_cycles_on_one_pool(programs):
    try:
        r = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(programs)],
            capture_output=True,
            text=True,
            timeout=WATCHDOG_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the threads hung for {WATCHDOG_S} s (a deadlock): {programs}")
    assert r.returncode == 0, r.stderr[-3000:]
