"""Random calls with hostile arguments: only the documented exceptions may come out.

A Rust panic would surface as pyo3's PanicException (a BaseException, not an
Exception); it must never happen, whatever the arguments. The pool's invariants must
hold after every call.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrs

ALLOWED = (ValueError, IndexError, TypeError, OverflowError, MemoryError, kvrs.KvrsError)

ints = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([-(2**63), 2**63 - 1, 2**31, -1, 0, 2**40]),
)
arrays = st.one_of(
    st.builds(
        lambda n, h, d: np.ones((n, h, d), np.float32),
        st.integers(0, 5),
        st.integers(1, 3),
        st.integers(1, 5),
    ),
    st.builds(lambda n: np.ones(n, np.float16), st.integers(0, 6)),
    st.just(np.ones((2, 2, 4), np.float64)),
    st.just(np.ones((2, 2, 4), np.int8)),
    st.just(np.zeros((0, 2, 4), np.float32)),
    st.just("not an array"),
    st.just(None),
    st.just([1.0, 2.0]),
)
int_lists = st.one_of(
    st.lists(ints, max_size=6),
    st.just(np.array([1.5, 2.5])),
    st.just("123"),
    st.just(None),
)

CALLS = [
    ("append", lambda o, a, b, c: o.append(a, b, c), (ints, arrays, arrays)),
    ("advance", lambda o, a, b, c: o.advance(a), (ints, ints, ints)),
    ("truncate", lambda o, a, b, c: o.truncate(a), (ints, ints, ints)),
    ("remove", lambda o, a, b, c: o.remove(a, b), (ints, st.one_of(ints, st.none()), ints)),
    ("get", lambda o, a, b, c: o.get(a), (ints, ints, ints)),
    ("views", lambda o, a, b, c: o.views(a), (ints, ints, ints)),
    ("extract_block", lambda o, a, b, c: o.extract_block(a, b, c), (ints, ints, ints)),
    ("inject_block", lambda o, a, b, c: o.inject_block(a, b, 2, c, c), (ints, ints, arrays)),
    ("set_seq_len", lambda o, a, b, c: o.set_seq_len(a), (ints, ints, ints)),
    ("advance_tokens", lambda o, a, b, c: o.advance(a, tokens=b), (ints, int_lists, ints)),
    ("fork_free", lambda o, a, b, c: o.fork().free(), (ints, ints, ints)),
]

POOL_CALLS = [
    ("reserve", lambda p, s, a, b: p.reserve([s], a), (int_lists, ints)),
    (
        "write",
        lambda p, s, a, b: p.write(b, np.ones((1, 2, 4), np.float32), np.ones((1, 2, 4), np.float32), a),
        (int_lists, ints),
    ),
    ("start_forward", lambda p, s, a, b: p.start_forward([s] * 2, a).cancel(), (int_lists, ints)),
    ("match_prefix", lambda p, s, a, b: p.match_prefix(a), (int_lists, ints)),
    ("pin", lambda p, s, a, b: p.pin(a), (int_lists, ints)),
    ("unpin", lambda p, s, a, b: p.unpin(a), (int_lists, ints)),
    ("new_sequence", lambda p, s, a, b: p.new_sequence(tokens=a).free(), (int_lists, ints)),
    ("copy_prefix", lambda p, s, a, b: p.copy_prefix(s, p.new_sequence(), b), (int_lists, ints)),
    ("kv_cache", lambda p, s, a, b: p.kv_cache(b), (int_lists, ints)),
    ("block_tables", lambda p, s, a, b: p.block_tables([s], pad=b), (int_lists, ints)),
]


def call(fn, *args):
    try:
        fn(*args)
    except ALLOWED:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_sequence_and_pool_calls_never_panic(data):
    pool = kvrs.BlockPool(2, 2, 4, block_size=4, num_blocks=6, dtype="float16", rope=kvrs.RoPE(), events=True)
    seq = pool.new_sequence(tokens=list(range(10)))
    for _ in range(data.draw(st.integers(1, 12))):
        if data.draw(st.booleans()):
            _, fn, strategies = data.draw(st.sampled_from(CALLS))
            call(fn, seq, *(data.draw(s) for s in strategies))
        else:
            _, fn, strategies = data.draw(st.sampled_from(POOL_CALLS))
            call(fn, pool, seq, *(data.draw(s) for s in strategies))
        pool.check_invariants()
    pool.drain_events()


def cache_calls(cache, enc, rope, a, b, c, positions):
    """One call of each kind on a KVCache, an EncoderCache, a RoPE and the constructors."""
    return [
        lambda: cache.append(a, c, c),
        lambda: cache.store_key(a, b, 0, c),
        lambda: cache.keys_for(a, b, b),
        lambda: cache.extract_block(a, b, 3),
        lambda: cache.inject_block(a, b, 2, c, c),
        lambda: cache.set_seq_len(a),
        lambda: enc.set(a, c, c),
        lambda: enc.get(a),
        lambda: rope.apply(c, positions),
        lambda: kvrs.BlockPool(a, 2, 4, num_blocks=b, block_size=max(1, min(abs(a), 64))),
    ]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_kv_cache_and_encoder_cache_calls_never_panic(data):
    cache = kvrs.KVCache(2, 2, 4, 8, dtype="bfloat16")
    enc = kvrs.EncoderCache(2, 2, 4, 8)
    rope = kvrs.RoPE()
    for _ in range(data.draw(st.integers(1, 12))):
        a, b, c = data.draw(ints), data.draw(ints), data.draw(arrays)
        calls = cache_calls(cache, enc, rope, a, b, c, data.draw(int_lists))
        call(calls[data.draw(st.integers(0, len(calls) - 1))])
    assert cache.seq_len <= cache.max_seq_len
