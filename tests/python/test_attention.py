"""Attention over the cache against an independent float64 NumPy reference.

The reference keeps every sequence's K/V as the test wrote them (rounded to the storage
dtype) and computes softmax attention with explicit windows, soft-capping, sinks and ALiBi;
hypothesis draws ragged batches (empty and one-token histories, partial last blocks, forks
sharing blocks, prefix-cache hits, sliding and chunked layers across window edges, GQA
ratios 1, 4 and 8, every dtype). One test also checks plain attention against torch SDPA.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvrs

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Output tolerance by the dtype of the queries (and so of the output).
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` as the cache holds it, in float64."""
    return x.astype(DTYPES[dtype]).astype(np.float64)


def reference(q, k, v, pos, lo, scale=None, softcap=None, sinks=None, alibi=None, hi=None):
    """Attention of one token (q [Hq, D]) at `pos` over keys k, values v [n, H, D] of its
    sequence, positions lo..hi (hi: pos + 1)."""
    hq, d = q.shape
    g = hq // k.shape[1]
    hi = pos + 1 if hi is None else hi
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((hq, d))
    for h in range(hq):
        keys, vals = k[lo:hi, h // g], v[lo:hi, h // g]
        s = keys @ q[h] * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        if alibi is not None:
            s = s + alibi[h] * (np.arange(lo, hi) - pos)
        m = s.max(initial=-np.inf)
        if sinks is not None:
            m = max(m, sinks[h])
        if m == -np.inf:
            continue
        w = np.exp(s - m)
        denom = w.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
        out[h] = w @ vals / denom
    return out


def first_visible(kind: str, pos: int, window: int, chunk: int) -> int:
    if kind == "sliding":
        return max(0, pos - window + 1)
    if kind == "chunked":
        return pos // chunk * chunk
    return 0


def close(got, want, dtype):
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, atol=tol, rtol=tol)


@st.composite
def options(draw, hq):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return {
        "scale": draw(st.sampled_from([None, 0.3])),
        "softcap": draw(st.sampled_from([None, 2.0])),
        "sinks": rng.standard_normal(hq).astype(np.float32) if draw(st.booleans()) else None,
        "alibi_slopes": (rng.uniform(0, 0.5, hq).astype(np.float32) if draw(st.booleans()) else None),
    }


def ref_options(opts):
    return {
        "scale": opts["scale"],
        "softcap": opts["softcap"],
        "sinks": opts["sinks"],
        "alibi": opts["alibi_slopes"],
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_ragged_batches_match_the_reference(data):
    dtype = data.draw(st.sampled_from(list(DTYPES)), label="dtype")
    q_dtype = data.draw(st.sampled_from(list(DTYPES)), label="q_dtype")
    layout = data.draw(st.sampled_from(["NHD", "HND"]), label="layout")
    block_size = data.draw(st.sampled_from([1, 3, 4, 16]), label="block_size")
    h = data.draw(st.sampled_from([1, 2]), label="kv_heads")
    ratio = data.draw(st.sampled_from([1, 4, 8]), label="gqa")
    d = data.draw(st.sampled_from([8, 64, 72]), label="head_dim")
    kind = data.draw(st.sampled_from(["full", "sliding", "chunked"]), label="kind")
    window, chunk = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    layer_types = ["full", kind]
    pool = kvrs.BlockPool(
        2,
        h,
        d,
        block_size=block_size,
        num_blocks=256,
        dtype=dtype,
        layout=layout,
        layer_types=layer_types,
        sliding_window=window if kind == "sliding" else None,
        chunk_size=chunk if kind == "chunked" else None,
        prefix_caching=True,
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    hq = h * ratio
    # Each sequence: its pool handle, its reference K/V per layer and its token ids.
    seqs: list[tuple[kvrs.Sequence, list, list, list[int]]] = []

    def extend(seq, ks, vs, tokens, n):
        for layer in range(2):
            k, v = rng.standard_normal((2, n, h, d)).astype(np.float32)
            seq.append(layer, k, v)
            ks[layer] = np.concatenate([ks[layer], stored(k, dtype)])
            vs[layer] = np.concatenate([vs[layer], stored(v, dtype)])
        new = rng.integers(0, 50, n).tolist()
        seq.advance(n, tokens=new)
        tokens.extend(new)

    for _ in range(data.draw(st.integers(1, 4), label="num_seqs")):
        how = data.draw(st.sampled_from(["new", "fork", "prefix"]) if seqs else st.just("new"))
        if how == "new":
            ks = [np.zeros((0, h, d))] * 2
            vs = [np.zeros((0, h, d))] * 2
            seq, tokens = pool.new_sequence(), []
            extend(seq, ks, vs, tokens, data.draw(st.integers(0, 20), label="history"))
        elif how == "fork":
            src = seqs[data.draw(st.integers(0, len(seqs) - 1))]
            seq, ks, vs, tokens = src[0].fork(), list(src[1]), list(src[2]), list(src[3])
        else:
            # A prompt that repeats another sequence's tokens gets its cached blocks.
            src = seqs[data.draw(st.integers(0, len(seqs) - 1))]
            seq = pool.new_sequence(tokens=src[3])
            n = seq.seq_len
            ks = [x[:n] for x in src[1]]
            vs = [x[:n] for x in src[2]]
            tokens = src[3][:n]
        seqs.append((seq, ks, vs, tokens))
    # The batch: 1..5 new tokens per sequence (decode and prefill chunks), interleaved.
    order = []
    for i in range(len(seqs)):
        order += [i] * data.draw(st.integers(1, 5), label="new_tokens")
    order = data.draw(st.permutations(order), label="order")
    n = len(order)
    batch = pool.start_forward([seqs[i][0] for i in order])
    k_new, v_new = rng.standard_normal((2, 2, n, h, d)).astype(np.float32)
    q = rng.standard_normal((2, n, hq, d)).astype(np.float32).astype(DTYPES[q_dtype])
    opts = data.draw(options(hq))
    positions = batch.positions
    for layer in range(2):
        batch.put(layer, k_new[layer], v_new[layer])
        got = batch.attention(layer, q[layer], **opts)
        assert got.dtype == np.dtype(DTYPES[q_dtype]) and got.shape == (n, hq, d)
        # The reference appends each sequence's new tokens in batch order.
        ks = {i: seqs[i][1][layer] for i in set(order)}
        vs = {i: seqs[i][2][layer] for i in set(order)}
        for t, i in enumerate(order):
            ks[i] = np.concatenate([ks[i], stored(k_new[layer, t : t + 1], dtype)])
            vs[i] = np.concatenate([vs[i], stored(v_new[layer, t : t + 1], dtype)])
        for t, i in enumerate(order):
            pos = int(positions[t])
            lo = first_visible(layer_types[layer], pos, window, chunk)
            want = reference(q[layer, t].astype(np.float64), ks[i], vs[i], pos, lo, **ref_options(opts))
            close(got[t], want, q_dtype)
    batch.finish()
    pool.check_invariants()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_prefill_and_extend_over_tile_edges_match_the_reference(data):
    """Many query rows per KV head take the tiled kernel (64-position K/V tiles, up to 128
    query rows per item): prompts and extensions whose lengths fall on either side of a
    tile, windows crossing tiles, wide GQA groups, every storage dtype (the reference reads
    the stored values back with get(dequantize=True)); bfloat16 storage with bfloat16
    queries (the scores AVX512-BF16's `vdpbf16ps` computes, where the CPU has it)."""
    dtype = data.draw(st.sampled_from([*DTYPES, "fp8_e4m3", "int8"]), label="dtype")
    h, ratio = data.draw(st.sampled_from([(1, 1), (2, 4), (1, 16)]), label="heads")
    d = data.draw(st.sampled_from([64, 128]), label="head_dim")
    cached = data.draw(st.sampled_from([0, 64, 77]), label="cached")
    n = data.draw(st.sampled_from([1, 63, 65, 130]), label="new")
    window = data.draw(st.sampled_from([None, 50, 100]), label="window")
    pool = kvrs.BlockPool(
        1,
        h,
        d,
        block_size=16,
        num_blocks=32,
        dtype=dtype,
        layer_types=["sliding" if window else "full"],
        sliding_window=window,
        prefix_caching=False,
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    seq = pool.new_sequence()
    if cached:
        seq.append(0, *rng.standard_normal((2, cached, h, d)).astype(np.float32))
        seq.advance(cached)
    seq.append(0, *rng.standard_normal((2, n, h, d)).astype(np.float32))
    hq = h * ratio
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    if dtype == "bfloat16":
        q = q.astype(ml_dtypes.bfloat16)
    opts = data.draw(options(hq))
    got = np.asarray(seq.attention(0, q, **opts), np.float32)
    k, v = (np.asarray(x, np.float64).transpose(1, 0, 2) for x in seq.get(0, dequantize=True))
    first = cached + n - k.shape[0]
    for t in range(n):
        pos = cached + t
        lo = max(first, first_visible("sliding" if window else "full", pos, window or 0, 0))
        # Positions count from the first one kept (ALiBi sees only their differences).
        want = reference(q[t].astype(np.float64), k, v, pos - first, lo - first, **ref_options(opts))
        close(got[t], want, "bfloat16" if dtype == "bfloat16" else "float32")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_plain_attention_equals_torch_sdpa_over_the_masked_history(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    h, hq, d = 2, 8, 64
    pool = kvrs.BlockPool(1, h, d, block_size=4, num_blocks=64, dtype=dtype)
    seqs = [pool.new_sequence() for _ in range(3)]
    for seq, n in zip(seqs, [5, 0, 9], strict=True):
        if n:
            seq.append(0, *rng.standard_normal((2, n, h, d)).astype(np.float32))
            seq.advance(n)
    batch = pool.start_forward([seqs[0], seqs[1], seqs[1], seqs[2]])
    batch.put(0, *rng.standard_normal((2, 4, h, d)).astype(np.float32))
    q = rng.standard_normal((4, hq, d)).astype(np.float32)
    got = batch.attention(0, q)
    keys, values, mask = batch.get(0)
    as_t = lambda x: torch.from_numpy(np.asarray(x, dtype=np.float32))  # noqa: E731
    want = torch.nn.functional.scaled_dot_product_attention(
        as_t(q).transpose(0, 1)[None],
        as_t(keys)[None],
        as_t(values)[None],
        attn_mask=as_t(mask),
        enable_gqa=True,
    )[0].transpose(0, 1)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)
    batch.finish()


def test_torch_queries_and_out_are_accepted():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    pool = kvrs.BlockPool(1, 2, 16, block_size=4, num_blocks=16, dtype="bfloat16")
    seq = pool.new_sequence()
    seq.append(0, *rng.standard_normal((2, 7, 2, 16)).astype(np.float32))
    q = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    out = np.zeros((3, 4, 16), dtype=ml_dtypes.bfloat16)
    assert seq.attention(0, q, out=out) is out
    k, v = seq.get(0)
    for t in range(3):
        keys, values = (np.asarray(x, np.float64).transpose(1, 0, 2) for x in (k, v))
        want = reference(q[t].float().numpy().astype(np.float64), keys, values, 4 + t, 0)
        close(out[t], want, "bfloat16")


def test_long_history_split_across_threads_matches_the_reference():
    """One sequence of thousands of tokens and one KV head: the history is split
    (flash-decoding) and merged by log-sum-exp."""
    rng = np.random.default_rng(3)
    n, d = 5000, 64
    pool = kvrs.BlockPool(1, 1, d, block_size=16, num_blocks=400, dtype="float16")
    seq = pool.new_sequence()
    k, v = rng.standard_normal((2, n, 1, d)).astype(np.float32)
    seq.append(0, k, v)
    q = rng.standard_normal((1, 8, d)).astype(np.float32) * 3
    sinks = rng.standard_normal(8).astype(np.float32)
    got = seq.attention(0, q, sinks=sinks)
    want = reference(
        q[0].astype(np.float64), stored(k, "float16"), stored(v, "float16"), n - 1, 0, sinks=sinks
    )
    close(got[0], want, "float32")


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_attention_sees_the_newest_tokens_causally(window):
    rng = np.random.default_rng(4)
    cache = kvrs.KVCache(2, 2, 32, 64, dtype="float16")
    k, v = rng.standard_normal((2, 10, 2, 32)).astype(np.float32)
    cache.append(1, k, v)
    q = rng.standard_normal((4, 4, 32)).astype(np.float32)
    got = cache.attention(1, q, window=window)
    for t in range(4):
        pos = 6 + t
        lo = 0 if window is None else max(0, pos - window + 1)
        want = reference(q[t].astype(np.float64), stored(k, "float16"), stored(v, "float16"), pos, lo)
        close(got[t], want, "float32")


def test_encoder_cache_cross_attention_sees_every_position():
    rng = np.random.default_rng(5)
    enc = kvrs.EncoderCache(1, 2, 16, 32, dtype="float32")
    k, v = rng.standard_normal((2, 12, 2, 16)).astype(np.float32)
    enc.set(0, k, v)
    q = rng.standard_normal((3, 2, 16)).astype(np.float32)
    got = enc.attention(0, q, softcap=1.5)
    for t in range(3):
        want = reference(q[t].astype(np.float64), stored(k, "float32"), stored(v, "float32"), 0, 0, hi=12,
                         softcap=1.5)  # fmt: skip
        close(got[t], want, "float32")


def test_bad_arguments_raise_and_change_nothing():
    rng = np.random.default_rng(6)
    pool = kvrs.BlockPool(2, 2, 8, block_size=4, num_blocks=16, dtype="float32")
    seq = pool.new_sequence()
    for layer in range(2):
        seq.append(layer, *rng.standard_normal((2, 5, 2, 8)).astype(np.float32))
    seq.advance(5)
    before = pool.stats()
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="num_q_heads"):
        seq.attention(0, q[:, :3])
    with pytest.raises(ValueError, match="q"):
        seq.attention(0, rng.standard_normal((2, 4, 7)).astype(np.float32))
    with pytest.raises(ValueError, match="at most 5 query tokens"):
        seq.attention(0, rng.standard_normal((6, 4, 8)).astype(np.float32))
    with pytest.raises(IndexError, match="layer"):
        seq.attention(2, q)
    with pytest.raises(ValueError, match="sinks"):
        seq.attention(0, q, sinks=[0.0, 1.0])
    with pytest.raises(ValueError, match="softcap"):
        seq.attention(0, q, softcap=-1.0)
    with pytest.raises(TypeError):
        seq.attention(0, q.astype(np.int32))
    with pytest.raises(ValueError, match="out"):
        seq.attention(0, q, out=np.zeros((2, 4, 8), np.float32)[:, ::-1])
    batch = pool.start_forward([seq])
    batch.put(0, *rng.standard_normal((2, 1, 2, 8)).astype(np.float32))
    with pytest.raises(ValueError, match="one row per batch token"):
        batch.attention(0, q)
    batch.cancel()
    assert pool.stats() == before
    pool.check_invariants()
    cache = kvrs.KVCache(1, 2, 8, 16)
    cache.append(0, *rng.standard_normal((2, 3, 2, 8)).astype(np.float32))
    for window in (0, -1):
        with pytest.raises(ValueError, match=f"window={window}: must be >= 1"):
            cache.attention(0, q, window=window)
    enc = kvrs.EncoderCache(1, 2, 8, 4)
    with pytest.raises(ValueError, match="set"):
        enc.attention(0, q)


# The levels `kvrs.attention_simd()` names, lowest first, by their KVRS_SIMD names.
LEVELS = {
    "portable": "portable",
    "avx2": "avx2+fma+f16c",
    "avx512": "avx512f+bw+vl+dq",
    "avx512bf16": "avx512f+bw+vl+dq+bf16",
}


@pytest.mark.parametrize("level", ["portable", "avx2", "avx512"])
def test_lower_simd_levels_pass_the_same_tests(level):
    """KVRS_SIMD caps the vector level (portable: the kernel compiled for any CPU, what a
    machine without AVX2 runs; avx2: what one without AVX-512 runs): the reference tests
    must pass at every level below the one this process runs."""
    import os
    import subprocess
    import sys

    names = list(LEVELS.values())
    if names.index(kvrs.attention_simd()) <= names.index(LEVELS[level]):
        pytest.skip(f"this process runs {kvrs.attention_simd()}, not above {LEVELS[level]}")
    env = dict(os.environ, KVRS_SIMD=level)
    check = subprocess.run(
        [sys.executable, "-c", "import kvrs; print(kvrs.attention_simd())"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == LEVELS[level]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not simd_levels"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:]
