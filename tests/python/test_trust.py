"""Regression tests for the defects of the trust review (issue 25, ../shared/reference/
defects.md): each failed on main at 7029241.

- GC under the pool lock: calls that build Python objects never hang when a garbage
  collection frees a Sequence in the middle of them.
- Stale batches: a ForwardBatch whose sequence was freed (and whose blocks were reused)
  raises instead of writing into the blocks' new holder; a batch keeps its sequences alive.
- Torn reads: Sequence.get returns a length and data read together.
- Overlapping input: a view of the cache handed back in is read as it was before the write.
- Another holder's K/V: positions claimed without a write read as zeros, in every path
  (set_seq_len, reserve, start_forward, after copy_prefix inside a block), and unwritten
  blocks are never cached.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kvrs

CHILD_TIMEOUT = 120


def run_child(code: str) -> None:
    """Runs `code` in a fresh interpreter; a hang is a failure (the watchdog), a crash too."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {CHILD_TIMEOUT} s: {e.stdout}\n{e.stderr}")
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"


# ----- 1. garbage collection under the pool's lock ---------------------------------------

GC_SETUP = """
import gc, sys
import numpy as np
import kvrs

gc.set_threshold(1, 1, 1)


class Cycle:
    # Holds a sequence only through a reference cycle: freed by the collector alone.
    def __init__(self, seq):
        self.me = self
        self.seq = seq
"""

GC_CALLS = {
    "page_table": "pool.page_table(live)",
    "block_tables": "pool.block_tables(live)",
    "reserve": "pool.reserve(live, [0] * len(live))",
    "stats": "pool.stats()",
    "scales": "live[0].scales(0)",
    "cached_tokens_by_tier": "live[0].cached_tokens_by_tier",
    "views": "live[0].views(0)",
    "get": "live[0].get(0)",
    "token_ids": "live[0].token_ids",
}


@pytest.mark.parametrize("call", sorted(GC_CALLS))
def test_a_collection_inside_a_pool_call_never_hangs(call):
    tiers = (
        "tiers=[kvrs.HostTier('1MiB')], model_id='m', seed=1,"
        if call in ("stats", "cached_tokens_by_tier")
        else ""
    )
    run_child(
        GC_SETUP
        + f"""
pool = kvrs.BlockPool(1, 2, 8, block_size=4, num_blocks=4096, dtype="int8", {tiers})
kv = np.ones((4, 2, 8), np.float32)
live = [pool.new_sequence(tokens=[1, 2, 3, 4, 5])]
live[0].append(0, kv, kv)
for i in range(3000):
    s = pool.new_sequence()
    s.append(0, kv[:1], kv[:1])
    Cycle(s)  # garbage at once, collected at the next allocation
    {GC_CALLS[call]}
assert pool.stats()["num_sequences"] < 3000, "the cycles were collected"
pool.check_invariants()
"""
    )


def test_a_sequence_dropped_while_another_thread_holds_the_lock_is_freed_later():
    pool = kvrs.BlockPool(1, 2, 64, block_size=16, num_blocks=512, dtype="float32")
    big = pool.new_sequence()
    kv = np.ones((4096, 2, 64), np.float32)
    stop = threading.Event()

    def copier():  # holds the lock, without the GIL, for most of its time
        while not stop.is_set():
            big.append(0, kv, kv)
            big.advance(len(kv))  # truncate drops committed positions (it left uncommitted ones,
            big.truncate(0)  # and the pool filled up whenever this thread ran ahead)

    t = threading.Thread(target=copier)
    t.start()
    try:
        for _ in range(200):
            s = pool.new_sequence()
            s.append(0, kv[:5], kv[:5])
            del s  # freed at once, or queued when the copier holds the lock
    finally:
        stop.set()
        t.join()
    big.free()
    assert pool.free_blocks == 512
    pool.check_invariants()


# ----- 2. stale batches ------------------------------------------------------------------


def small_pool(**kw):
    kw.setdefault("dtype", "float32")
    return kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=2, **kw)


def test_a_batch_whose_sequence_was_freed_and_reused_refuses_to_write():
    pool = small_pool(prefix_caching=False)
    a = pool.new_sequence()
    batch = pool.start_forward([a])
    a.free()
    b = pool.new_sequence()
    seven = np.full((1, 1, 4), 7, np.float32)
    b.append(0, seven, seven)  # takes the block the batch reserved
    with pytest.raises(ValueError, match="stale"):
        batch.put(0, -seven, -seven)
    for call in (lambda: batch.get(0), lambda: batch.attention(0, seven), batch.finish):
        with pytest.raises(ValueError, match="stale"):
            call()
    k, v = b.get(0)
    assert (k == 7).all() and (v == 7).all()
    pool.check_invariants()


def test_a_batch_whose_sequence_was_forked_or_cut_refuses_to_write():
    for change in (lambda s: s.fork(), lambda s: s.remove(0)):
        pool = small_pool(prefix_caching=False)
        a = pool.new_sequence()
        batch = pool.start_forward([a, a])
        fork = change(a)
        with pytest.raises(ValueError, match="stale"):
            batch.put(0, np.ones((2, 1, 4), np.float32), np.ones((2, 1, 4), np.float32))
        batch.cancel()
        del fork
        pool.check_invariants()


def kv(x, n):
    return np.full((n, 1, 4), x, np.float32), np.full((n, 1, 4), x, np.float32)


def test_a_batch_whose_sequence_was_truncated_within_its_block_is_stale():
    # The cut keeps the batch's block (its generation does not move): the sequence's
    # edit count tells.
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=4, dtype="float32")
    s = pool.new_sequence()
    s.append(0, *kv(1, 2))
    s.advance(2)
    batch = pool.start_forward([s])  # reserves position 2
    s.truncate(1)
    for call in (lambda: batch.put(0, *kv(7, 1)), lambda: batch.get(0), batch.finish):
        with pytest.raises(ValueError, match="stale"):
            call()
    assert s.seq_len == 1
    assert (s.get(0)[0] == 1).all()
    pool.check_invariants()


def test_cancelling_a_stale_batch_cuts_nothing_committed_since():
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=4, dtype="float32")
    s = pool.new_sequence()
    s.append(0, *kv(1, 2))
    s.advance(2)
    batch = pool.start_forward([s])
    s.truncate(1)
    s.append(0, *kv(5, 3))
    s.advance(3)
    batch.cancel()
    assert s.seq_len == 4
    assert s.get(0)[0].ravel()[::4].tolist() == [1, 5, 5, 5]
    # A batch whose sequence was committed past it by advance() alone is stale the same way.
    t = pool.new_sequence()
    batch = pool.start_forward([t])
    t.advance(1)
    batch.cancel()
    assert t.seq_len == 1
    pool.check_invariants()


def test_a_batch_that_put_some_layers_but_not_all_is_not_committed():
    pool = kvrs.BlockPool(2, 1, 4, block_size=4, num_blocks=4, dtype="float32", seed=1)
    s = pool.new_sequence(namespace="B")
    batch = pool.start_forward([s] * 4, tokens=[1, 2, 3, 4])
    batch.put(0, *kv(7, 4))
    with pytest.raises(ValueError, match=r"layers \[1\] were never put"):
        batch.finish()
    assert s.seq_len == 0 and pool.match_prefix([1, 2, 3, 4, 5], namespace="B") == 0
    batch.put(1, *kv(8, 4))
    batch.finish()
    assert s.seq_len == 4
    s.free()
    assert pool.match_prefix([1, 2, 3, 4, 5], namespace="B") == 4
    pool.check_invariants()


def test_a_batch_keeps_its_sequences_alive():
    pool = small_pool()
    batch = pool.start_forward([pool.new_sequence(), pool.new_sequence()], tokens=[5, 6])
    gc.collect()
    assert len(batch.sequences) == 2 and not any(s.is_freed for s in batch.sequences)
    batch.put(0, np.ones((2, 1, 4), np.float32), np.ones((2, 1, 4), np.float32))
    batch.finish()
    assert [s.seq_len for s in batch.sequences] == [1, 1]
    assert batch.token_ids.tolist() == [5, 6]


def test_a_batch_knows_the_token_ids_it_records():
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=8)
    prompt = pool.new_sequence(tokens=[9, 8, 7])
    blank = pool.new_sequence()
    batch = pool.start_forward([prompt, prompt, blank])
    assert batch.token_ids.tolist() == [9, 8, -1]
    batch.cancel()
    batch = pool.start_forward([prompt, blank], tokens=[9, 4])
    assert batch.token_ids.tolist() == [9, 4]
    batch.cancel()


# ----- 3. torn reads -----------------------------------------------------------------------


def test_get_reads_its_length_and_data_together():
    heads, dim = 2, 32
    pool = kvrs.BlockPool(1, heads, dim, block_size=16, num_blocks=64, dtype="float32")
    seq = pool.new_sequence()
    # Position p always holds p + 1: a torn read shows a zero or a foreign value.
    values = np.repeat(np.arange(1, 97, dtype=np.float32), heads * dim).reshape(96, heads, dim)
    seq.append(0, values[:64], values[:64])
    seq.advance(64)
    stop = threading.Event()
    bad: list[str] = []

    def editor():
        while not stop.is_set():
            seq.truncate(32)
            seq.append(0, values[32:64], values[32:64])
            seq.advance(32)
            seq.append(0, values[64:96], values[64:96])
            seq.advance(32)
            seq.truncate(64)

    def reader():
        for _ in range(3000):
            k, v = seq.get(0)
            n = k.shape[1]
            want = np.arange(1, n + 1, dtype=np.float32)
            if not (np.array_equal(k[0, :, 0], want) and np.array_equal(v[1, :, -1], want)):
                bad.append(f"length {n}: {k[0, :, 0]}")
                return

    threads = [threading.Thread(target=editor), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    threads[1].join()
    stop.set()
    threads[0].join()
    assert not bad, bad[0]


# ----- 4. inputs that overlap the cache --------------------------------------------------


def test_a_view_of_the_cache_written_back_reads_as_it_was():
    cache = kvrs.KVCache(1, 1, 8, 4, dtype="float32")
    key = np.arange(8, dtype=np.float32)
    cache.store_key(0, 0, 0, key)
    cache.advance(1)
    view = cache.keys_for(0, 0)[0, ::-1]  # the stored key, reversed, in the cache's memory
    cache.store_key(0, 0, 0, view)
    np.testing.assert_array_equal(cache.keys_for(0, 0)[0], key[::-1])

    pool = kvrs.BlockPool(1, 1, 1, block_size=4, num_blocks=2, dtype="float32")
    seq = pool.new_sequence()
    x = np.array([0, 8, 16, 24], np.float32).reshape(4, 1, 1)
    seq.append(0, x, x)
    layer = pool.kv_cache(0)  # [blocks, 2, block_size, heads, dim]
    block = int(seq.block_table[0])
    # The sequence's own K, reversed ([24, 16, 8, 0]), written over itself.
    reversed_k = layer[block, 0, ::-1].transpose(1, 0, 2)  # [heads, positions, dim]
    seq.inject_block(0, 0, 4, reversed_k, reversed_k)
    k, v = seq.get(0)
    np.testing.assert_array_equal(k[0, :, 0], [24, 16, 8, 0])
    np.testing.assert_array_equal(v[0, :, 0], [24, 16, 8, 0])


def test_an_output_that_overlaps_the_cache_is_refused():
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=2, dtype="float32")
    seq = pool.new_sequence()
    kv = np.ones((4, 1, 4), np.float32)
    seq.append(0, kv, kv)
    storage = pool.kv_cache(0)
    before = storage.copy()
    out_k = storage[1, 0].transpose(1, 0, 2)  # [heads, positions, dim] inside the pool
    with pytest.raises(ValueError, match="overlap"):
        seq.get(0, out=(out_k, np.zeros((1, 4, 4), np.float32)))
    with pytest.raises(ValueError, match="overlap"):
        seq.attention(0, np.ones((4, 1, 4), np.float32), out=storage[1, 0])
    np.testing.assert_array_equal(pool.kv_cache(0), before)
    q = np.ones((4, 1, 4), np.float32)
    with pytest.raises(ValueError, match="overlap q"):
        seq.attention(0, q, out=q)
    # An output that overlaps itself (a broadcast made writable) is refused as well.
    row = np.zeros((1, 4), np.float32)
    self_overlapping = np.lib.stride_tricks.as_strided(row, (4, 1, 4), (0, 16, 4), writeable=True)
    with pytest.raises(ValueError, match="overlap itself"):
        seq.attention(0, q, out=self_overlapping)
    assert not row.any()


# ----- 8. another holder's K/V -----------------------------------------------------------


def tenant_a_leaves_42(pool):
    a = pool.new_sequence(tokens=list(range(9)), namespace="A")
    kv = np.full((8, 1, 4), 42, np.float32)
    a.append(0, kv, kv)
    a.advance(8)
    a.free()


def test_set_seq_len_over_unwritten_positions_reads_zeros_and_caches_nothing():
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=2, dtype="float32")
    tenant_a_leaves_42(pool)
    b = pool.new_sequence(tokens=list(range(100, 109)), namespace="B")
    b.set_seq_len(8)  # evicts A's cached blocks and claims them unwritten
    k, v = b.get(0)
    assert k.shape == (1, 8, 4) and not k.any() and not v.any()
    b.free()
    assert pool.match_prefix(list(range(100, 109)), namespace="B") == 0


def test_reserved_positions_read_zeros_until_written():
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=2, dtype="float32")
    tenant_a_leaves_42(pool)
    b = pool.new_sequence()
    pool.reserve([b], [8])
    k, v = b.get(0)
    assert not k.any() and not v.any()
    assert all(not kk.any() for _, _, kk, _ in b.views(0))


def test_positions_cut_inside_a_block_read_zeros_when_reserved_again():
    # A block keeps its rows past a cut until it is claimed again: truncate, remove and a
    # fork's partial tail must not let a later reserve read the cut values.
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=4, dtype="float32")
    s = pool.new_sequence()
    s.append(0, *kv(7, 6))
    s.advance(6)
    s.truncate(1)
    pool.reserve([s], [3])
    k, v = s.get(0)
    assert (k[:, :1] == 7).all() and not k[:, 1:].any() and not v[:, 1:].any()
    t = pool.new_sequence()
    t.append(0, *kv(9, 6))
    t.advance(6)
    t.remove(2)
    pool.reserve([t], [4])
    k, _ = t.get(0)
    assert (k[:, :2] == 9).all() and not k[:, 2:].any()
    child = t.fork()
    child.truncate(1)
    pool.reserve([child], [2])
    k, _ = child.get(0)
    assert (k[:, :1] == 9).all() and not k[:, 1:].any()
    pool.check_invariants()


def test_a_partial_hit_reads_zeros_past_the_rows_it_matched():
    # The partial hit copies a cached block whose rows past the match belong to another
    # prompt's continuation: reserved there, they read as zeros.
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=8, dtype="float32", seed=1)
    a = pool.new_sequence(list(range(9)))
    a.append(0, *kv(5, 8))
    a.advance(8)
    a.free()
    b = pool.new_sequence([0, 1, 2, 3, 4, 5, 77, 78, 79])
    assert b.seq_len == 6
    pool.reserve([b], [2])
    k, v = b.get(0)
    assert (k[:, :6] == 5).all() and not k[:, 6:].any() and not v[:, 6:].any()
    pool.check_invariants()


@pytest.mark.parametrize("claim", ["reserve", "start_forward"])
def test_copy_prefix_inside_a_block_reads_zeros_where_the_copy_claims(claim):
    # The review's case (issue 37): src filled through reserve + put, copied inside a
    # block; the positions dst then claims held src's K/V (the shared block and its
    # copy-on-write copy were not flagged).
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=4, dtype="float32")
    src = pool.new_sequence()
    with pool.start_forward([src] * 3) as batch:
        batch.put(0, *kv(7, 3))
    dst = pool.new_sequence()
    pool.copy_prefix(src, dst, 1)
    if claim == "reserve":
        pool.reserve([dst], [2])
        k, v = dst.get(0)
    else:
        batch = pool.start_forward([dst] * 2)
        k, v, _ = batch.get(0)
        batch.cancel()
    assert (k[:, :1] == 7).all() and not k[:, 1:].any() and not v[:, 1:].any(), k
    assert (src.get(0)[0] == 7).all()
    pool.check_invariants()


def test_copy_prefix_keeps_the_destinations_namespace_and_extra_key():
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=16, dtype="float32", seed=1)
    src = pool.new_sequence([1, 2, 3, 4, 5], namespace="A")
    src.append(0, *kv(1, 4))
    src.advance(4)
    for dst in (pool.new_sequence(namespace="B"), pool.new_sequence(namespace="A", extra_key="lora-x")):
        with pytest.raises(ValueError, match="namespace or extra_key"):
            pool.copy_prefix(src, dst, 4)
        assert dst.seq_len == 0
        # n == 0 only empties dst: it stays in its own namespace and keeps its extra key.
        pool.copy_prefix(src, dst, 0)
        dst.append(0, *kv(666, 4))
        dst.advance(4, tokens=[9, 9, 9, 9])
        dst.free()
    assert pool.match_prefix([9, 9, 9, 9, 1], namespace="A") == 0
    assert pool.match_prefix([9, 9, 9, 9, 1], namespace="B") == 4
    assert pool.match_prefix([9, 9, 9, 9, 1], namespace="A", extra_key="lora-x") == 4
    same = pool.new_sequence(namespace="A")
    pool.copy_prefix(src, same, 4)
    assert (same.get(0)[0] == 1).all()
    pool.check_invariants()


def test_a_batch_reads_zeros_before_its_put():
    pool = kvrs.BlockPool(1, 1, 4, block_size=4, num_blocks=2, dtype="float32")
    tenant_a_leaves_42(pool)
    b = pool.new_sequence()
    with pool.start_forward([b] * 8) as batch:
        k, v, _ = batch.get(0)
        assert not k.any() and not v.any()
        out = batch.attention(0, np.ones((8, 1, 4), np.float32))
        assert not out.any()
        batch.cancel()
