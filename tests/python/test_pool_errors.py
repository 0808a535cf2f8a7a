"""Bad input to the pool raises a clear exception and leaves the pool exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

L, H, D, BS = 2, 2, 4, 4


def snapshot(p, seqs):
    state = [p.stats()]
    for s in seqs:
        if s.is_freed:
            state.append(None)
            continue
        state.append((s.seq_len, list(s.block_table), [s.layer_len(i) for i in range(L)]))
        for layer in range(L):
            k, v = s.get(layer)
            state.append((k.tobytes(), v.tobytes()))
    return state


@pytest.fixture
def world():
    p = kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=6, dtype="float16")
    a, b = p.new_sequence(), p.new_sequence()
    x = np.ones((5, H, D), np.float32)
    for layer in range(L):
        a.append(layer, x, x)
    a.advance(5)
    b.append(0, x[:2], x[:2])  # b's layers differ: 2 and 0
    other = kvrs.BlockPool(L, H, D, num_blocks=2).new_sequence()
    return p, a, b, other


def tok(n=1, dtype=np.float32):
    return np.ones((n, H, D), dtype)


CASES = [
    (lambda p, a, b, o: a.append(2, tok(), tok()), IndexError, "layer=2"),
    (lambda p, a, b, o: a.append(0, np.ones((1, H, D + 1), np.float32), tok()), ValueError, "k has shape"),
    (lambda p, a, b, o: a.append(0, tok(), tok(2)), ValueError, "v has shape"),
    (lambda p, a, b, o: a.append(0, tok(dtype=np.int64), tok()), TypeError, "k has dtype int64"),
    (lambda p, a, b, o: a.append(0, tok(40), tok(40)), kvrs.CacheFullError, "appending 40 tokens"),
    (lambda p, a, b, o: a.advance(1), ValueError, "layer 0 holds 5"),
    (lambda p, a, b, o: a.truncate(-1), ValueError, "n=-1"),
    (lambda p, a, b, o: a.remove(1, 3), kvrs.NotSupportedError, "middle"),
    (lambda p, a, b, o: a.remove(-1), ValueError, "begin=-1"),
    (lambda p, a, b, o: a.get(5), IndexError, "layer=5"),
    (lambda p, a, b, o: a.get(0, out=(np.zeros((H, 2, D), np.float16),) * 2), ValueError, "k_out has shape"),
    (lambda p, a, b, o: a.get(0, out=(np.zeros((H, 8, D), np.float16).view(), [1])), TypeError, "out"),
    (lambda p, a, b, o: a.views(-1), IndexError, "layer=-1"),
    (lambda p, a, b, o: p.copy_prefix(a, b, 6), ValueError, "only 5 committed"),
    (lambda p, a, b, o: p.copy_prefix(a, a, 2), ValueError, "must differ"),
    (lambda p, a, b, o: p.copy_prefix(a, o, 2), ValueError, "another pool"),
    (lambda p, a, b, o: p.keep([a, o]), ValueError, "another pool"),
    (lambda p, a, b, o: p.keep([a, 3]), TypeError, "kvrs.Sequence"),
    (lambda p, a, b, o: p.reserve([a], [1, 2]), ValueError, "one count per sequence"),
    (lambda p, a, b, o: p.reserve([a, a], [1, 2]), ValueError, "appears twice"),
    (lambda p, a, b, o: p.reserve([a], [-1]), ValueError, "counts=-1"),
    (lambda p, a, b, o: p.reserve([a], [1.5]), TypeError, "counts must be a 1-D sequence of integers"),
    (lambda p, a, b, o: p.reserve([b], [1]), ValueError, "different lengths"),
    (lambda p, a, b, o: p.reserve([a], [100]), kvrs.CacheFullError, "reserving 100 tokens"),
    (lambda p, a, b, o: p.write(0, tok(), tok(), [10_000]), IndexError, "slot_mapping=10000"),
    (lambda p, a, b, o: p.write(0, tok(), tok(), [23]), ValueError, "not held by any sequence"),
    (lambda p, a, b, o: p.write(0, tok(2), tok(2), [0]), ValueError, "one per token"),
    (lambda p, a, b, o: p.start_forward([a], [4]), ValueError, "must be at position 5"),
    (lambda p, a, b, o: p.start_forward([a, a], [5]), ValueError, "one position per token"),
    (lambda p, a, b, o: p.start_forward([a] * 30, list(range(5, 35))), kvrs.CacheFullError, "reserving 30"),
    (lambda p, a, b, o: p.page_table([o]), ValueError, "another pool"),
    (lambda p, a, b, o: p.kv_cache(9), IndexError, "layer=9"),
    (lambda p, a, b, o: p.set_stream(None), kvrs.NotSupportedError, "needs a pool on a CUDA device"),
    (lambda p, a, b, o: p.set_stream(-1), TypeError, "stream must be None, a CUDA stream handle"),
    (lambda p, a, b, o: p.set_stream("s"), TypeError, "not str"),
]


@pytest.mark.parametrize(("call", "exc", "match"), CASES)
def test_bad_input_leaves_the_pool_unchanged(world, call, exc, match):
    p, a, b, other = world
    before = snapshot(p, [a, b])
    with pytest.raises(exc, match=match):
        call(p, a, b, other)
    assert snapshot(p, [a, b]) == before
    p.check_invariants()


def test_write_into_a_shared_block_is_refused(world):
    p, a, _, _ = world
    fork = a.fork()
    shared_slot = int(a.block_table[1]) * BS + 1
    before = snapshot(p, [a, fork])
    with pytest.raises(ValueError, match="shared by 2 holders"):
        p.write(0, tok(), tok(), [shared_slot])
    assert snapshot(p, [a, fork]) == before


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({}, ValueError, "exactly one of num_blocks and memory_bytes"),
        ({"num_blocks": 4, "memory_bytes": "1MiB"}, ValueError, "exactly one"),
        ({"num_blocks": 0}, ValueError, "num_blocks=0"),
        ({"memory_bytes": "10B"}, ValueError, "holds no block"),
        ({"memory_bytes": "12 parsecs"}, ValueError, "unknown unit"),
        ({"num_blocks": 4, "layout": "NDH"}, ValueError, "layout="),
        ({"num_blocks": 4, "block_size": 0}, ValueError, "block_size=0"),
        (
            {"num_blocks": 4, "device": "cuda:99"},
            kvrs.DeviceError,
            r"device=cuda:99(: no CUDA driver| does not exist)",
        ),
    ],
)
def test_bad_pool_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvrs.BlockPool(L, H, D, **kwargs)


def test_freed_sequence_is_unusable(world):
    p, a, _, _ = world
    a.free()
    for call in (lambda: a.seq_len, lambda: a.append(0, tok(), tok()), lambda: p.reserve([a], [1]), a.fork):
        with pytest.raises(ValueError, match="was freed"):
            call()
    with pytest.raises(ValueError, match="was freed"):
        a.free()
