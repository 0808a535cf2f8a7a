"""Scenario tests for kvrs.BlockPool, Sequence and ForwardBatch (documented semantics)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kvrs

L, H, D, BS = 2, 2, 4, 4


def pool(num_blocks=16, **kw):
    kw.setdefault("dtype", "float32")
    return kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=num_blocks, **kw)


def toks(n, start=0.0):
    return (np.arange(n * H * D, dtype=np.float32).reshape(n, H, D) + start) / 8


def fill(seq, n, start=0.0):
    """Appends n tokens to every layer and commits them."""
    k = toks(n, start)
    for layer in range(L):
        seq.append(layer, k, -k)
    seq.advance(n)
    return k


def test_construction_and_layouts():
    p = kvrs.BlockPool(3, 2, 8, num_blocks=10)
    assert (p.block_size, p.dtype, p.device, p.layout) == (16, "float16", "cpu", "NHD")
    assert p.kv_cache(0).shape == (10, 2, 16, 2, 8)
    assert p.bytes_per_block == 3 * 2 * 16 * 2 * 8 * 2
    hnd = kvrs.BlockPool(3, 2, 8, num_blocks=10, layout="HND")
    assert hnd.kv_cache(2).shape == (10, 2, 2, 16, 8)
    m = kvrs.BlockPool(3, 2, 8, memory_bytes="1MiB")
    assert m.num_blocks == (1 << 20) // m.bytes_per_block
    assert kvrs.BlockPool(3, 2, 8, memory_bytes=m.bytes_per_block * 3).num_blocks == 3
    assert m.stats()["bytes_total"] == m.num_blocks * m.bytes_per_block


def test_kv_cache_is_the_flashinfer_tensor_of_the_sequence():
    for layout in ("NHD", "HND"):
        p = pool(layout=layout)
        s = p.new_sequence()
        k = fill(s, 6)
        cache = p.kv_cache(1)
        assert cache.flags.writeable and cache.base is p
        for pos in range(6):
            block, off = s.block_table[pos // BS], pos % BS
            got_k = cache[block, 0, off] if layout == "NHD" else cache[block, 0, :, off]
            got_v = cache[block, 1, off] if layout == "NHD" else cache[block, 1, :, off]
            np.testing.assert_array_equal(got_k, k[pos])
            np.testing.assert_array_equal(got_v, -k[pos])


def test_append_get_and_out():
    p = pool()
    s = p.new_sequence()
    k = fill(s, 7)
    K, V = s.get(1)
    np.testing.assert_array_equal(K, k.transpose(1, 0, 2))
    np.testing.assert_array_equal(V, -k.transpose(1, 0, 2))
    out = (np.zeros((H, 32, D), np.float32), np.zeros((H, 32, D), np.float32))
    K2, _ = s.get(0, out=out)
    assert K2.shape == (H, 7, D) and np.shares_memory(K2, out[0])
    np.testing.assert_array_equal(K2, K)
    assert s.seq_len == 7 and s.num_blocks == 2 and s.pos_min == 0 and s.pos_max == 6
    assert s.memory_bytes() == 2 * p.bytes_per_block


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kinds", [["full"], ["sliding"]])
def test_large_gathers_split_across_threads_are_exact(layout, kinds):
    # 8 heads x 64 x float32, K and V: 4 KiB per position, so 1003 positions (a partial
    # last block) take the multi-threaded path (>= 1 MiB); a sliding layer starts past 0.
    p = kvrs.BlockPool(
        1, 8, 64, block_size=16, num_blocks=80, dtype="float32", layout=layout,
        layer_types=kinds, sliding_window=700 if kinds == ["sliding"] else None,
    )  # fmt: skip
    s = p.new_sequence()
    k = np.random.default_rng(5).standard_normal((1003, 8, 64), dtype=np.float32)
    s.append(0, k, -k)
    s.advance(1003)
    first = s.layer_start(0)
    assert first == (0 if kinds == ["full"] else 1003 - 700 + 1 - (1003 - 700 + 1) % 16)
    out = (np.full((8, 1100, 64), np.nan, np.float32), np.full((8, 1100, 64), np.nan, np.float32))
    K, V = s.get(0, out=out)
    np.testing.assert_array_equal(K, k[first:].transpose(1, 0, 2))
    np.testing.assert_array_equal(V, -k[first:].transpose(1, 0, 2))
    assert np.isnan(out[0][:, 1003 - first :]).all()  # nothing written past the history


def test_views_are_per_block_and_zero_copy():
    p = pool()
    s = p.new_sequence()
    k = fill(s, 6)
    views = s.views(0)
    assert [(start, n) for start, n, _, _ in views] == [(0, 4), (4, 2)]
    for start, n, K, V in views:
        assert not K.flags.writeable
        np.testing.assert_array_equal(K, k[start : start + n])
        np.testing.assert_array_equal(V, -k[start : start + n])
    hp = pool(layout="HND")
    hs = hp.new_sequence()
    fill(hs, 6)
    _, n, K, _ = hs.views(0)[1]
    np.testing.assert_array_equal(K, k[4:6].transpose(1, 0, 2))


def test_a_view_shows_its_block_whatever_holds_it_now():
    """Views are windows on pool memory, valid while the sequence holds the block: after
    free (or truncate, remove, copy-on-write, eviction) the block goes to whoever takes
    it next, and an old view shows that sequence's K/V (as vLLM's and FlashInfer's
    tensors do). The pool never promises otherwise; this pins the behaviour down."""
    p = pool(num_blocks=1, prefix_caching=False)
    a = p.new_sequence()
    ka = fill(a, 3)
    _, _, old_k, _ = a.views(0)[0]
    kept = old_k.copy()  # a copy taken while `a` holds the block
    block = a.block_table[0]
    a.free()
    b = p.new_sequence()
    kb = fill(b, 3, start=1000)
    assert b.block_table[0] == block  # the only block, handed on
    np.testing.assert_array_equal(old_k, kb)  # the old view now shows b's keys
    np.testing.assert_array_equal(kept, ka)  # the copy still holds a's


def test_fork_shares_blocks_and_copies_on_write():
    p = pool()
    a = p.new_sequence()
    ka = fill(a, 6)  # blocks: one full, one with 2 of 4 positions
    used = p.stats()["used_blocks"]
    b = a.fork()
    assert list(b.block_table) == list(a.block_table)
    assert p.stats()["used_blocks"] == used  # nothing copied
    kb = fill(b, 1, start=100)  # first write into the shared partial block copies it
    assert b.block_table[0] == a.block_table[0]  # the full block stays shared
    assert b.block_table[1] != a.block_table[1]
    np.testing.assert_array_equal(a.get(0)[0], ka.transpose(1, 0, 2))
    np.testing.assert_array_equal(b.get(0)[0], np.concatenate([ka, kb]).transpose(1, 0, 2))
    stats = p.stats()
    assert stats["used_blocks"] == 3
    assert stats["tokens_stored"] == 4 + 2 + 3  # the shared full block counts once
    p.check_invariants()


def test_copy_prefix_and_keep():
    p = pool()
    a = p.new_sequence()
    k = fill(a, 9)
    b = p.new_sequence()
    fill(b, 3, start=50)
    p.copy_prefix(a, b, 5)
    assert b.seq_len == 5 and list(b.block_table) == list(a.block_table[:2])
    np.testing.assert_array_equal(b.get(1)[0], k[:5].transpose(1, 0, 2))
    c = p.new_sequence()
    p.keep([a])
    assert b.is_freed and c.is_freed and not a.is_freed
    assert p.stats()["num_sequences"] == 1
    p.check_invariants()


def test_truncate_remove_and_free_return_blocks():
    p = pool()
    s = p.new_sequence()
    fill(s, 10)
    assert p.free_blocks == 16 - 3
    s.truncate(5)
    assert s.seq_len == 5 and s.num_blocks == 2 and p.free_blocks == 14
    s.remove(3)  # tail: positions 3.. go
    assert s.seq_len == 3 and s.num_blocks == 1
    before = p.stats()
    with pytest.raises(kvrs.NotSupportedError, match="middle"):
        s.remove(0, 1)
    assert p.stats() == before
    s.remove(5, 9)  # nothing there: no-op
    s.free()
    assert p.free_blocks == 16 and s.is_freed
    with pytest.raises(ValueError, match="was freed"):
        s.append(0, toks(1), toks(1))


def test_context_manager_and_garbage_collection_release():
    p = pool()
    with p.new_sequence() as s:
        fill(s, 5)
        assert p.free_blocks == 14
    assert p.free_blocks == 16 and s.is_freed
    t = p.new_sequence()
    fill(t, 5)
    del t
    gc.collect()
    assert p.free_blocks == 16 and p.stats()["num_sequences"] == 0


def test_reserve_write_and_page_tables():
    p = pool()
    a, b = p.new_sequence(), p.new_sequence()
    fill(a, 5)
    slots = p.reserve([a, b], [2, 6])
    assert slots.dtype == np.int64 and len(slots) == 8
    blocks_a, blocks_b = list(a.block_table), list(b.block_table)
    assert list(slots[:2]) == [blocks_a[1] * BS + 1, blocks_a[1] * BS + 2]
    assert list(slots[2:]) == [blocks_b[p // BS] * BS + p % BS for p in range(6)]
    new = toks(8, start=300)
    for layer in range(L):
        p.write(layer, new, -new, slots)
    a.advance(2)
    b.advance(6)
    np.testing.assert_array_equal(a.get(1)[0][:, 5:], new[:2].transpose(1, 0, 2))
    np.testing.assert_array_equal(b.get(0)[1], -new[2:].transpose(1, 0, 2))
    indptr, indices, last = p.page_table([a, b])
    assert indptr.dtype == np.int32 and list(indptr) == [0, 2, 4]
    assert list(indices) == blocks_a + blocks_b and list(last) == [3, 2]
    tables = p.block_tables([a, b, p.new_sequence()])
    assert tables.dtype == np.int32 and tables.shape == (3, 2)
    assert list(tables[2]) == [-1, -1]
    assert list(p.block_tables([b], pad=0)[0]) == blocks_b


def test_write_skips_minus_one_slots():
    p = pool()
    s = p.new_sequence()
    slots = p.reserve([s], [2])
    p.write(0, toks(2), toks(2), np.array([slots[0], -1]))
    p.write(1, toks(2), toks(2), slots)
    s.advance(2)
    np.testing.assert_array_equal(s.get(0)[0][:, 0], toks(1)[0])
    assert not s.get(0)[0][:, 1].any()  # skipped: still the pool's zeros


def test_batch_masks_for_two_sequences():
    p = pool()
    a, b = p.new_sequence(), p.new_sequence()
    fill(a, 3)
    fill(b, 1, start=20)
    batch = p.start_forward([a, b, a], [3, 1, 4])
    assert batch.num_tokens == 3 and batch.history_len(0) == 5 + 2
    new = toks(3, start=40)
    for layer in range(L):
        batch.put(layer, new, -new)
    K, _, mask = batch.get(0)
    assert K.shape == (H, 7, D) and mask.shape == (3, 7) and mask.dtype == np.float32
    ninf = -np.inf
    np.testing.assert_array_equal(
        mask,
        [
            [0, 0, 0, 0, ninf, ninf, ninf],  # a@3 sees a[0..3]
            [ninf] * 5 + [0, 0],  # b@1 sees b[0..1]
            [0, 0, 0, 0, 0, ninf, ninf],  # a@4 sees a[0..4]
        ],
    )
    np.testing.assert_array_equal(K[:, 3], new[0])
    np.testing.assert_array_equal(K[:, 4], new[2])
    np.testing.assert_array_equal(K[:, 6], new[1])
    batch.finish()
    assert (a.seq_len, b.seq_len) == (5, 2)
    with pytest.raises(ValueError, match="already finished"):
        batch.put(0, new, new)


def test_batch_context_manager_cancels_on_error():
    p = pool()
    a = p.new_sequence()
    fill(a, 3)
    free = p.free_blocks
    with pytest.raises(RuntimeError), p.start_forward([a, a], [3, 4]) as batch:
        batch.put(0, toks(2), toks(2))
        raise RuntimeError("model failed")
    assert a.seq_len == 3 and a.layer_len(0) == 3 and p.free_blocks == free
    with p.start_forward([a], [3]) as batch:
        for layer in range(L):
            batch.put(layer, toks(1), toks(1))
    assert a.seq_len == 4


def test_full_pool_is_all_or_nothing():
    p = pool(num_blocks=3)
    a, b = p.new_sequence(), p.new_sequence()
    fill(a, 8)
    before = (p.stats(), list(a.block_table), a.seq_len)
    with pytest.raises(kvrs.CacheFullError, match=r"needs 2 more blocks but 1 of 3 blocks are free"):
        p.reserve([a, b], [1, 4])  # a needs a third block, b a fourth
    assert (p.stats(), list(a.block_table), a.seq_len) == before
    with pytest.raises(kvrs.CacheFullError):
        b.append(0, toks(5), toks(5))
    with pytest.raises(kvrs.CacheFullError):
        p.start_forward([a, b, b, b, b, b], [8, 0, 1, 2, 3, 4])
    assert (p.stats(), list(a.block_table), a.seq_len, b.num_blocks) == (*before, 0)
    p.check_invariants()


def test_batch_positions_default_to_where_each_sequence_continues():
    p = pool()
    a, b = p.new_sequence(), p.new_sequence()
    fill(a, 3)
    batch = p.start_forward([a, b, a, b, b])
    assert list(batch.positions) == [3, 0, 4, 1, 2]
    for layer in range(L):
        batch.put(layer, toks(5), toks(5))
    batch.finish()
    assert (a.seq_len, b.seq_len) == (5, 3)
