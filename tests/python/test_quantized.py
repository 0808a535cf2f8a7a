"""8-bit caches: fp8 (E4M3, E5M2) with per-layer scales and int8 with a scale per token
and head, against independent NumPy references of the formats (ml_dtypes' casts for fp8,
a float32 NumPy quantizer for int8), through every cache and every read path."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kvrs
from conftest import FP8, fp8_codes, int8_codes, quantized

EIGHT_BIT = ["fp8_e4m3", "fp8_e5m2", "int8"]


def fp8_grid(dtype: str) -> np.ndarray:
    """Every finite code's value, the midpoints between neighbours (ties), values just
    off them, zeros, values past the largest finite one and infinities."""
    name, top = FP8[dtype]
    values = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name)).astype(np.float32)
    values = np.unique(values[np.isfinite(values)])
    mids = (values[:-1] + values[1:]) / 2
    near = np.concatenate([mids * (1 + 2**-12), mids * (1 - 2**-12)])
    extra = np.array([0.0, -0.0, top * 1.03, -top * 1.2, 1e30, -1e30, np.inf, -np.inf], np.float32)
    return np.concatenate([values, mids, near, extra]).astype(np.float32)


def as_rows(x: np.ndarray, heads: int, dim: int) -> np.ndarray:
    """`x` padded with zeros into [n, heads, dim] tokens."""
    per = heads * dim
    n = -(-len(x) // per)
    out = np.zeros(n * per, np.float32)
    out[: len(x)] = x
    return out.reshape(n, heads, dim)


@pytest.mark.parametrize("dtype", list(FP8))
@pytest.mark.parametrize("scale", [1.0, 0.37, 8.0])
def test_fp8_codes_equal_ml_dtypes_casts_with_saturation_ties_subnormals_and_zeros(dtype, scale):
    h, d = 2, 16
    x = as_rows(fp8_grid(dtype) * np.float32(scale), h, d)
    cache = kvrs.KVCache(1, h, d, len(x), dtype=dtype, k_scale=scale, v_scale=scale)
    cache.append(0, x, -x)
    k, v = cache.get(0)
    assert k.dtype == np.dtype(getattr(ml_dtypes, FP8[dtype][0]))
    want = fp8_codes(x.transpose(1, 0, 2), dtype, scale)
    np.testing.assert_array_equal(k.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(
        v.view(np.uint8), fp8_codes(-x.transpose(1, 0, 2), dtype, scale).view(np.uint8)
    )
    assert np.isfinite(k.astype(np.float32)).all()  # saturated, never inf or NaN
    kd, _ = cache.get(0, dequantize=True)
    assert kd.dtype == np.float32
    np.testing.assert_array_equal(kd, want.astype(np.float32) * np.float32(scale))
    ks, _ = cache.scales(0)
    np.testing.assert_array_equal(ks, np.full((h, 1), scale, np.float32))
    np.testing.assert_array_equal(k.astype(np.float32) * ks[..., None], kd)


def test_fp8_nan_input_is_stored_as_nan():
    cache = kvrs.KVCache(1, 1, 4, 2, dtype="fp8_e4m3")
    cache.append(0, np.array([[[np.nan, 1.0, -np.nan, 2.0]]], np.float32), np.zeros((1, 1, 4), np.float32))
    k, _ = cache.get(0, dequantize=True)
    assert np.isnan(k[0, 0, [0, 2]]).all() and (k[0, 0, [1, 3]] == [1.0, 2.0]).all()


def test_int8_codes_and_scales_equal_the_reference_with_ties_and_zero_rows():
    h, d = 2, 4
    rows = np.array(
        [
            [[127.0, 63.5, -0.5, 2.5], [0.0, 0.0, 0.0, 0.0]],  # ties go to even; a zero row
            [[1e-30, -3e-30, 0.0, 2e-30], [-1e6, 1.0, 5e5, -0.25]],  # tiny and huge rows
        ],
        np.float32,
    )
    cache = kvrs.KVCache(1, h, d, 4, dtype="int8")
    cache.append(0, rows, rows * 2)
    k, _ = cache.get(0)
    ks, vs = cache.scales(0)
    codes, scales = int8_codes(rows.transpose(1, 0, 2))
    assert k.dtype == np.int8 and ks.shape == (h, 2)
    np.testing.assert_array_equal(k, codes)
    np.testing.assert_array_equal(ks, scales)
    assert list(k[0, 0]) == [127, 64, 0, 2] and ks[1, 0] == 0 and (k[1, 0] == 0).all()
    np.testing.assert_array_equal(vs, int8_codes(rows.transpose(1, 0, 2) * 2)[1])
    kd, _ = cache.get(0, dequantize=True)
    np.testing.assert_array_equal(kd, codes.astype(np.float32) * scales[..., None])


def test_int8_saturates_so_that_float32_max_and_infinities_read_back_finite():
    top = np.finfo(np.float32).max
    rows = np.array(
        [
            [[top, 1.0, -1e37, 0.0], [-top, 2e38, -3e38, 1e30]],
            [[np.inf, -1.0, 1e38, 0.5], [-np.inf, np.inf, top, -top]],
        ],
        np.float32,
    )
    cache = kvrs.KVCache(1, 2, 4, 2, dtype="int8")
    cache.append(0, rows, rows)
    cache.advance(2)
    k, _ = cache.get(0)
    ks, _ = cache.scales(0)
    codes, scales = int8_codes(rows.transpose(1, 0, 2))
    np.testing.assert_array_equal(k, codes)
    np.testing.assert_array_equal(ks, scales)
    # One float below max / 127, the largest scale whose 127 multiple is finite.
    assert ks[0, 0] == np.nextafter(top / np.float32(127), np.float32(0))
    assert k[0, 0, 0] == 127 and k[1, 0, 0] == -127 and list(k[1, 1]) == [-127, 127, 127, -127]
    kd, vd = cache.get(0, dequantize=True)
    assert np.isfinite(kd).all() and np.isfinite(vd).all()
    assert kd[0, 0, 0] == np.float32(127) * ks[0, 0]  # float32's max, less a few ulps
    out = cache.attention(0, np.ones((2, 2, 4), np.float32))
    assert np.isfinite(out).all(), out  # was NaN: the cache held inf

    pool = kvrs.BlockPool(1, 2, 4, block_size=2, num_blocks=2, dtype="int8")
    seq = pool.new_sequence()
    seq.append(0, rows, rows)
    seq.advance(2)
    assert np.isfinite(seq.get(0, dequantize=True)[0]).all()
    assert np.isfinite(seq.attention(0, np.ones((1, 2, 4), np.float32))).all()


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        (3, 2, 8),
        elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=True),
    ),
    dtype=st.sampled_from(EIGHT_BIT),
    src=st.sampled_from(["float32", "float16", "bfloat16"]),
)
def test_any_input_dtype_round_trips_as_the_reference_says(x, dtype, src):
    arr = x.astype(ml_dtypes.bfloat16 if src == "bfloat16" else src)
    exact = arr.astype(np.float32)
    cache = kvrs.KVCache(1, 2, 8, 4, dtype=dtype, **({"k_scale": 0.5} if dtype != "int8" else {}))
    cache.append(0, arr, arr)
    k, v = cache.get(0, dequantize=True)
    scale = 0.5 if dtype != "int8" else 1.0
    np.testing.assert_array_equal(k, quantized(exact, dtype, scale).transpose(1, 0, 2))
    np.testing.assert_array_equal(v, quantized(exact, dtype).transpose(1, 0, 2))


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pool_reads_codes_scales_and_values_in_both_layouts(dtype, layout):
    h, d, bs = 2, 8, 4
    rng = np.random.default_rng(1)
    scales = {"k_scale": [[0.5, 2.0]], "v_scale": 3.0} if dtype != "int8" else {}
    pool = kvrs.BlockPool(1, h, d, block_size=bs, num_blocks=6, dtype=dtype, layout=layout, **scales)
    k = rng.standard_normal((7, h, d)).astype(np.float32) * 4
    v = rng.standard_normal((7, h, d)).astype(np.float32)
    seq = pool.new_sequence()
    seq.append(0, k, v)
    seq.advance(7)
    kd, vd = seq.get(0, dequantize=True)
    if dtype == "int8":
        want_k, want_v = quantized(k, dtype), quantized(v, dtype)
    else:
        want_k = fp8_codes(k, dtype, np.array([0.5, 2.0], np.float32)[:, None]).astype(np.float32)
        want_k = want_k * np.array([0.5, 2.0], np.float32)[:, None]
        want_v = quantized(v, dtype, 3.0)
    np.testing.assert_array_equal(kd, want_k.transpose(1, 0, 2))
    np.testing.assert_array_equal(vd, want_v.transpose(1, 0, 2))
    codes, _ = seq.get(0)
    ks, _ = seq.scales(0)
    np.testing.assert_array_equal(codes.astype(np.float32) * ks[..., None], kd)
    assert pool.kv_cache(0).dtype == codes.dtype
    if dtype == "int8":
        np.testing.assert_array_equal(ks, int8_codes(k.transpose(1, 0, 2))[1])
        table = seq.block_table
        sc = pool.scale_cache(0)  # [blocks, 2, bs, h] (NHD) or [blocks, 2, h, bs] (HND)
        for p in range(7):
            b, o = table[p // bs], p % bs
            got = sc[b, 0, o, :] if layout == "NHD" else sc[b, 0, :, o]
            np.testing.assert_array_equal(got, ks[:, p])
        assert pool.k_scale is None
    else:
        np.testing.assert_array_equal(pool.k_scale, [[0.5, 2.0]])
        np.testing.assert_array_equal(ks[:, 0], [0.5, 2.0])
        with pytest.raises(kvrs.NotSupportedError, match="scale_cache"):
            pool.scale_cache(0)
    # extract_block and the forward batch's gather dequantize too.
    ek, _ = seq.extract_block(0, 4, 4)
    np.testing.assert_array_equal(ek[:, :3], kd[:, 4:7])
    assert ek.dtype == np.float32 and (ek[:, 3] == 0).all()


def reference_attention(q, k, v, lo, hi):
    """softmax(q k^T / sqrt(d)) v per query row over positions lo[i]..hi[i], in float64;
    q [n, Hq, D], k and v [H, T, D]."""
    n, hq, d = q.shape
    g = hq // k.shape[0]
    out = np.zeros((n, hq, d))
    for i in range(n):
        for j in range(hq):
            kk, vv = k[j // g, lo[i] : hi[i]].astype(np.float64), v[j // g, lo[i] : hi[i]].astype(np.float64)
            s = kk @ q[i, j].astype(np.float64) / np.sqrt(d)
            w = np.exp(s - s.max())
            out[i, j] = w @ vv / w.sum()
    return out


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_attention_reads_the_quantized_blocks_in_place(dtype):
    h, hq, d, n = 2, 4, 32, 45
    rng = np.random.default_rng(2)
    k = rng.standard_normal((n, h, d)).astype(np.float32)
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    q = rng.standard_normal((3, hq, d)).astype(np.float32)
    kw = {"k_scale": 0.05, "v_scale": [0.1]} if dtype != "int8" else {}
    # Pool, paged: the last three tokens' queries, causal.
    pool = kvrs.BlockPool(1, h, d, block_size=8, num_blocks=8, dtype=dtype, **kw)
    seq = pool.new_sequence()
    seq.append(0, k, v)
    seq.advance(n)
    kd, vd = seq.get(0, dequantize=True)
    lo, hi = [0, 0, 0], [n - 2, n - 1, n]
    want = reference_attention(q, kd, vd, lo, hi)
    np.testing.assert_allclose(seq.attention(0, q), want, atol=2e-5, rtol=1e-4)
    # The same over dequantized float32 K/V in a float32 pool: the kernel sees the values.
    ref_pool = kvrs.BlockPool(1, h, d, block_size=8, num_blocks=8, dtype="float32")
    ref_seq = ref_pool.new_sequence()
    ref_seq.append(0, kd.transpose(1, 0, 2), vd.transpose(1, 0, 2))
    ref_seq.advance(n)
    np.testing.assert_allclose(seq.attention(0, q), ref_seq.attention(0, q), atol=1e-6, rtol=1e-5)
    # Contiguous cache with a window, and the encoder cache without a mask.
    cache = kvrs.KVCache(1, h, d, 64, dtype=dtype, **kw)
    cache.append(0, k, v)
    cache.advance(n)
    ck, cv = cache.get(0, dequantize=True)
    got = cache.attention(0, q, window=10)
    np.testing.assert_allclose(
        got, reference_attention(q, ck, cv, [n - 12, n - 11, n - 10], hi), atol=2e-5, rtol=1e-4
    )
    enc = kvrs.EncoderCache(1, h, d, 64, dtype=dtype, **kw)
    enc.set(0, k, v)
    ek, ev = enc.get(0, dequantize=True)
    codes, _ = enc.get(0)
    np.testing.assert_array_equal(codes.astype(np.float32) * enc.scales(0)[0][..., None], ek)
    np.testing.assert_allclose(
        enc.attention(0, q), reference_attention(q, ek, ev, [0] * 3, [n] * 3), atol=2e-5, rtol=1e-4
    )


def test_memory_counts_codes_and_int8_scales():
    L, h, d, bs = 4, 8, 128, 16
    per_block = {
        dt: kvrs.BlockPool(L, h, d, block_size=bs, num_blocks=2, dtype=dt).bytes_per_block
        for dt in ["float16", "fp8_e4m3", "fp8_e5m2", "int8"]
    }
    assert per_block["float16"] == L * 2 * bs * h * d * 2
    assert per_block["fp8_e4m3"] == per_block["fp8_e5m2"] == per_block["float16"] // 2
    assert per_block["int8"] == L * 2 * bs * h * (d + 4)
    assert per_block["float16"] / per_block["int8"] >= 1.9
    pool = kvrs.BlockPool(L, h, d, block_size=bs, memory_bytes="1MiB", dtype="int8")
    assert pool.num_blocks == (1 << 20) // per_block["int8"]
    assert pool.stats()["bytes_total"] == pool.num_blocks * per_block["int8"]
    seq = pool.new_sequence()
    seq.append(0, np.ones((3, h, d), np.float32), np.ones((3, h, d), np.float32))
    assert seq.memory_bytes() == per_block["int8"]
    cache = kvrs.KVCache(L, h, d, 32, dtype="int8")
    assert cache.memory_bytes() == 2 * L * h * 32 * (d + 4)
    assert kvrs.KVCache(L, h, d, 32, dtype="fp8_e5m2").memory_bytes() == 2 * L * h * 32 * d


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_forks_and_copy_on_write_keep_each_sides_codes_and_scales(dtype):
    h, d = 2, 4
    pool = kvrs.BlockPool(1, h, d, block_size=4, num_blocks=8, dtype=dtype)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((6, h, d)).astype(np.float32)
    a = pool.new_sequence()
    a.append(0, k, k)
    a.advance(6)
    b = a.fork()
    # Both write position 6 of the shared last block: each gets its own copy.
    ka, kb = k[:1] * 10, k[:1] * 0.01
    a.append(0, ka, ka)
    b.append(0, kb, kb)
    ga, _ = a.get(0, dequantize=True)
    gb, _ = b.get(0, dequantize=True)
    np.testing.assert_array_equal(ga[:, :6], gb[:, :6])
    np.testing.assert_array_equal(ga[:, 6], quantized(ka[0], dtype))
    np.testing.assert_array_equal(gb[:, 6], quantized(kb[0], dtype))
    pool.check_invariants()


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_prefix_cache_file_carries_codes_and_scales(tmp_path, dtype):
    h, d, bs = 2, 8, 4
    kw = {"k_scale": 0.25} if dtype != "int8" else {}
    pool = kvrs.BlockPool(2, h, d, block_size=bs, num_blocks=8, dtype=dtype, seed=7, **kw)
    tokens = list(range(1, 10))
    rng = np.random.default_rng(4)
    k = rng.standard_normal((9, h, d)).astype(np.float32)
    seq = pool.new_sequence(tokens=tokens)
    for layer in range(2):
        seq.append(layer, k, -k)
    seq.advance(9, tokens=tokens)
    want = [seq.get(layer, dequantize=True) for layer in range(2)]
    seq.free()
    path = tmp_path / "cache.safetensors"
    assert pool.save_prefix_cache(path) == 2
    fresh = kvrs.BlockPool(2, h, d, block_size=bs, num_blocks=8, dtype=dtype, seed=7, **kw)
    assert fresh.load_prefix_cache(path)["loaded"] == 2
    again = fresh.new_sequence(tokens=tokens)
    assert again.num_cached_tokens == 8
    for layer in range(2):
        got = again.get(layer, dequantize=True)
        np.testing.assert_array_equal(got[0], want[layer][0][:, :8])
        np.testing.assert_array_equal(got[1], want[layer][1][:, :8])
    other = "float16" if dtype == "int8" else "int8"
    with pytest.raises(ValueError, match="dtype"):
        kvrs.BlockPool(2, h, d, block_size=bs, num_blocks=8, dtype=other, seed=7).load_prefix_cache(path)
    if dtype != "int8":
        rescaled = kvrs.BlockPool(2, h, d, block_size=bs, num_blocks=8, dtype=dtype, seed=7, k_scale=0.5)
        with pytest.raises(ValueError, match="kv_scales"):
            rescaled.load_prefix_cache(path)


def test_a_float_kvcache_takes_an_8bit_sequence_dequantized_and_an_8bit_one_is_refused():
    pool = kvrs.BlockPool(1, 2, 4, block_size=4, num_blocks=4, dtype="int8")
    seq = pool.new_sequence()
    k = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    seq.append(0, k, k)
    seq.advance(3)
    cache = kvrs.KVCache(1, 2, 4, 8, dtype="float32")
    seq.copy_to_cache(cache)
    np.testing.assert_array_equal(cache.get(0)[0], seq.get(0, dequantize=True)[0])
    with pytest.raises(kvrs.NotSupportedError, match="int8 KVCache"):
        seq.copy_to_cache(kvrs.KVCache(1, 2, 4, 8, dtype="int8"))


def test_bad_scales_and_inputs_are_refused_and_change_nothing():
    with pytest.raises(ValueError, match="k_scale"):
        kvrs.KVCache(2, 2, 4, 8, dtype="int8", k_scale=0.5)
    with pytest.raises(ValueError, match="k_scale"):
        kvrs.BlockPool(2, 2, 4, num_blocks=2, dtype="float16", k_scale=0.5)
    with pytest.raises(ValueError, match="v_scale"):
        kvrs.KVCache(2, 2, 4, 8, dtype="fp8_e4m3", v_scale=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="k_scale"):
        kvrs.KVCache(2, 2, 4, 8, dtype="fp8_e4m3", k_scale=np.ones((3, 2)))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and > 0"):
            kvrs.EncoderCache(2, 2, 4, 8, dtype="fp8_e5m2", k_scale=bad)
    with pytest.raises(TypeError, match="k_scale"):
        kvrs.KVCache(2, 2, 4, 8, dtype="fp8_e4m3", k_scale="big")
    cache = kvrs.KVCache(1, 2, 4, 8, dtype="int8")
    cache.append(0, np.ones((2, 2, 4), np.float32), np.ones((2, 2, 4), np.float32))
    before = (cache.get(0)[0].copy(), cache.scales(0)[0].copy())
    with pytest.raises(TypeError):
        cache.append(0, np.ones((1, 2, 4), np.int8), np.ones((1, 2, 4), np.int8))
    with pytest.raises(ValueError):
        cache.append(0, np.ones((1, 3, 4), np.float32), np.ones((1, 3, 4), np.float32))
    np.testing.assert_array_equal(cache.get(0)[0], before[0])
    np.testing.assert_array_equal(cache.scales(0)[0], before[1])
    assert cache.layer_len(0) == 2


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_rope_shift_requantizes_moved_keys(dtype):
    d = 8
    rope = kvrs.RoPE(theta=10000.0)
    pool = kvrs.BlockPool(1, 1, d, block_size=4, num_blocks=4, dtype=dtype, rope=rope)
    rng = np.random.default_rng(5)
    pos = np.arange(6)
    raw = rng.standard_normal((6, 1, d)).astype(np.float32)
    k = rope.apply(raw, pos)
    seq = pool.new_sequence()
    seq.append(0, k, k)
    seq.advance(6)
    seq.remove(1, 3)
    got, _ = seq.get(0, dequantize=True)
    # Kept positions 0, 3, 4, 5 -> 0, 1, 2, 3, keys re-rotated by -2 for the moved ones.
    want = rope.apply(np.concatenate([raw[:1], raw[3:]]), np.arange(4)).transpose(1, 0, 2)
    # Two roundings (the first write, the rewrite of the rotated key), each within half a
    # step: 2^-3 (E5M2) or 2^-4 (E4M3) of the magnitude, or half of max|row| / 127.
    step = {"fp8_e5m2": 2**-2, "fp8_e4m3": 2**-3, "int8": 1 / 127}[dtype]
    assert np.all(np.abs(got - want) <= step * np.abs(want).max(axis=-1, keepdims=True) + 1e-6)
