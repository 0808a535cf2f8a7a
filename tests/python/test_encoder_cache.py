"""kvrs.EncoderCache: cross-attention K/V written once per layer, reused by every step."""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

L, H, D = 3, 2, 4


def kv(n, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, H, D)).astype(np.float32)
    return x, -x


def test_set_once_then_get_views_every_step():
    enc = kvrs.EncoderCache(L, H, D, 16, dtype="float32")
    assert enc.length is None and not enc.is_complete
    k, v = kv(5)
    for layer in range(L):
        enc.set(layer, k, v)
    assert enc.length == 5 and enc.is_complete and enc.is_set(1)
    K, V = enc.get(2)
    assert K.shape == (H, 5, D) and not K.flags.writeable and K.base is enc
    np.testing.assert_array_equal(K, k.transpose(1, 0, 2))
    np.testing.assert_array_equal(V, v.transpose(1, 0, 2))
    assert np.shares_memory(K, enc.get(2)[0])  # the same memory at every step
    enc.clear()
    assert enc.length is None and not enc.is_set(0)
    k2, v2 = kv(9, seed=1)
    enc.set(0, k2, v2)  # the next input, in the same memory
    np.testing.assert_array_equal(enc.get(0)[0], k2.transpose(1, 0, 2))
    assert enc.memory_bytes() == 2 * L * H * 16 * D * 4


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda e: e.set(0, *kv(3)), ValueError, "layer=0: is already set"),
        (lambda e: e.set(1, *kv(4)), ValueError, "same 3 encoder positions"),
        (lambda e: e.set(3, *kv(3)), IndexError, "layer=3"),
        (lambda e: e.get(2), ValueError, "layer=2: is not set yet"),
        (lambda e: e.set(1, np.ones((3, H, D)), np.ones((3, H, D))), TypeError, "float64"),
        (lambda e: e.is_set(-1), IndexError, "layer=-1"),
    ],
)
def test_bad_input_leaves_the_cache_unchanged(call, exc, match):
    enc = kvrs.EncoderCache(L, H, D, 8, dtype="float16")
    enc.set(0, *kv(3))
    before = (enc.length, [enc.is_set(i) for i in range(L)], enc.get(0)[0].copy())
    with pytest.raises(exc, match=match):
        call(enc)
    after = (enc.length, [enc.is_set(i) for i in range(L)], enc.get(0)[0].copy())
    assert before[:2] == after[:2] and np.array_equal(before[2], after[2])


def test_capacity_and_sizes():
    enc = kvrs.EncoderCache(1, H, D, 4)
    with pytest.raises(kvrs.CacheFullError):
        enc.set(0, *kv(5))
    with pytest.raises(ValueError, match="at least one encoder position"):
        enc.set(0, np.zeros((0, H, D), np.float32), np.zeros((0, H, D), np.float32))
    with pytest.raises(ValueError, match="max_len=0"):
        kvrs.EncoderCache(1, H, D, 0)


def attend(q, K, V, mask=None):
    s = np.einsum("hd,htd->ht", q, K.astype(np.float32)) / np.sqrt(D)
    if mask is not None:
        s = s + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("ht,htd->hd", p / p.sum(-1, keepdims=True), V.astype(np.float32))


def test_encoder_decoder_decode_loop_beside_a_pool():
    """Self-attention through a pool sequence, cross-attention through an encoder cache."""
    rng = np.random.default_rng(3)
    enc_k, enc_v = kv(7, seed=4)
    pool = kvrs.BlockPool(1, H, D, block_size=4, num_blocks=8, dtype="float32")
    cross = kvrs.EncoderCache(1, H, D, 16, dtype="float32")
    cross.set(0, enc_k, enc_v)  # once, from the encoder output
    seq = pool.new_sequence()
    history_k, history_v = [], []
    for _ in range(6):
        q, k, v = (rng.standard_normal((1, H, D)).astype(np.float32) for _ in range(3))
        seq.append(0, k, v)
        seq.advance()
        history_k.append(k[0])
        history_v.append(v[0])
        out = attend(q[0], *seq.get(0)) + attend(q[0], *cross.get(0))
        ref = attend(q[0], np.stack(history_k, 1), np.stack(history_v, 1)) + attend(
            q[0], enc_k.transpose(1, 0, 2), enc_v.transpose(1, 0, 2)
        )
        np.testing.assert_allclose(out, ref, rtol=1e-6)
    assert cross.length == 7 and seq.seq_len == 6
