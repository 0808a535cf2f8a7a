"""RoPE and middle removal: moved keys equal keys rotated directly at their new positions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvrs

H, D = 2, 8
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def reference(x, positions, theta=10000.0, rotary_dim=None, style="neox", factor=1.0):
    """Rotary embedding as Hugging Face writes it (rotate_half) and as GPT-J pairs dims."""
    x = np.asarray(x, np.float64)
    rd = rotary_dim or x.shape[-1]
    inv = theta ** (-np.arange(0, rd, 2) / rd)
    ang = (np.asarray(positions, np.float64) / factor)[:, None] * inv[None, :]
    shape = (len(positions),) + (1,) * (x.ndim - 2) + (rd // 2,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    out = x.copy()
    if style == "neox":
        a, b = x[..., : rd // 2], x[..., rd // 2 : rd]
        out[..., : rd // 2], out[..., rd // 2 : rd] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2], out[..., 1:rd:2] = a * cos - b * sin, a * sin + b * cos
    return out


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("scaling", [None, ("linear", 4.0)])
def test_apply_matches_the_reference_and_composes(style, rotary_dim, scaling):
    rope = kvrs.RoPE(theta=10000.0, rotary_dim=rotary_dim, style=style, scaling=scaling)
    x = np.random.default_rng(0).standard_normal((6, H, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4000, 65000])
    factor = scaling[1] if scaling else 1.0
    np.testing.assert_allclose(
        rope.apply(x, pos), reference(x, pos, 10000.0, rotary_dim, style, factor), atol=1e-4
    )
    np.testing.assert_allclose(
        rope.apply(rope.apply(x, pos), -pos + 5), rope.apply(x, np.full(6, 5)), atol=1e-4
    )
    assert (rope.style, rope.rotary_dim, rope.scaling) == (style, rotary_dim, scaling)


def test_invalid_rope_descriptions():
    with pytest.raises(ValueError, match="style"):
        kvrs.RoPE(style="llama")
    with pytest.raises(ValueError, match="rotary_dim=3"):
        kvrs.RoPE(rotary_dim=3)
    with pytest.raises(ValueError, match="theta"):
        kvrs.RoPE(theta=0.5)
    with pytest.raises(ValueError, match="scaling"):
        kvrs.RoPE(scaling=("yarn", 2.0))
    with pytest.raises(ValueError, match="rotary_dim=16"):
        kvrs.BlockPool(1, H, D, num_blocks=4, rope=kvrs.RoPE(rotary_dim=16))


def build(dtype, style="neox", rotary_dim=None, n=23, tokens=None):
    """A pool with a RoPE and one sequence whose keys are `base` rotated at their positions."""
    rope = kvrs.RoPE(style=style, rotary_dim=rotary_dim)
    pool = kvrs.BlockPool(2, H, D, block_size=4, num_blocks=32, dtype=dtype, rope=rope, seed=3)
    rng = np.random.default_rng(1)
    base = rng.standard_normal((n, H, D)).astype(np.float32)
    vals = rng.standard_normal((n, H, D)).astype(np.float32)
    seq = pool.new_sequence(tokens=tokens)
    keys = rope.apply(base, np.arange(n))
    for layer in range(2):
        seq.append(layer, keys, vals)
    seq.advance(n, tokens=tokens)
    return pool, rope, seq, base, vals


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("style", "rotary_dim"), [("neox", None), ("gptj", None), ("neox", 4)])
@pytest.mark.parametrize(("begin", "end"), [(5, 9), (0, 4), (3, 22), (10, 11)])
def test_middle_removal_rerotates_later_keys(dtype, style, rotary_dim, begin, end):
    pool, rope, seq, base, vals = build(dtype, style, rotary_dim)
    seq.remove(begin, end)
    n = 23 - (end - begin)
    assert seq.seq_len == n and seq.layer_len(1) == n
    kept = np.concatenate([np.arange(begin), np.arange(end, 23)])
    expect_k = rope.apply(base[kept], np.arange(n))  # rotated directly at the new positions
    K, V = seq.get(1)
    scale = TOL[dtype] * max(1.0, float(np.abs(expect_k).max()))
    np.testing.assert_allclose(K.astype(np.float32), expect_k.transpose(1, 0, 2), atol=scale)
    np.testing.assert_array_equal(V, vals[kept].astype(NP[dtype]).transpose(1, 0, 2))
    pool.check_invariants()


def test_removal_leaves_forks_and_cached_prefixes_alone():
    tokens = list(range(50, 73))
    pool, _, seq, _, _ = build("float32", tokens=tokens)
    fork = seq.fork()
    before = fork.get(0)[0].copy()
    seq.remove(6, 10)
    np.testing.assert_array_equal(fork.get(0)[0], before)
    assert list(seq.token_ids) == tokens[:6] + tokens[10:]
    # The original prompt's cached blocks still hold the original keys ...
    other = pool.new_sequence(tokens=tokens)
    assert other.num_cached_tokens == 20  # five full blocks
    np.testing.assert_array_equal(other.get(0)[0], before[:, :20])
    # ... and the shifted sequence caches nothing past the removal.
    assert pool.match_prefix(tokens[:6] + tokens[10:] + [0]) == 4 + 2  # block 0, then 2 of block 1
    pool.check_invariants()


def test_removal_is_all_or_nothing_when_copies_do_not_fit():
    pool = kvrs.BlockPool(1, H, D, block_size=4, num_blocks=4, dtype="float32", rope=kvrs.RoPE())
    seq = pool.new_sequence()
    seq.append(0, np.ones((16, H, D), np.float32), np.ones((16, H, D), np.float32))
    seq.advance(16)
    fork = seq.fork()  # every block shared: moving positions 4.. needs copies, none free
    with pytest.raises(kvrs.CacheFullError):
        seq.remove(2, 4)
    assert seq.seq_len == 16 and list(seq.block_table) == list(fork.block_table)
    pool.check_invariants()
