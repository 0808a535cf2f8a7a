"""Sequence.accept: committing the accepted path of speculative decoding.

Scenarios of the documented semantics: a tree's accepted nodes moved to the front in
every layer, token ids moving with them and the prefix cache taking them only then;
drafts that no batch committed; refusals that change nothing; forks that keep their own
K/V; 8-bit pools; hybrid pools restoring a state checkpoint. The property test of the
same rules against a reference is tests/spec_model.rs.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

L, H, D, BS = 2, 1, 4, 4


def kv(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H, D)).astype(np.float32)


def prefilled(pool, prompt):
    seq = pool.new_sequence(tokens=prompt)
    ks = [kv(len(prompt), layer) for layer in range(L)]
    for layer in range(L):
        seq.append(layer, ks[layer], -ks[layer])
    seq.advance(len(prompt), tokens=prompt)
    return seq, ks


def draft(pool, seq, tokens, commit=True, **kw):
    """One forward of draft `tokens` after `seq`: returns each layer's K written."""
    batch = pool.start_forward([seq] * len(tokens), tokens=tokens, **kw)
    ks = [kv(len(tokens), 10 + layer) for layer in range(L)]
    for layer in range(L):
        batch.put(layer, ks[layer], -ks[layer])
    if commit:
        batch.finish()
    return batch, ks


def test_a_tree_path_moves_to_the_front_and_only_then_is_cached():
    pool = kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=32, dtype="float32", prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6]
    seq, ks = prefilled(pool, prompt)
    # A tree: root 7, its children 8 and 9, 9's child 10, 8's child 11.
    tree = [7, 8, 9, 10, 11]
    _, dk = draft(pool, seq, tree, draft=True)
    assert seq.seq_len == 11
    # Drafts stay out of the prefix cache: only the prompt's first block is a hit.
    probe = pool.new_sequence(tokens=prompt + tree[:2] + [0])
    assert probe.num_cached_tokens == 4
    probe.free()
    seq.accept(6, [0, 2, 3])  # the path 7 -> 9 -> 10
    assert seq.seq_len == 9 and seq.layer_len(0) == seq.layer_len(1) == 9
    assert seq.token_ids.tolist() == prompt + [7, 9, 10]
    for layer in range(L):
        k, v = seq.get(layer)
        want = np.concatenate([ks[layer], dk[layer][[0, 2, 3]]]).transpose(1, 0, 2)
        np.testing.assert_array_equal(k, want)
        np.testing.assert_array_equal(v, -want)
    # The accepted path is cached: a prompt that continues it hits both full blocks.
    hit = pool.new_sequence(tokens=prompt + [7, 9, 10, 99])
    assert hit.num_cached_tokens == 8
    np.testing.assert_array_equal(hit.get(0)[0][:, :8], seq.get(0)[0][:, :8])
    pool.check_invariants()


def test_drafts_no_batch_committed_are_committed_by_the_caller():
    pool = kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=32, dtype="float32", prefix_caching=True)
    seq, _ = prefilled(pool, [1, 2, 3])
    batch, dk = draft(pool, seq, [7, 8, 9], commit=False)
    seq.accept(3, [1, 2])
    assert seq.seq_len == 3 and seq.layer_len(0) == 5
    with pytest.raises(ValueError, match="stale"):
        batch.finish()
    seq.advance(2, tokens=[8, 9])
    assert seq.token_ids.tolist() == [1, 2, 3, 8, 9]
    np.testing.assert_array_equal(seq.get(1)[0][:, 3:], dk[1][[1, 2]].transpose(1, 0, 2))
    # Rejecting everything is a rollback to start.
    draft(pool, seq, [4, 4])
    seq.accept(5, [])
    assert seq.seq_len == 5 and seq.token_ids.tolist() == [1, 2, 3, 8, 9]
    pool.check_invariants()


def test_refusals_name_the_argument_and_change_nothing():
    pool = kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=32, dtype="float32")
    seq, _ = prefilled(pool, [1, 2, 3])
    draft(pool, seq, [7, 8, 9])
    before = [seq.get(layer) for layer in range(L)]
    for start, keep, match in [
        (3, [1, 1], "strictly increasing"),
        (3, [0, 3], r"past what every layer .* below 3"),
        (3, [-1], "strictly increasing"),
        (7, [0], "committed length"),
    ]:
        with pytest.raises(ValueError, match=match):
            seq.accept(start, keep)
        assert seq.seq_len == 6
        for layer in range(L):
            np.testing.assert_array_equal(seq.get(layer)[0], before[layer][0])
    with pytest.raises(TypeError):
        seq.accept(3, [0.5])
    pool.check_invariants()


def test_a_fork_keeps_its_drafts_and_the_accepting_side_copies():
    pool = kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=32, dtype="float32")
    seq, _ = prefilled(pool, [1, 2])
    _, dk = draft(pool, seq, [5, 6, 7, 8])
    child = seq.fork()
    before = child.get(0)[0].copy()
    seq.accept(2, [1, 3])
    np.testing.assert_array_equal(child.get(0)[0], before)
    np.testing.assert_array_equal(seq.get(0)[0][:, 2:], dk[0][[1, 3]].transpose(1, 0, 2))
    assert child.seq_len == 6 and seq.seq_len == 4
    pool.check_invariants()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "bfloat16"])
def test_quantized_and_half_pools_move_their_codes(dtype):
    pool = kvrs.BlockPool(L, H, D, block_size=BS, num_blocks=32, dtype=dtype)
    seq, _ = prefilled(pool, [1, 2, 3])
    draft(pool, seq, [5, 6, 7, 8, 9])
    full = seq.get(0, dequantize=True)[0].copy() if "8" in dtype else seq.get(0)[0].copy()
    seq.accept(3, [0, 2, 4])
    got = seq.get(0, dequantize=True)[0] if "8" in dtype else seq.get(0)[0]
    want = full[:, [0, 1, 2, 3, 5, 7]]
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0.07, atol=0.03
    )
    pool.check_invariants()


def test_a_hybrid_pool_restores_the_checkpoint_at_the_accepted_length():
    pool = kvrs.BlockPool(
        1,
        1,
        2,
        block_size=4,
        num_blocks=32,
        dtype="float32",
        state_layers=1,
        state_shapes={"h": (2,)},
        state_slots=4,
        seed=7,
    )
    seq = pool.new_sequence(tokens=[1, 2, 3])
    seq.append(0, np.ones((3, 1, 2), np.float32), np.ones((3, 1, 2), np.float32))
    seq.state(0)["h"][...] = 1.0
    seq.advance(3, tokens=[1, 2, 3])
    assert seq.checkpoint() and 3 in seq.checkpoints
    batch = pool.start_forward([seq] * 3, tokens=[4, 5, 6])
    batch.put(0, np.full((3, 1, 2), 2.0, np.float32), np.full((3, 1, 2), 2.0, np.float32))
    seq.state(0)["h"][...] = 2.0  # the recurrence ran over the three drafts
    batch.finish()
    # No state for the path's end: refused, nothing changed.
    with pytest.raises(kvrs.NotSupportedError, match="accept"):
        seq.accept(3, [0, 2])
    assert seq.seq_len == 6 and seq.state(0)["h"].tolist() == [2.0, 2.0]
    # Everything rejected: the checkpoint at 3 comes back; the caller runs the
    # accepted tokens again for the recurrent layers.
    seq.accept(3, [])
    assert seq.seq_len == 3 and seq.state(0)["h"].tolist() == [1.0, 1.0]
    pool.check_invariants()
