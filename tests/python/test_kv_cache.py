"""Scenario tests for the documented semantics of kvrs.KVCache."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import kvrs
from conftest import random_kv

L, H, D, MAX = 3, 2, 8, 16


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_properties_and_memory():
    c = kvrs.KVCache(L, H, D, MAX, dtype="bfloat16")
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.max_seq_len) == (L, H, D, MAX)
    assert (c.dtype, c.device, c.seq_len, len(c)) == ("bfloat16", "cpu", 0, 0)
    assert c.memory_bytes() == 2 * L * H * MAX * D * 2
    assert kvrs.KVCache(1, 1, 1, 1, dtype="float32").memory_bytes() == 8
    assert "seq_len=0" in repr(c)


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("fp16", "float16"),
        ("half", "float16"),
        ("bf16", "bfloat16"),
        ("float", "float32"),
        (np.float16, "float16"),
        (np.dtype("float32"), "float32"),
        (ml_dtypes.bfloat16, "bfloat16"),
    ],
)
def test_dtype_spellings(spec, name):
    assert kvrs.KVCache(1, 1, 4, 4, dtype=spec).dtype == name


def test_default_dtype_is_float16():
    assert kvrs.KVCache(1, 1, 4, 4).dtype == "float16"


def test_append_layer_by_layer_then_advance(rng):
    c = kvrs.KVCache(L, H, D, MAX, dtype="float32")
    k, v = random_kv(rng, 5, H, D)
    for layer in range(L):
        assert c.seq_len == 0
        assert c.append(layer, k, v) == 0
        assert c.layer_len(layer) == 5
    c.advance(5)
    assert c.seq_len == 5
    k2, v2 = random_kv(rng, 1, H, D)
    assert c.append(1, k2, v2) == 5
    K, V = c.get(1)
    assert K.shape == (H, 6, D) and V.shape == (H, 6, D)
    np.testing.assert_array_equal(K, np.concatenate([k, k2]).transpose(1, 0, 2))
    np.testing.assert_array_equal(V, np.concatenate([v, v2]).transpose(1, 0, 2))
    # The other layers still hold 5 positions; committing a 6th needs all of them.
    with pytest.raises(ValueError, match="layer 0 holds 5"):
        c.advance(1)
    assert c.seq_len == 5


def test_get_views_are_zero_copy_read_only_and_keep_the_cache_alive(rng):
    c = kvrs.KVCache(1, H, D, MAX, dtype="float16")
    k, v = random_kv(rng, 3, H, D)
    c.append(0, k, v)
    K, _ = c.get(0)
    assert not K.flags.writeable
    with pytest.raises(ValueError):
        K[0, 0, 0] = 1.0
    assert K.base is c
    # A later append is visible through a fresh view of the same memory.
    k2, v2 = random_kv(rng, 1, H, D)
    c.append(0, k2, v2)
    K2, _ = c.get(0)
    assert np.shares_memory(K, K2)
    np.testing.assert_array_equal(K2[:, 3], k2[0].astype(np.float16))
    # The views outlive every other reference to the cache.
    del c
    gc.collect()
    np.testing.assert_array_equal(K2[:, :3], k.astype(np.float16).transpose(1, 0, 2))


def test_keys_for_and_values_for(rng):
    c = kvrs.KVCache(2, H, D, MAX, dtype="float32")
    k, v = random_kv(rng, 4, H, D)
    c.append(0, k, v)
    c.append(1, k, v)
    assert c.keys_for(0, 1).shape == (0, D)  # nothing committed yet
    c.advance(4)
    np.testing.assert_array_equal(c.keys_for(0, 1), k[:, 1])
    np.testing.assert_array_equal(c.values_for(1, 0), v[:, 0])
    np.testing.assert_array_equal(c.keys_for(0, 0, seq_len=2), k[:2, 0])
    assert c.keys_for(0, 0, seq_len=MAX).shape == (MAX, D)
    assert not c.values_for(0, 0).flags.writeable


def test_store_key_and_value_make_the_layer_hold_the_position(rng):
    c = kvrs.KVCache(1, H, D, MAX, dtype="float32")
    key = rng.standard_normal(D).astype(np.float32)
    c.store_key(0, 1, 7, key)
    c.store_value(0, 0, 7, key * 2)
    assert c.seq_len == 0 and c.layer_len(0) == 8  # held, not yet committed
    np.testing.assert_array_equal(c.keys_for(0, 0, 8)[:7], 0)  # the gap reads as zeros
    c.advance(8)
    np.testing.assert_array_equal(c.keys_for(0, 1)[7], key)
    np.testing.assert_array_equal(c.values_for(0, 0)[7], key * 2)


def test_truncate_clear_and_set_seq_len(rng):
    c = kvrs.KVCache(2, H, D, MAX, dtype="float32")
    k, v = random_kv(rng, 6, H, D)
    for layer in range(2):
        c.append(layer, k, v)
    c.advance(6)
    c.truncate(10)  # no-op: n >= seq_len
    assert c.seq_len == 6 and c.layer_len(0) == 6
    c.truncate(4)
    assert c.seq_len == 4 and c.layer_len(1) == 4
    assert c.append(0, k[:1], v[:1]) == 4  # appends continue after the cut
    c.clear()
    assert c.seq_len == 0 and c.layer_len(0) == 0
    c.set_seq_len(1000)  # clamped
    assert c.seq_len == MAX and c.layer_len(1) == MAX
    assert c.utilization_ratio() == 1.0
    c.set_seq_len(4)
    assert c.utilization_ratio() == 4 / MAX


def test_extract_and_inject_blocks(rng):
    c = kvrs.KVCache(2, H, D, 10, dtype="float32")
    keys = rng.standard_normal((H, 4, D)).astype(np.float32)
    values = rng.standard_normal((H, 4, D)).astype(np.float32)
    c.inject_block(1, 8, 4, keys, values)  # positions 10 and 11 are skipped
    assert c.seq_len == 0
    ek, ev = c.extract_block(1, 8, 4)
    assert ek.dtype == np.float32 and ek.shape == (H, 4, D) and ek.flags.writeable
    np.testing.assert_array_equal(ek[:, :2], keys[:, :2])
    np.testing.assert_array_equal(ev[:, :2], values[:, :2])
    assert not ek[:, 2:].any() and not ev[:, 2:].any()  # past max_seq_len: zeros
    # A copy: changing it leaves the cache alone.
    ek[:] = 0
    np.testing.assert_array_equal(c.extract_block(1, 8, 2)[0], keys[:, :2])


@pytest.mark.parametrize(("dtype", "np_dtype"), [("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)])
def test_float32_writes_round_to_nearest_even(dtype, np_dtype):
    # Values that sit exactly between two representable numbers, and random ones.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 1, 16)).astype(np.float32)
    x[0, 0, :4] = [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8]
    c = kvrs.KVCache(1, 1, 16, 4, dtype=dtype)
    c.append(0, x, x)
    K, _ = c.get(0)
    assert K.dtype == np.dtype(np_dtype)
    np.testing.assert_array_equal(K[0].view(np.uint16), x[:, 0].astype(np_dtype).view(np.uint16))


@pytest.mark.parametrize("store", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("given", ["float32", "float16", "bfloat16"])
def test_every_input_dtype_converts_to_every_storage_dtype(store, given):
    np_types = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    x = (np.arange(2 * 2 * 4, dtype=np.float32).reshape(2, 2, 4) / 8).astype(np_types[given])
    c = kvrs.KVCache(1, 2, 4, 4, dtype=store)
    c.append(0, x, x)
    np.testing.assert_array_equal(c.get(0)[0].astype(np.float32), x.astype(np.float32).transpose(1, 0, 2))


def test_non_contiguous_inputs(rng):
    c = kvrs.KVCache(1, H, D, MAX, dtype="float32")
    big = rng.standard_normal((4, H, 2 * D)).astype(np.float32)
    k = big[:, :, ::2]  # strided last axis
    v = big[::-1, :, :D]  # negative outer stride
    c.append(0, k, v)
    K, V = c.get(0)
    np.testing.assert_array_equal(K, k.transpose(1, 0, 2))
    np.testing.assert_array_equal(V, v.transpose(1, 0, 2))
    before = K.copy()
    # K is a view of the cache: written back reversed, it is read as it was before the write.
    c.inject_block(0, 0, 4, K.transpose(0, 1, 2)[:, ::-1], V)
    np.testing.assert_array_equal(c.extract_block(0, 0, 4)[0], before[:, ::-1])


def test_large_append_runs_with_gil_released_path(rng):
    # 2048 tokens x 8 heads x 64 float32 > 64 KiB: the copy runs detached from the GIL.
    c = kvrs.KVCache(1, 8, 64, 4096, dtype="float16")
    k, v = random_kv(rng, 2048, 8, 64)
    c.append(0, k, v)
    np.testing.assert_array_equal(c.get(0)[1], v.astype(np.float16).transpose(1, 0, 2))


def test_the_seed_decode_loop_as_its_users_write_it():
    """The seed's loop, unchanged: store_key/store_value for every layer and head at
    pos = seq_len, then advance(); each step commits and keys_for/values_for read back."""
    layers, heads, dim = 2, 3, 4
    cache = kvrs.KVCache(layers, heads, dim, 16, dtype="float32")
    rng = np.random.default_rng(0)
    written = {}
    for _step in range(6):
        pos = cache.seq_len
        for layer in range(layers):
            for head in range(heads):
                k, v = rng.standard_normal((2, dim), dtype=np.float32)
                cache.store_key(layer, head, pos, k)
                cache.store_value(layer, head, pos, v)
                written[layer, head, pos] = (k, v)
        cache.advance()
    assert cache.seq_len == 6
    for (layer, head, pos), (k, v) in written.items():
        np.testing.assert_array_equal(cache.keys_for(layer, head)[pos], k)
        np.testing.assert_array_equal(cache.values_for(layer, head)[pos], v)


def test_a_partly_stored_position_reads_zeros_not_old_keys():
    cache = kvrs.KVCache(1, 2, 4, 8, dtype="float16")
    cache.append(0, np.full((1, 2, 4), 7.0, np.float32), np.full((1, 2, 4), 7.0, np.float32))
    cache.advance()
    cache.truncate(0)
    cache.store_key(0, 1, 0, np.ones(4, np.float32))  # only head 1's key
    assert cache.layer_len(0) == 1
    cache.advance()
    k, v = cache.get(0)
    np.testing.assert_array_equal(k.astype(np.float32), [[[0] * 4], [[1] * 4]])
    np.testing.assert_array_equal(v.astype(np.float32), np.zeros((2, 1, 4)))
