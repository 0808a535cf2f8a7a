"""Prefix caching: hits, namespaces, eviction order, pins, events, stats, persistence."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvrs

L, H, D, BS = 2, 2, 4, 4


def pool(num_blocks=32, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("seed", 1234)
    kw.setdefault("events", True)
    return kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=num_blocks, **kw)


def kv_of(tokens, start, n):
    """K/V that depend on the token prefix, as a model's would ([n, H, D])."""
    out = np.empty((n, H, D), np.float32)
    for i, p in enumerate(range(start, start + n)):
        seed = hash(tuple(int(t) for t in tokens[: p + 1])) % (2**32)
        out[i] = np.random.default_rng(seed).integers(-32, 33, (H, D)) / 4
    return out


def prefill(seq, tokens):
    """Computes the uncached rest of `tokens` into `seq` and commits it with its ids."""
    start = seq.seq_len
    n = len(tokens) - start
    k = kv_of(tokens, start, n)
    for layer in range(L):
        seq.append(layer, k, -k)
    seq.advance(n, tokens=tokens[start:])
    return seq


def served(p, tokens, **kw):
    """A sequence started from `tokens`, prefilled to the end."""
    return prefill(p.new_sequence(tokens=tokens, **kw), tokens)


def check_content(seq, tokens):
    k = kv_of(tokens, 0, len(tokens))
    for layer in range(L):
        K, V = seq.get(layer)
        np.testing.assert_array_equal(K, k.transpose(1, 0, 2))
        np.testing.assert_array_equal(V, -k.transpose(1, 0, 2))


A = list(range(1, 11))  # 10 tokens: blocks [1..4], [5..8] fill; [9, 10] does not


def test_full_block_hits_share_blocks():
    p = pool()
    a = served(p, A)
    assert a.num_cached_tokens == 0
    assert p.stats()["cached_blocks"] == 2
    b = p.new_sequence(tokens=A + [50, 51])
    assert b.num_cached_tokens == 8
    assert list(b.block_table) == list(a.block_table[:2])  # shared, no copy
    prefill(b, A + [50, 51])
    check_content(b, A + [50, 51])
    check_content(a, A)
    p.check_invariants()


def test_partial_hit_copies_the_matching_beginning():
    p = pool()
    a = served(p, A)
    prompt = A[:6] + [99, 98, 97]
    assert p.match_prefix(prompt) == 6
    b = p.new_sequence(tokens=prompt)
    assert b.num_cached_tokens == 6  # block 0 whole, then 2 tokens of block 1
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]  # a fresh copy
    prefill(b, prompt)
    check_content(b, prompt)
    check_content(a, A)
    off = pool(partial_hits=False)
    served(off, A)
    assert off.new_sequence(tokens=prompt).num_cached_tokens == 4


def test_one_prompt_token_is_always_left_to_compute():
    p = pool()
    served(p, A[:8])
    s = p.new_sequence(tokens=A[:8])
    assert s.num_cached_tokens == 7  # block 0, then 3 tokens of block 1 copied
    prefill(s, A[:8])
    check_content(s, A[:8])
    assert pool(partial_hits=False).new_sequence(tokens=[1]).num_cached_tokens == 0


def test_namespaces_and_extra_keys_never_share():
    p = pool()
    served(p, A, namespace="tenant-a")
    assert p.match_prefix(A, namespace="tenant-a") == 8
    assert p.match_prefix(A) == 0
    assert p.match_prefix(A, namespace="tenant-b") == 0
    assert p.match_prefix(A, namespace=b"tenant-a") == 8  # str is its UTF-8 bytes
    served(p, A, extra_key="lora-1")
    assert p.match_prefix(A, extra_key="lora-1") == 8
    assert p.match_prefix(A, extra_key="lora-2") == 0
    assert p.match_prefix(A[:6] + [77], extra_key="lora-2") == 0  # no partial hit either


def test_different_seeds_do_not_match():
    a, b = pool(seed=1), pool(seed=2)
    served(a, A)
    served(b, A)
    ha = [e["block_hash"] for e in a.drain_events()]
    hb = [e["block_hash"] for e in b.drain_events()]
    assert ha and not set(ha) & set(hb)
    assert pool(seed=None).seed != pool(seed=None).seed  # random unless given


def test_freed_prompts_are_evicted_tail_first_in_lru_order():
    p = pool(num_blocks=8)
    x = served(p, list(range(100, 112)))  # 3 full blocks
    y = served(p, list(range(200, 212)))
    stored = p.drain_events()
    x_hashes = [e["block_hash"] for e in stored[:3]]
    y_hashes = [e["block_hash"] for e in stored[3:]]
    x.free()
    y.free()
    st = p.stats()
    assert (st["cached_blocks"], st["evictable_blocks"], st["free_blocks"]) == (6, 6, 8)
    # A sequence without token ids needs 3 blocks: 2 are free, 1 must be evicted.
    z = p.new_sequence()
    z.append(0, np.zeros((12, H, D), np.float32), np.zeros((12, H, D), np.float32))
    removed = [e for e in p.drain_events() if e["type"] == "removed"]
    assert [e["block_hash"] for e in removed] == [x_hashes[2]]  # x's tail, x freed first
    z.append(0, np.zeros((8, H, D), np.float32), np.zeros((8, H, D), np.float32))
    removed = [e["block_hash"] for e in p.drain_events() if e["type"] == "removed"]
    assert removed == [x_hashes[1], x_hashes[0]]
    assert p.match_prefix(list(range(200, 212)) + [1]) == 12  # y intact
    assert p.stats()["evictions"] == 3
    assert y_hashes


def test_unhashed_blocks_never_push_cached_ones_out():
    p = pool(num_blocks=6)
    served(p, list(range(100, 112))).free()  # 3 cached, evictable
    for _ in range(5):
        s = p.new_sequence()  # no token ids: its blocks go straight back to the free list
        s.append(0, np.zeros((12, H, D), np.float32), np.zeros((12, H, D), np.float32))
        s.free()
    assert p.stats()["evictions"] == 0
    assert p.match_prefix(list(range(100, 112)) + [0]) == 12


def test_pinned_prefixes_survive_pressure():
    p = pool(num_blocks=6)
    served(p, list(range(100, 112))).free()
    assert p.pin(list(range(100, 108))) == 8  # the first two blocks
    st = p.stats()
    assert st["evictable_blocks"] == 1 and st["used_blocks"] == 2
    s = p.new_sequence()
    with pytest.raises(kvrs.CacheFullError):
        s.append(0, np.zeros((20, H, D), np.float32), np.zeros((20, H, D), np.float32))
    s.append(0, np.zeros((16, H, D), np.float32), np.zeros((16, H, D), np.float32))  # evicts the third
    assert p.match_prefix(list(range(100, 112)) + [0]) == 8
    s.free()
    assert p.unpin(list(range(100, 108))) == 8
    assert p.stats()["evictable_blocks"] == 2
    assert p.evict_all() == 2
    assert p.stats()["cached_blocks"] == 0 and p.match_prefix(list(range(100, 112))) == 0


def test_events_describe_the_chain():
    p = pool()
    s = served(p, A)
    events = p.drain_events()
    assert [e["type"] for e in events] == ["stored", "stored"]
    assert events[1]["parent_hash"] == events[0]["block_hash"]
    assert all(e["num_tokens"] == BS and len(e["block_hash"]) == 32 for e in events)
    assert p.drain_events() == []
    p.evict_all()  # nothing evictable: the sequence still holds its blocks
    assert p.drain_events() == []
    s.free()
    assert p.evict_all() == 2
    removed = p.drain_events()
    assert [e["type"] for e in removed] == ["removed", "removed"]
    assert removed[0]["block_hash"] == events[1]["block_hash"]  # the tail goes first


def test_stats_count_queries_and_hits():
    p = pool()
    served(p, A)
    p.new_sequence(tokens=A + [1, 2])
    p.new_sequence(tokens=[7, 7, 7])
    st = p.stats()
    assert (st["prefix_queries"], st["prefix_query_tokens"], st["prefix_hit_tokens"]) == (3, 10 + 12 + 3, 8)
    assert st["hit_rate"] == pytest.approx(8 / 25)


def test_generated_tokens_are_cached_through_advance_and_batches():
    p = pool()
    s = served(p, [5, 6, 7])
    k = kv_of([5, 6, 7, 8], 3, 1)
    for layer in range(L):
        s.append(layer, k, -k)
    s.advance(1, tokens=[8])  # completes block 0
    t = p.new_sequence(tokens=[5, 6, 7])
    assert t.num_cached_tokens == 2  # a partial hit, one token left to compute
    prefill(t, [5, 6, 7])
    toks = [5, 6, 7, 9]
    with p.start_forward([t], [3], tokens=[9]) as batch:
        for layer in range(L):
            k = kv_of(toks, 3, 1)
            batch.put(layer, k, -k)
    assert list(t.token_ids) == toks
    assert p.match_prefix([5, 6, 7, 8, 0]) == 4 and p.match_prefix([5, 6, 7, 9, 0]) == 4
    assert p.stats()["cached_blocks"] == 2


def test_token_id_errors_leave_the_sequence_unchanged():
    p = pool()
    s = p.new_sequence(tokens=A)
    k = kv_of(A, 0, 3)
    for layer in range(L):
        s.append(layer, k, k)
    with pytest.raises(ValueError, match="already has token id 1"):
        s.advance(3, tokens=[9, 9, 9])
    with pytest.raises(ValueError, match="one id per committed token"):
        s.advance(3, tokens=[1])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        s.advance(3, tokens=[1, 2, -3])
    assert s.seq_len == 0
    bare = p.new_sequence()
    for layer in range(L):
        bare.append(layer, k, k)
    bare.advance(3)
    with pytest.raises(ValueError, match="knows token ids only up to position 0"):
        bare.advance(0, tokens=[])  # ids must continue from position 0
    with pytest.raises(TypeError, match="namespace must be str or bytes"):
        p.new_sequence(tokens=A, namespace=3)


def test_inject_extract_and_set_seq_len():
    p = pool()
    src = served(p, A)
    dst = p.new_sequence(tokens=A)  # cached: 8; inject only the rest from elsewhere
    keys, _ = src.extract_block(1, 8, 4)
    assert keys.shape == (H, 4, D) and not keys[:, 2:].any()  # past the end: zeros
    for layer in range(L):
        k, v = src.extract_block(layer, 8, 2)
        dst.inject_block(layer, 8, 2, k, v)
    dst.set_seq_len(10)
    check_content(dst, A)
    fresh = p.new_sequence(tokens=[40, 41, 42, 43, 44])
    for layer in range(L):
        k = kv_of([40, 41, 42, 43, 44], 0, 5).transpose(1, 0, 2)
        fresh.inject_block(layer, 0, 5, k, -k)
    fresh.set_seq_len(5)
    check_content(fresh, [40, 41, 42, 43, 44])
    assert p.match_prefix([40, 41, 42, 43, 44]) == 4  # its full block is cached
    fresh.set_seq_len(2)
    assert fresh.seq_len == 2 and fresh.num_blocks == 1
    with pytest.raises(IndexError, match="layer=2"):
        fresh.inject_block(2, 0, 1, np.zeros((H, 1, D), np.float32), np.zeros((H, 1, D), np.float32))


def test_kv_cache_and_sequence_round_trip():
    p = pool()
    s = served(p, A)
    cache = kvrs.KVCache(L, H, D, 16, dtype="float32")
    s.copy_to_cache(cache)
    assert cache.seq_len == 10
    for layer in range(L):
        np.testing.assert_array_equal(cache.get(layer)[0], s.get(layer)[0])
    back = p.new_sequence(tokens=A[:0])
    back.copy_from_cache(cache)
    check_content(back, A)
    with pytest.raises(ValueError, match="must be empty"):
        back.copy_from_cache(cache)
    with pytest.raises(kvrs.CacheFullError):
        s.copy_to_cache(kvrs.KVCache(L, H, D, 4, dtype="float32"))
    with pytest.raises(ValueError, match="must match the pool"):
        s.copy_to_cache(kvrs.KVCache(L + 1, H, D, 16))


def test_prefix_caching_off():
    p = pool(prefix_caching=False)
    assert p.hash is None and p.seed is None and not p.prefix_caching
    served(p, A).free()
    assert p.new_sequence(tokens=A).num_cached_tokens == 0
    assert p.stats()["cached_blocks"] == 0
    with pytest.raises(kvrs.NotSupportedError, match="prefix caching is off"):
        p.pin(A)


# ----- persistence ----------------------------------------------------------------------

LOAD_AND_CHECK = textwrap.dedent(
    """
    import sys, json, numpy as np, kvrs
    path, seed = sys.argv[1], int(sys.argv[2])
    p = kvrs.BlockPool(2, 2, 4, block_size=4, num_blocks=32, dtype="float32", seed=seed)
    report = p.load_prefix_cache(path)
    s = p.new_sequence(tokens=list(range(1, 11)))
    K, V = s.get(1)
    print(json.dumps({"report": report, "cached": s.num_cached_tokens, "k": K.tolist(), "v": V.tolist()}))
    """
)


def test_save_then_load_in_a_fresh_process(tmp_path):
    import json

    p = pool()
    served(p, A).free()
    served(p, list(range(50, 58)))
    path = tmp_path / "cache.safetensors"
    assert p.save_prefix_cache(path) == 4
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_CHECK, str(path), "1234"], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    assert got["report"] == {"loaded": 4, "skipped": 0}
    assert got["cached"] == 8
    here = p.new_sequence(tokens=A)
    K, V = here.get(1)
    np.testing.assert_array_equal(np.array(got["k"], np.float32), K)
    np.testing.assert_array_equal(np.array(got["v"], np.float32), V)


def saved(tmp_path, **kw):
    p = pool(**kw)
    served(p, A).free()
    path = tmp_path / "c.safetensors"
    p.save_prefix_cache(path)
    return path


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": 99}, "seed"),
        ({"hash": "xxh3"}, "hash"),
        ({"dtype": "float16"}, "dtype"),
        ({"layout": "HND"}, "layout"),
    ],
)
def test_mismatched_files_are_refused(tmp_path, kwargs, match):
    path = saved(tmp_path)
    other = pool(**kwargs)
    before = other.stats()
    with pytest.raises(ValueError, match=match):
        other.load_prefix_cache(path)
    assert other.stats() == before


def test_truncated_and_corrupted_files_are_refused(tmp_path):
    path = saved(tmp_path)
    data = path.read_bytes()
    target = pool()
    before = target.stats()
    for name, blob in [
        ("truncated", data[: len(data) - 7]),
        ("bit-flipped", data[:-20] + bytes([data[-20] ^ 1]) + data[-19:]),
        ("header", data[:12] + b"#" + data[13:]),
        ("empty", b""),
    ]:
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(blob)
        with pytest.raises(ValueError, match="nothing was loaded"):
            target.load_prefix_cache(bad)
        assert target.stats() == before, name
    with pytest.raises(OSError):
        target.load_prefix_cache(tmp_path / "missing.safetensors")


def test_loading_into_less_room_keeps_the_most_recent_whole_chains(tmp_path):
    p = pool()
    served(p, list(range(100, 112))).free()  # chain X: 3 blocks, freed first (older)
    served(p, list(range(200, 212))).free()  # chain Y: 3 blocks
    path = tmp_path / "c.safetensors"
    assert p.save_prefix_cache(path) == 6
    small = pool(num_blocks=4)
    holder = small.new_sequence()
    holder.append(0, np.zeros((4, H, D), np.float32), np.zeros((4, H, D), np.float32))
    report = small.load_prefix_cache(path)  # 3 free blocks
    assert report == {"loaded": 3, "skipped": 3}
    assert small.match_prefix(list(range(200, 212)) + [0]) == 12
    assert small.match_prefix(list(range(100, 112)) + [0]) == 0
    small.check_invariants()
    again = small.load_prefix_cache(path)  # Y is already cached; X has no room
    assert again["loaded"] == 0


def test_save_is_atomic_and_overwrites(tmp_path):
    path = saved(tmp_path)
    first = path.read_bytes()
    p = pool()
    served(p, list(range(60, 72))).free()
    p.save_prefix_cache(path)
    assert path.read_bytes() != first
    assert [f.name for f in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left


def test_events_are_opt_in():
    p = kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=8)
    served(p, A)
    with pytest.raises(kvrs.NotSupportedError, match="events=True"):
        p.drain_events()
