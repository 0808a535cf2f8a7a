"""Inputs in the other byte order (`>f4`, `>f2` on a little-endian machine) are read
through a native-order copy at every write entry point, never misread (1.0 used to be
stored as 4.6e-41); an output in that order is refused, since it would be written into a
copy."""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

H, D = 2, 4
# The other byte order than this machine's, for float32 and float16.
SWAPPED = [np.dtype(t).newbyteorder("S") for t in ("f4", "f2")]


def tokens(n: int, dtype: np.dtype, offset: float = 1.0) -> np.ndarray:
    """[n, H, D] of distinct, exactly representable values, in `dtype`."""
    return (np.arange(n * H * D, dtype=np.float32).reshape(n, H, D) + offset).astype(dtype)


def as_input(x: np.ndarray, kind: str):
    """`x` as an array, or through the buffer protocol (numpy.asarray's path)."""
    return memoryview(x) if kind == "memoryview" else x


@pytest.fixture(params=SWAPPED, ids=lambda d: d.str)
def swapped(request) -> np.dtype:
    assert not request.param.isnative
    return request.param


@pytest.fixture(params=["array", "memoryview"])
def kind(request) -> str:
    return request.param


def test_kv_cache_writes(swapped, kind):
    cache = kvrs.KVCache(1, H, D, 8, dtype="float32")
    k, v = tokens(3, swapped), tokens(3, swapped, offset=-50.0)
    cache.append(0, as_input(k, kind), as_input(v, kind))
    key = np.array([9.5, -2.0, 0.25, 7.0], swapped)
    cache.store_key(0, 1, 3, as_input(key, kind))
    cache.store_value(0, 1, 3, as_input(-key, kind))
    bk, bv = tokens(2, swapped, 100.0).transpose(1, 0, 2), tokens(2, swapped, 200.0).transpose(1, 0, 2)
    cache.inject_block(
        0, 4, 2, as_input(np.ascontiguousarray(bk), kind), as_input(np.ascontiguousarray(bv), kind)
    )
    cache.set_seq_len(6)
    gk, gv = cache.get(0)
    np.testing.assert_array_equal(gk[:, :3], k.astype(np.float32).transpose(1, 0, 2))
    np.testing.assert_array_equal(gv[:, :3], v.astype(np.float32).transpose(1, 0, 2))
    np.testing.assert_array_equal(gk[1, 3], key.astype(np.float32))
    np.testing.assert_array_equal(gv[1, 3], -key.astype(np.float32))
    np.testing.assert_array_equal(gk[:, 4:6], bk.astype(np.float32))
    np.testing.assert_array_equal(gv[:, 4:6], bv.astype(np.float32))


def test_pool_sequence_batch_and_encoder_writes(swapped, kind):
    pool = kvrs.BlockPool(1, H, D, block_size=4, num_blocks=8, dtype="float32")
    seq = pool.new_sequence()
    k = tokens(3, swapped)
    seq.append(0, as_input(k, kind), as_input(-k, kind))
    seq.advance(3)
    blk = np.ascontiguousarray(tokens(4, swapped, 30.0).transpose(1, 0, 2))
    seq.inject_block(0, 4, 4, as_input(blk, kind), as_input(blk, kind))
    gk, gv = seq.get(0)
    np.testing.assert_array_equal(gk[:, :3], k.astype(np.float32).transpose(1, 0, 2))
    np.testing.assert_array_equal(gv[:, :3], -k.astype(np.float32).transpose(1, 0, 2))
    np.testing.assert_array_equal(gk[:, 4:8], blk.astype(np.float32))

    other = pool.new_sequence()
    slots = pool.reserve([other], [2])
    w = tokens(2, swapped, 60.0)
    pool.write(0, as_input(w, kind), as_input(w, kind), slots)
    other.advance(2)
    np.testing.assert_array_equal(other.get(0)[0], w.astype(np.float32).transpose(1, 0, 2))

    third = pool.new_sequence()
    batch = pool.start_forward([third, third])
    p = tokens(2, swapped, 80.0)
    batch.put(0, as_input(p, kind), as_input(-p, kind))
    batch.finish()
    tk, tv = third.get(0)
    np.testing.assert_array_equal(tk, p.astype(np.float32).transpose(1, 0, 2))
    np.testing.assert_array_equal(tv, -p.astype(np.float32).transpose(1, 0, 2))

    enc = kvrs.EncoderCache(1, H, D, 4, dtype="float32")
    e = tokens(3, swapped, 5.0)
    enc.set(0, as_input(e, kind), as_input(-e, kind))
    ek, ev = enc.get(0)
    np.testing.assert_array_equal(ek, e.astype(np.float32).transpose(1, 0, 2))
    np.testing.assert_array_equal(ev, -e.astype(np.float32).transpose(1, 0, 2))


def test_attention_queries(swapped, kind):
    cache = kvrs.KVCache(1, H, D, 4, dtype="float32")
    kv = tokens(2, np.float32) / 16
    cache.append(0, kv, kv)
    cache.advance(2)
    q = (tokens(2, np.float32) / 8).astype(swapped)
    native = q.astype(swapped.newbyteorder("="))
    want = cache.attention(0, native)
    assert want.dtype == native.dtype
    np.testing.assert_array_equal(cache.attention(0, as_input(q, kind)), want)
    enc = kvrs.EncoderCache(1, H, D, 2, dtype="float32")
    enc.set(0, kv, kv)
    np.testing.assert_array_equal(enc.attention(0, as_input(q, kind)), enc.attention(0, native))
    pool = kvrs.BlockPool(1, H, D, block_size=4, num_blocks=2, dtype="float32")
    seq = pool.new_sequence()
    seq.append(0, kv, kv)
    seq.advance(2)
    np.testing.assert_array_equal(seq.attention(0, as_input(q, kind)), want)


def test_rope_input(swapped):
    rope = kvrs.RoPE()
    x = tokens(2, swapped)
    np.testing.assert_array_equal(
        rope.apply(x, [0, 5]), rope.apply(x.astype(swapped.newbyteorder("=")), [0, 5])
    )


def test_an_output_in_the_other_byte_order_is_refused():
    cache = kvrs.KVCache(1, H, D, 4, dtype="float32")
    kv = tokens(2, np.float32)
    cache.append(0, kv, kv)
    cache.advance(2)
    q = tokens(2, np.float32)
    out = np.zeros(q.shape, np.dtype("f4").newbyteorder("S"))
    with pytest.raises(ValueError, match=r"out=.*byte order"):
        cache.attention(0, q, out=out)
    assert (out == 0).all()
    pool = kvrs.BlockPool(1, H, D, block_size=4, num_blocks=2, dtype="float32")
    seq = pool.new_sequence()
    seq.append(0, kv, kv)
    seq.advance(2)
    pair = (np.zeros((H, 2, D), out.dtype), np.zeros((H, 2, D), np.float32))
    with pytest.raises(ValueError, match=r"out\[0\]=.*byte order"):
        seq.get(0, pair)
    with pytest.raises(ValueError, match="byte order"):
        seq.attention(0, q, out=out)
