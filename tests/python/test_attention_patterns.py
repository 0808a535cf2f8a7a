"""Scenario tests of layer kinds in one pool: sliding windows, chunks, swa_memory,
can_resume, masks, accounting, prefix hits with windows, and seq.shift."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrs

H, D, BS = 2, 8, 4


def tok(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, H, D)).astype(np.float32)


def pool(layer_types, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("dtype", "float32")
    return kvrs.BlockPool(len(layer_types), H, D, block_size=BS, layer_types=layer_types, **kw)


def step(seq, n, seed, tokens=None):
    """Appends n tokens to every layer and commits them; returns the K written per layer."""
    ks = []
    for layer in range(seq.pool.num_layers):
        k = tok(n, seed + layer)
        seq.append(layer, k, -k)
        ks.append(k)
    seq.advance(n, tokens=tokens)
    return ks


def test_sliding_layers_release_blocks_out_of_the_window():
    p = pool(["full", "sliding"], sliding_window=5)
    seq = p.new_sequence()
    written = [step(seq, 1, 100 + i) for i in range(13)]
    # Position 13 sees 9..13: blocks 0 and 1 (positions 0..7) are out of every window.
    assert seq.layer_start(0) == 0 and seq.layer_start(1) == 8
    assert list(seq.layer_blocks(1))[:2] == [-1, -1]
    k, v = seq.get(1)
    assert k.shape == (H, 13 - 8, D)
    expected = np.concatenate([w[1] for w in written[8:]]).transpose(1, 0, 2)
    np.testing.assert_array_equal(k, expected)
    np.testing.assert_array_equal(v, -expected)
    assert seq.get(0)[0].shape[1] == 13
    by = p.stats()["by_layer_type"]
    assert by["full"]["used_blocks"] == 4 and by["sliding"]["used_blocks"] == 2
    assert by["sliding"]["tokens_stored"] == 5 and by["full"]["tokens_stored"] == 13
    assert by["full"]["layers"] == by["sliding"]["layers"] == 1
    assert p.num_layer_groups == 2 and p.layer_group(0) != p.layer_group(1)
    assert seq.pos_min == 8 and seq.pos_max == 12
    p.check_invariants()


def test_sliding_memory_stays_bounded_however_long_the_sequence():
    p = pool(["sliding", "full", "sliding", "full"], sliding_window=6, swa_memory=3, num_blocks=200)
    seq = p.new_sequence()
    for i in range(300):
        step(seq, 1, i)
        held = [b for b in seq.layer_blocks(0) if b >= 0]
        # Window 6 + memory 3 + one partial block.
        assert len(held) <= -(-(6 + 3 + BS) // BS) + 1
    assert p.stats()["by_layer_type"]["sliding"]["used_blocks"] <= 5
    assert p.stats()["by_layer_type"]["full"]["used_blocks"] == 300 // BS


def test_chunked_layers_release_complete_chunks_behind():
    p = pool(["chunked", "full"], chunk_size=8)
    seq = p.new_sequence()
    step(seq, 19, 1)
    # Position 19 is in chunk 16..23; chunks 0..15 are complete and behind.
    assert seq.layer_start(0) == 16 and seq.get(0)[0].shape[1] == 3
    assert seq.can_resume(19) and seq.can_resume(16)
    assert not seq.can_resume(15)  # a token at 15 sees its chunk 8..15, released


def test_batch_masks_follow_each_layer_rule_for_two_sequences():
    p = pool(["full", "sliding", "chunked"], sliding_window=3, chunk_size=4)
    a, b = p.new_sequence(), p.new_sequence()
    step(a, 5, 1)
    step(b, 2, 2)
    batch = p.start_forward([a, b, a], [5, 2, 6])
    for layer in range(3):
        batch.put(layer, tok(3, 10 + layer), tok(3, 20 + layer))
    for layer, kind in enumerate(["full", "sliding", "chunked"]):
        k, _, mask = batch.get(layer)
        starts = {"a": a.layer_start(layer), "b": b.layer_start(layer)}
        # History: a's held positions (through 6), then b's (through 2).
        lens = {"a": 7 - starts["a"], "b": 3 - starts["b"]}
        assert k.shape[1] == mask.shape[1] == lens["a"] + lens["b"] == batch.history_len(layer)
        for row, (name, pos) in enumerate([("a", 5), ("b", 2), ("a", 6)]):
            off = 0 if name == "a" else lens["a"]
            first = {"full": 0, "sliding": max(0, pos - 2), "chunked": pos // 4 * 4}[kind]
            visible = np.zeros(mask.shape[1], bool)
            visible[off + first - starts[name] : off + pos - starts[name] + 1] = True
            assert ((mask[row] == 0) == visible).all(), (kind, row)
    batch.finish()
    assert a.seq_len == 7 and b.seq_len == 3


def test_a_sequence_sitting_out_keeps_its_window():
    p = pool(["sliding", "full"], sliding_window=4)
    a, b = p.new_sequence(), p.new_sequence()
    step(a, 6, 1)
    step(b, 6, 2)
    start_b = b.layer_start(0)
    for i in range(10):  # b sits out while a decodes
        with p.start_forward([a]) as batch:
            batch.put(0, tok(1, i), tok(1, i))
            batch.put(1, tok(1, i), tok(1, i))
    assert a.layer_start(0) > start_b and b.layer_start(0) == start_b
    with p.start_forward([a, b]) as batch:
        for layer in range(2):
            batch.put(layer, tok(2, 50 + layer), tok(2, 60 + layer))
        _, _, mask = batch.get(0)
        assert (mask == 0).sum(axis=1).tolist() == [4, 4]  # a full window each
    assert b.seq_len == 7


def test_can_resume_with_and_without_swa_memory():
    for memory, start in [(0, 12), (4, 8)]:
        p = pool(["sliding", "full"], sliding_window=4, swa_memory=memory)
        seq = p.new_sequence()
        step(seq, 16, 1)
        # Window 4 at 16 sees 13..16: kept from 13 - memory, rounded down to a block.
        assert seq.layer_start(0) == start
        # A token at p sees p - 3..p: resumable from start + 3 (and at 0: nothing to see).
        assert [q for q in range(18) if seq.can_resume(q)] == [0, *range(start + 3, 17)]
        # Rolling back within the memory keeps the window: the batch may continue.
        seq.truncate(start + 3)
        with p.start_forward([seq]) as batch:
            batch.put(0, tok(1), tok(1))
            batch.put(1, tok(1), tok(1))
        assert seq.seq_len == start + 4


def test_a_rollback_past_the_window_refuses_to_continue():
    p = pool(["sliding", "full"], sliding_window=4)
    seq = p.new_sequence()
    step(seq, 16, 1)
    seq.truncate(9)
    assert not seq.can_resume(9)
    before = (p.stats(), seq.seq_len)
    with pytest.raises(ValueError, match="cannot continue at position 9"):
        p.start_forward([seq])
    assert (p.stats(), seq.seq_len) == before
    seq.truncate(0)
    assert seq.can_resume(0)
    p.start_forward([seq]).cancel()


def test_prefix_hit_with_sliding_layers_attaches_only_the_window():
    p = pool(["sliding", "sliding"], sliding_window=5)
    prompt = list(range(40))
    a = p.new_sequence(tokens=prompt)
    ks = step(a, 40, 7, tokens=None)
    # The prompt's first blocks were released, but stay cached (evictable) for reuse.
    b = p.new_sequence(tokens=[*prompt, 99])
    assert b.num_cached_tokens == 40 and p.match_prefix([*prompt, 99]) == 40
    # A token at 40 sees 36..40: only the block 36..39 is attached.
    assert b.layer_start(0) == 36 and sum(x >= 0 for x in b.layer_blocks(0)) == 1
    np.testing.assert_array_equal(b.get(1)[0], ks[1][36:].transpose(1, 0, 2))
    # Evict everything no sequence holds: the window's block is still held by a and b.
    a.free()
    p.evict_all()
    assert p.match_prefix([*prompt, 99]) == 40


def test_prefix_hit_needs_every_full_block_and_the_window():
    p = pool(["full", "sliding"], sliding_window=3)
    prompt = list(range(24))
    a = p.new_sequence(tokens=prompt)
    step(a, 24, 3)
    a.free()
    assert p.match_prefix(prompt + [1]) == 24
    b = p.new_sequence(tokens=prompt + [1])
    assert b.num_cached_tokens == 24
    assert b.layer_start(0) == 0 and b.layer_start(1) == 20
    p.check_invariants()


def test_hugging_face_layer_type_names_and_argument_errors():
    p = pool(["full_attention", "sliding_attention"], sliding_window=4)
    assert p.layer_types == ["full", "sliding"] and p.sliding_window == 4 and p.chunk_size is None
    with pytest.raises(ValueError, match="sliding_window"):
        pool(["sliding"])
    with pytest.raises(ValueError, match="layer_types"):
        pool(["full", "global"])
    with pytest.raises(ValueError, match="one entry per layer"):
        kvrs.BlockPool(3, H, D, num_blocks=4, layer_types=["full"])
    with pytest.raises(ValueError, match="chunk_size"):
        pool(["full"], chunk_size=0)
    seq = p.new_sequence()
    with pytest.raises(ValueError, match="name the layer"):
        p.page_table([seq])
    with pytest.raises(ValueError, match="name the layer"):
        seq.block_table  # noqa: B018
    p.page_table([seq], layer=1)


def test_page_table_and_kv_cache_of_a_grouped_pool_address_the_same_memory():
    p = pool(["sliding", "full", "sliding", "full"], sliding_window=4, dtype="float16")
    seq = p.new_sequence()
    step(seq, 11, 5)
    for layer in range(4):
        _, indices, last = p.page_table([seq], layer=layer)
        cache = p.kv_cache(layer)
        first = seq.layer_start(layer)
        k_pages = cache[indices, 0]  # [pages, BS, H, D]
        flat = k_pages.reshape(-1, H, D)[first % BS : first % BS + seq.layer_len(layer) - first]
        np.testing.assert_array_equal(flat.transpose(1, 0, 2), seq.get(layer)[0])
        assert last[0] == (seq.layer_len(layer) - 1) % BS + 1
    slots = p.reserve([seq], [1])
    assert slots.shape == (2, 1)


def test_copy_to_cache_refuses_a_released_beginning():
    p = pool(["sliding", "full"], sliding_window=2)
    seq = p.new_sequence()
    step(seq, 12, 1)
    cache = kvrs.KVCache(2, H, D, 32, dtype="float32")
    with pytest.raises(kvrs.NotSupportedError, match="no longer holds positions"):
        seq.copy_to_cache(cache)
    assert cache.seq_len == 0


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_shift_moves_the_tail_down_and_rerotates_keys(style):
    rope = kvrs.RoPE(theta=10000.0, style=style, rotary_dim=6)
    p = kvrs.BlockPool(1, H, D, block_size=BS, num_blocks=16, dtype="float32", rope=rope)
    raw = tok(20, 3)
    seq = p.new_sequence()
    seq.append(0, rope.apply(raw, np.arange(20)), raw)
    seq.advance(20)
    # llama.cpp's context shift: drop 5..9, move 10.. down by 5.
    seq.shift(10, None, -5)
    assert seq.seq_len == 15
    k, v = seq.get(0)
    kept = np.concatenate([raw[:5], raw[10:]])
    np.testing.assert_allclose(k, rope.apply(kept, np.arange(15)).transpose(1, 0, 2), atol=1e-5)
    np.testing.assert_array_equal(v, kept.transpose(1, 0, 2))
    # Positions falling below 0 are removed.
    seq.shift(0, None, -3)
    assert seq.seq_len == 12
    np.testing.assert_allclose(
        seq.get(0)[0], rope.apply(kept[3:], np.arange(12)).transpose(1, 0, 2), atol=1e-5
    )
    before = seq.get(0)[0].copy()
    for args in [(2, 6, -1), (4, None, 2)]:
        with pytest.raises(kvrs.NotSupportedError):
            seq.shift(*args)
    np.testing.assert_array_equal(seq.get(0)[0], before)
    seq.shift(3, None, 0)
    assert seq.seq_len == 12


def test_shift_without_rope_is_not_supported_and_changes_nothing():
    p = kvrs.BlockPool(1, H, D, block_size=BS, num_blocks=8, dtype="float32")
    seq = p.new_sequence()
    step(seq, 10, 1)
    with pytest.raises(kvrs.NotSupportedError, match="rope"):
        seq.shift(5, None, -2)
    assert seq.seq_len == 10
    seq.shift(0, None, -20)  # everything falls below 0: a plain cut
    assert seq.seq_len == 0


def test_shift_of_a_forked_sequence_leaves_the_other_unchanged():
    rope = kvrs.RoPE()
    p = pool(["full", "sliding"], sliding_window=6, rope=rope)
    a = p.new_sequence()
    step(a, 12, 4)
    b = a.fork()
    before = [a.get(layer)[0].copy() for layer in range(2)]
    b.shift(8, None, -4)
    assert [np.array_equal(a.get(layer)[0], before[layer]) for layer in range(2)] == [True, True]
    assert b.seq_len == 8 and a.seq_len == 12
    p.check_invariants()


@settings(max_examples=30, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["full", "sliding", "chunked"]), min_size=1, max_size=6),
    window=st.integers(1, 12),
    chunk=st.integers(1, 12),
    swa=st.integers(0, 6),
    seq_len=st.integers(0, 48),
    max_chunk=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_blocks_per_sequence_is_the_peak_a_sequence_reaches(
    kinds, window, chunk, swa, seq_len, max_chunk, seed
):
    """A pool of exactly kvrs.blocks_per_sequence blocks takes a sequence to seq_len in
    passes of at most max_chunk tokens, whatever their sizes; and some sequence (passes
    up to a position, then one of max_chunk) holds that many blocks at once: the bound is
    the peak, not a guess above it."""
    kw = dict(sliding_window=window, chunk_size=chunk, swa_memory=swa)
    need = kvrs.blocks_per_sequence(seq_len, block_size=BS, max_chunk=max_chunk, layer_types=kinds, **kw)
    rng = np.random.default_rng(seed)

    def grow(passes):
        """Runs a sequence through `passes` (new tokens each) in a pool of `need` blocks;
        returns the most blocks it held."""
        p = pool(kinds, num_blocks=max(need, 1), **kw)
        seq, peak = p.new_sequence(), 0
        for n in passes:
            for layer in range(len(kinds)):
                seq.append(layer, tok(n), tok(n))
            peak = max(peak, seq.num_blocks)
            seq.advance(n)
        p.check_invariants()
        return peak

    passes, left = [], seq_len
    while left:
        passes.append(int(rng.integers(1, min(max_chunk, left) + 1)))
        left -= passes[-1]
    assert grow(passes) <= need
    peaks = []
    for c in range(seq_len):
        to_c = [max_chunk] * (c // max_chunk) + ([c % max_chunk] if c % max_chunk else [])
        peaks.append(grow([*to_c, min(max_chunk, seq_len - c)]))
    assert max(peaks, default=0) == need
