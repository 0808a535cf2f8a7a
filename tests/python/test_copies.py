"""Reads that are the cache, and reads that are copies (issue 37, item 3).

`KVCache.get`, `keys_for`/`values_for`, `Sequence.views` and `EncoderCache.get` return
zero-copy views of the cache's memory, flagged read-only. NumPy honours the flag; torch
ignores it (`torch.from_dlpack` of a read-only array gives a writable tensor), so a
tensor made from a view is the cache itself. `copy=True` gives copies the caller owns:
writing them, through NumPy or torch, never changes the cache.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvrs


def filled_cache():
    c = kvrs.KVCache(2, 2, 4, 16, dtype="float32")
    for layer in range(2):
        k = np.arange(5 * 2 * 4, dtype=np.float32).reshape(5, 2, 4) + layer
        c.append(layer, k, -k)
    c.advance(5)
    return c


def filled_sequence():
    pool = kvrs.BlockPool(2, 2, 4, block_size=4, num_blocks=8, dtype="float32")
    s = pool.new_sequence()
    for layer in range(2):
        k = np.arange(6 * 2 * 4, dtype=np.float32).reshape(6, 2, 4) + layer
        s.append(layer, k, -k)
    s.advance(6)
    return pool, s


def encoder_cache():
    e = kvrs.EncoderCache(1, 2, 4, 8, dtype="float32")
    k = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    e.set(0, k, -k)
    return e


def reads(copy):
    """(name, the arrays a read returns, a function reading the same again) per read."""
    c = filled_cache()
    pool, s = filled_sequence()
    e = encoder_cache()
    out = [
        ("KVCache.get", list(c.get(1, copy=copy)), lambda: list(c.get(1))),
        ("KVCache.keys_for", [c.keys_for(1, 1, copy=copy)], lambda: [c.keys_for(1, 1)]),
        ("KVCache.values_for", [c.values_for(0, 0, 3, copy=copy)], lambda: [c.values_for(0, 0, 3)]),
        (
            "Sequence.views",
            [x for _, _, k, v in s.views(1, copy=copy) for x in (k, v)],
            lambda: [x for _, _, k, v in s.views(1) for x in (k, v)],
        ),
        ("EncoderCache.get", list(e.get(0, copy=copy)), lambda: list(e.get(0))),
    ]
    return out, (c, pool, s, e)


@pytest.mark.parametrize("i", range(5))
def test_copies_equal_the_views_and_are_apart_from_the_cache(i):
    copies, _keep = reads(copy=True)
    name, arrays, again = copies[i]
    before = [a.copy() for a in again()]
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
        assert a.flags.writeable, name
        a += 100
    for a, b in zip(again(), before, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: writing a copy changed the cache")


@pytest.mark.parametrize("i", range(5))
def test_views_are_the_cache_itself_even_through_torch(i):
    torch = pytest.importorskip("torch")
    views, _keep = reads(copy=False)
    name, arrays, again = views[i]
    for a in arrays:
        assert not a.flags.writeable, name
        with pytest.raises(ValueError):
            a += 1
    # torch ignores the read-only flag: the documented reason for copy=True.
    before = again()[0].copy()
    torch.from_dlpack(arrays[0]).add_(1000)
    np.testing.assert_array_equal(again()[0], before + 1000, err_msg=f"{name}: the tensor is the cache")
    copies, _keep2 = reads(copy=True)
    name, arrays, again = copies[i]
    before = again()[0].copy()
    torch.from_dlpack(arrays[0]).add_(1000)
    np.testing.assert_array_equal(again()[0], before, err_msg=name)


def test_copies_of_8bit_caches_are_the_codes():
    c = kvrs.KVCache(1, 1, 4, 8, dtype="int8")
    c.append(0, np.ones((3, 1, 4), np.float32), np.ones((3, 1, 4), np.float32))
    k, v = c.get(0, copy=True)
    kv_, vv = c.get(0)
    assert k.dtype == kv_.dtype == np.int8
    np.testing.assert_array_equal(k, kv_)
    np.testing.assert_array_equal(v, vv)
