"""K and V of different head sizes (v_head_dim), latent (absorbed MLA) attention, and
DeepSeek-V3 served from its latent cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrs


def softmax_attention(q, keys, values, scale, lo_hi):
    """Reference: q [n, Hq, d] over keys [T, Hkv, d], values [T, Hkv, dv]; row i sees
    positions lo_hi[i]."""
    n, hq, _ = q.shape
    g = hq // keys.shape[1]
    out = np.zeros((n, hq, values.shape[-1]), np.float64)
    for i in range(n):
        lo, hi = lo_hi[i]
        for h in range(hq):
            k, v = keys[lo:hi, h // g].astype(np.float64), values[lo:hi, h // g].astype(np.float64)
            s = (k @ q[i, h].astype(np.float64)) * scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v
    return out


def latent_reference(q, ckv, kpe, scale):
    """Absorbed MLA over one latent head: scores q . [ckv, kpe], outputs sum p ckv (causal
    for the last n positions)."""
    keys = np.concatenate([ckv, kpe], -1)[:, None]
    t, n = ckv.shape[0], q.shape[0]
    return softmax_attention(q, keys, ckv[:, None], scale, [(0, t - n + i + 1) for i in range(n)])


def fill(pool, rng, lens, fork_at, key_spread=False):
    """Appends random K/V to both layers of a new sequence of `pool` in steps of `lens`
    tokens, forking it before step `fork_at`; returns the sequence, the fork (or None) and
    every K and V written. `key_spread`: key elements of magnitudes from 0.01 to 10."""
    heads, d, dv = pool.num_kv_heads, pool.head_dim, pool.v_head_dim
    seq = pool.new_sequence()
    ks, vs = [], []
    other = None
    for step, n in enumerate(lens):
        if step == fork_at:
            other = seq.fork()
        k = rng.standard_normal((n, heads, d))
        if key_spread:
            k = k * rng.uniform(0.01, 10, (1, 1, d))
        v = rng.standard_normal((n, heads, dv)).astype(np.float32)
        for layer in range(2):
            seq.append(layer, k.astype(np.float32), v)
        seq.advance(n)
        ks.append(k.astype(np.float32))
        vs.append(v)
    return seq, other, np.concatenate(ks), np.concatenate(vs)


def check_fork(other, k_ref, v_ref, kept):
    """The fork `other` still holds the first `kept` stored K/V of its source."""
    ok, ov = other.get(0, dequantize=True)
    np.testing.assert_array_equal(ok.transpose(1, 0, 2), k_ref[:kept])
    np.testing.assert_array_equal(ov.transpose(1, 0, 2), v_ref[:kept])


def check_attention(seq, rng, k_ref, v_ref, n, group, layers):
    """Attention of the newest `n` tokens (causal) over `seq`'s layer `layers[0]`, and with
    one KV head latent attention over `layers[1]` (keys [stored K, stored V], values the
    stored K), against the float64 references of the stored `k_ref`, `v_ref`."""
    t, heads, d = k_ref.shape
    dv = v_ref.shape[-1]
    q = rng.standard_normal((n, heads * group, d)).astype(np.float32)
    out = seq.attention(layers[0], q, scale=0.3)
    assert out.shape == (n, heads * group, dv)
    ref = softmax_attention(q, k_ref, v_ref, 0.3, [(0, t - n + i + 1) for i in range(n)])
    np.testing.assert_allclose(out, ref, atol=2e-4 * (1 + abs(ref).max()), rtol=1e-3)
    if heads == 1:
        ql = rng.standard_normal((n, 4, d + dv)).astype(np.float32)
        out = seq.attention(layers[1], ql, latent=True, scale=0.2)
        assert out.shape == (n, 4, d)
        ref = latent_reference(ql, k_ref[:, 0], v_ref[:, 0], 0.2)
        np.testing.assert_allclose(out, ref, atol=2e-4 * (1 + abs(ref).max()), rtol=1e-3)


def tol(dtype):
    return {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3, "fp8_e4m3": 0.2}[dtype]


@settings(max_examples=25, deadline=None)
@given(
    dims=st.sampled_from([(8, 4), (4, 12), (16, 8), (8, 8)]),
    heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    layout=st.sampled_from(["NHD", "HND"]),
    dtype=st.sampled_from(["float32", "bfloat16", "fp8_e4m3"]),
    block_size=st.sampled_from([1, 4, 5]),
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    fork_at=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_pool_with_other_value_heads_matches_a_reference(
    dims, heads, group, layout, dtype, block_size, lens, fork_at, seed
):
    """Appends in steps, a fork, then: every read (get, blocks, extract_block,
    kv_cache_parts) gives back what was written, and attention (plain and latent) matches
    a float64 reference over the same values as stored."""
    d, dv = dims
    rng = np.random.default_rng(seed)
    pool = kvrs.BlockPool(
        2, heads, d, v_head_dim=dv, block_size=block_size, num_blocks=64, dtype=dtype, layout=layout
    )
    assert (pool.head_dim, pool.v_head_dim) == (d, dv)
    seq, other, k_all, v_all = fill(pool, rng, lens, fork_at)
    t = k_all.shape[0]
    got_k, got_v = seq.get(1, dequantize=True)
    assert got_k.shape == (heads, t, d) and got_v.shape == (heads, t, dv)
    np.testing.assert_allclose(got_k.transpose(1, 0, 2), k_all, atol=tol(dtype) * 4, rtol=tol(dtype))
    np.testing.assert_allclose(got_v.transpose(1, 0, 2), v_all, atol=tol(dtype) * 4, rtol=tol(dtype))
    # The stored values (rounded to the dtype) are the reference from here on.
    k_ref, v_ref = got_k.transpose(1, 0, 2), got_v.transpose(1, 0, 2)
    if other is not None:
        check_fork(other, k_ref, v_ref, sum(lens[:fork_at]))
    kb, vb = seq.extract_block(0, 0, t)
    assert kb.shape == (heads, t, d) and vb.shape == (heads, t, dv)
    kp, vp = pool.kv_cache_parts(0)
    assert kp.shape[-1] == d and vp.shape[-1] == dv and kp.shape[0] == pool.num_blocks
    for _start, _n, kview, vview in seq.views(0):
        assert kview.shape[-1] == d and vview.shape[-1] == dv
    check_attention(seq, rng, k_ref, v_ref, lens[-1], group, layers=(0, 1))


@settings(max_examples=15, deadline=None)
@given(
    dims=st.sampled_from([(8, 4), (4, 12)]),
    dtype=st.sampled_from(["float32", "float16"]),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_contiguous_cache_with_other_value_heads(dims, dtype, n, seed):
    d, dv = dims
    rng = np.random.default_rng(seed)
    cache = kvrs.KVCache(2, 2, d, 16, v_head_dim=dv, dtype=dtype)
    assert cache.v_head_dim == dv and f"v_head_dim={dv}" in repr(cache)
    k = rng.standard_normal((n, 2, d)).astype(np.float32)
    v = rng.standard_normal((n, 2, dv)).astype(np.float32)
    for layer in range(2):
        cache.append(layer, k, v)
    cache.advance(n)
    gk, gv = cache.get(1)
    assert gk.shape == (2, n, d) and gv.shape == (2, n, dv)
    np.testing.assert_allclose(
        np.asarray(gv, np.float32).transpose(1, 0, 2), v, atol=tol(dtype) * 4, rtol=tol(dtype)
    )
    assert cache.values_for(0, 1).shape == (n, dv)
    k_ref = np.asarray(gk, np.float32).transpose(1, 0, 2)
    v_ref = np.asarray(gv, np.float32).transpose(1, 0, 2)
    q = rng.standard_normal((1, 4, d)).astype(np.float32)
    out = cache.attention(1, q)
    ref = softmax_attention(q, k_ref, v_ref, d**-0.5, [(0, n)])
    np.testing.assert_allclose(out, ref, atol=2e-4 * (1 + abs(ref).max()), rtol=1e-3)
    c1 = kvrs.KVCache(1, 1, d, 16, v_head_dim=dv, dtype="float32")
    c1.append(0, k[:, :1], v[:, :1])
    c1.advance(n)
    ql = rng.standard_normal((1, 3, d + dv)).astype(np.float32)
    out = c1.attention(0, ql, latent=True, scale=0.5)
    ref = latent_reference(ql, k[:, 0], v[:, 0], 0.5)
    np.testing.assert_allclose(out, ref, atol=2e-4 * (1 + abs(ref).max()), rtol=1e-3)


def test_shapes_are_checked_against_each_head_size():
    pool = kvrs.BlockPool(1, 1, 8, v_head_dim=4, block_size=4, num_blocks=8, dtype="float32")
    seq = pool.new_sequence()
    with pytest.raises(ValueError, match=r"v has shape \[2, 1, 8\].*v_head_dim=4"):
        seq.append(0, np.ones((2, 1, 8), np.float32), np.ones((2, 1, 8), np.float32))
    assert seq.seq_len == 0 and pool.free_blocks == 8
    seq.append(0, np.ones((2, 1, 8), np.float32), np.ones((2, 1, 4), np.float32))
    seq.advance(2)
    with pytest.raises(ValueError, match="q has shape"):
        seq.attention(0, np.ones((1, 2, 8), np.float32), latent=True)  # needs 8 + 4
    with pytest.raises(ValueError, match="kv_cache_parts"):
        pool.kv_cache(0)
    int8 = kvrs.BlockPool(1, 1, 8, v_head_dim=4, num_blocks=8, dtype="int8")
    with pytest.raises(ValueError, match=r"scale_cache.*Sequence\.scales"):
        int8.scale_cache(0)
    with pytest.raises(ValueError, match="v_head_dim"):
        kvrs.KVCache(1, 1, 8, 8, v_head_dim=0)
    # One head size: kv_cache is FlashInfer's single tensor, kv_cache_parts its two halves.
    same = kvrs.BlockPool(1, 2, 4, block_size=4, num_blocks=8, dtype="float32")
    whole = same.kv_cache(0)
    k, v = same.kv_cache_parts(0)
    k[1, 2, 1] = 7.0
    v[3, 0, 0] = -5.0
    assert whole[1, 0, 2, 1, 0] == 7.0 and whole[3, 1, 0, 0, 0] == -5.0


def test_latent_pools_persist_with_their_value_size(tmp_path):
    def make(v_head_dim):
        return kvrs.BlockPool(
            2, 1, 8, v_head_dim=v_head_dim, block_size=4, num_blocks=16, dtype="bfloat16", seed=7
        )

    pool = make(4)
    tokens = list(range(9))
    seq = pool.new_sequence(tokens)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((9, 1, 8)).astype(np.float32)
    v = rng.standard_normal((9, 1, 4)).astype(np.float32)
    for layer in range(2):
        seq.append(layer, k, v)
    seq.advance(9, tokens=tokens)
    path = str(tmp_path / "latent.safetensors")
    pool.save_prefix_cache(path)
    again = make(4)
    again.load_prefix_cache(path)
    hit = again.new_sequence(tokens)
    assert hit.seq_len == 8
    np.testing.assert_array_equal(
        np.asarray(hit.get(1)[1], np.float32), np.asarray(seq.get(1)[1], np.float32)[:, :8]
    )
    with pytest.raises(ValueError, match="v_head_dim"):
        make(8).load_prefix_cache(path)


# --- int8 storage of K and V of different head sizes ----------------------------------


def int8_chunks_close(got, want, unit):
    """Fails unless `got` is `want` quantized with a scale per `unit` elements of the last
    axis: within half a step (max |x| / 127 of the chunk) of each element."""
    g = np.asarray(got, np.float64).reshape(*got.shape[:-1], -1, unit)
    w = np.asarray(want, np.float64).reshape(g.shape)
    step = np.abs(w).max(-1, keepdims=True) / 127
    assert (np.abs(g - w) <= step / 2 + 1e-6).all(), np.abs(g - w).max()


def dequantized(codes, scales, unit):
    """Codes [..., dim] times their scales [...] or [..., dim / unit]."""
    c = np.asarray(codes, np.float32)
    s = np.asarray(scales, np.float32)
    if s.ndim == c.ndim - 1:
        s = s[..., None]
    return (c.reshape(*c.shape[:-1], s.shape[-1], -1) * s[..., None]).reshape(c.shape)


@settings(max_examples=25, deadline=None)
@given(
    dims=st.sampled_from([(8, 4), (4, 12), (16, 8), (12, 8), (8, 8)]),
    heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    layout=st.sampled_from(["NHD", "HND"]),
    block_size=st.sampled_from([1, 4, 5]),
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    fork_at=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_int8_pool_with_other_value_heads_matches_a_reference(
    dims, heads, group, layout, block_size, lens, fork_at, seed
):
    """int8 keeps a scale per gcd(head_dim, v_head_dim) elements: reads are the writes
    within int8's error, codes times scales are the dequantized reads, forks keep their
    blocks through copy-on-write, and attention (plain and latent) matches a float64
    reference over the stored values."""
    d, dv = dims
    unit = int(np.gcd(d, dv))
    rng = np.random.default_rng(seed)
    pool = kvrs.BlockPool(
        2, heads, d, v_head_dim=dv, block_size=block_size, num_blocks=64, dtype="int8", layout=layout
    )
    assert pool.bytes_per_block == 2 * block_size * heads * (d + dv + 4 * (d + dv) // unit)
    seq, other, k_all, v_all = fill(pool, rng, lens, fork_at, key_spread=True)
    t = k_all.shape[0]
    got_k, got_v = seq.get(1, dequantize=True)
    assert got_k.shape == (heads, t, d) and got_v.shape == (heads, t, dv)
    int8_chunks_close(got_k.transpose(1, 0, 2), k_all, unit)
    int8_chunks_close(got_v.transpose(1, 0, 2), v_all, unit)
    codes_k, codes_v = seq.get(1)
    sk, sv = seq.scales(1)
    assert sk.shape == ((heads, t) if d == unit else (heads, t, d // unit))
    assert sv.shape == ((heads, t) if dv == unit else (heads, t, dv // unit))
    np.testing.assert_array_equal(dequantized(codes_k, sk, unit), got_k)
    np.testing.assert_array_equal(dequantized(codes_v, sv, unit), got_v)
    k_ref, v_ref = got_k.transpose(1, 0, 2), got_v.transpose(1, 0, 2)
    if other is not None:
        kept = sum(lens[:fork_at])
        check_fork(other, k_ref, v_ref, kept)
        # Writing to the fork copies the shared block; the original keeps its values.
        before = seq.get(0, dequantize=True), seq.scales(0)
        big = np.full((1, heads, d), 50.0, np.float32)
        for layer in range(2):
            other.append(layer, big, np.full((1, heads, dv), -50.0, np.float32))
        other.advance(1)
        for a, b in zip(before, (seq.get(0, dequantize=True), seq.scales(0)), strict=True):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
        fk, fv = other.get(0, dequantize=True)
        np.testing.assert_array_equal(fk[:, kept], 50.0)
        np.testing.assert_array_equal(fv[:, kept], -50.0)
    kb, vb = seq.extract_block(1, 0, t)
    np.testing.assert_array_equal(kb, got_k)
    np.testing.assert_array_equal(vb, got_v)
    check_attention(seq, rng, k_ref, v_ref, lens[-1], group, layers=(1, 1))


@pytest.mark.parametrize("dims", [(8, 4), (4, 12), (512, 64)])
def test_int8_contiguous_cache_with_other_value_heads(dims):
    """An int8 KVCache of two head sizes (an MLA latent of 512 and 64 among them): round
    trip, zero-copy scales that dequantize the codes, attention and latent attention
    against a float reference over the stored values."""
    d, dv = dims
    unit = int(np.gcd(d, dv))
    rng = np.random.default_rng(d + dv)
    heads, n = (1, 7) if d == 512 else (2, 9)
    cache = kvrs.KVCache(2, heads, d, 16, v_head_dim=dv, dtype="int8")
    k = rng.standard_normal((n, heads, d)).astype(np.float32)
    v = rng.standard_normal((n, heads, dv)).astype(np.float32) * 3
    for layer in range(2):
        cache.append(layer, k * (layer + 1), v)
    cache.advance(n)
    gk, gv = cache.get(1, dequantize=True)
    assert gk.shape == (heads, n, d) and gv.shape == (heads, n, dv)
    int8_chunks_close(gk.transpose(1, 0, 2), 2 * k, unit)
    int8_chunks_close(gv.transpose(1, 0, 2), v, unit)
    ck, cv = cache.get(1)
    sk, sv = cache.scales(1)
    assert sk.shape == ((heads, n) if d == unit else (heads, n, d // unit))
    np.testing.assert_array_equal(dequantized(ck, sk, unit), gk)
    np.testing.assert_array_equal(dequantized(cv, sv, unit), gv)
    # Layer 0's scales are their own (half of layer 1's keys').
    sk0, _ = cache.scales(0)
    np.testing.assert_allclose(np.asarray(sk0) * 2, np.asarray(sk), rtol=1e-6)
    k_ref, v_ref = gk.transpose(1, 0, 2), gv.transpose(1, 0, 2)
    q = rng.standard_normal((1, 2 * heads, d)).astype(np.float32)
    out = cache.attention(1, q)
    ref = softmax_attention(q, k_ref, v_ref, d**-0.5, [(0, n)])
    np.testing.assert_allclose(out, ref, atol=2e-4 * (1 + abs(ref).max()), rtol=1e-3)
    if heads == 1:
        ql = rng.standard_normal((2, 3, d + dv)).astype(np.float32) * 0.1
        out = cache.attention(1, ql, latent=True, scale=0.05)
        ref = latent_reference(ql, k_ref[:, 0], v_ref[:, 0], 0.05)
        np.testing.assert_allclose(out, ref, atol=2e-4 * (1 + abs(ref).max()), rtol=1e-3)


def test_int8_latent_pools_persist_their_chunk_scales(tmp_path):
    def make():
        return kvrs.BlockPool(2, 1, 12, v_head_dim=8, block_size=4, num_blocks=16, dtype="int8", seed=3)

    pool = make()
    tokens = list(range(9))
    seq = pool.new_sequence(tokens)
    rng = np.random.default_rng(1)
    k = (rng.standard_normal((9, 1, 12)) * np.array([0.01] * 4 + [1] * 4 + [100] * 4)).astype(np.float32)
    v = rng.standard_normal((9, 1, 8)).astype(np.float32)
    for layer in range(2):
        seq.append(layer, k, v)
    seq.advance(9, tokens=tokens)
    path = str(tmp_path / "int8-latent.safetensors")
    pool.save_prefix_cache(path)
    again = make()
    again.load_prefix_cache(path)
    hit = again.new_sequence(tokens)
    assert hit.seq_len == 8
    for a, b in zip(hit.get(1, dequantize=True), seq.get(1, dequantize=True), strict=True):
        np.testing.assert_array_equal(a, b[:, :8])
    for a, b in zip(hit.scales(1), seq.scales(1), strict=True):
        np.testing.assert_array_equal(a, b[:, :8])
    # The small chunk keeps its own scale (a step of about 0.03 / 127, where one scale
    # for the whole key would step by about 300 / 127).
    got = hit.get(1, dequantize=True)[0][0]
    int8_chunks_close(got, k[:8, 0], 4)
    assert np.abs(got[:, :4] - k[:8, 0, :4]).max() < 1e-3


# --- DeepSeek-V3 (MLA) through transformers -------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, max_position_embeddings=128,
    )  # fmt: skip
    return cfg, DeepseekV3ForCausalLM(cfg).eval()


def _generate(model, ids, cache):
    mask = torch.ones_like(ids)
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False)


def test_deepseek_v3_caches_only_its_latent(deepseek):
    from transformers import DynamicCache

    from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache, use_paged_attention

    cfg, model = deepseek
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    ref = _generate(model, ids, DynamicCache(config=cfg))
    # The failing examples: both caches refused the latent's two sizes.
    contiguous = KvrsCache.from_config(cfg, max_seq_len=64)
    paged = KvrsPagedCache.from_config(cfg, max_seq_len=64, max_batch_size=2)
    assert torch.equal(_generate(model, ids, contiguous), ref)
    assert torch.equal(_generate(model, ids, paged), ref)
    pool = paged.pool
    assert (pool.num_kv_heads, pool.head_dim, pool.v_head_dim) == (1, 32, 8)
    # Bytes per token and layer: the latent, (kv_lora_rank + qk_rope_head_dim) x 4.
    assert pool.stats()["bytes_total"] / (pool.num_blocks * pool.block_size * pool.num_layers) == (32 + 8) * 4
    # In place: absorbed attention over the latent, no expansion of the history.
    use_paged_attention(model)
    try:
        assert torch.equal(_generate(model, ids, KvrsCache.from_config(cfg, max_seq_len=64)), ref)
        assert torch.equal(
            _generate(model, ids, KvrsPagedCache.from_config(cfg, max_seq_len=64, max_batch_size=2)), ref
        )
    finally:
        model.set_attn_implementation("sdpa")


def test_deepseek_v3_serves_ragged_batches_from_the_latent(deepseek):
    from transformers import DynamicCache

    from kvrs.integrations.transformers import generate_batch, use_paged_attention

    cfg, model = deepseek
    prompts = [[5, 9, 33, 2, 71, 8, 100], [3, 4], [120, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    use_paged_attention(model)
    try:
        outs = generate_batch(model, prompts, max_new_tokens=6)
    finally:
        model.set_attn_implementation("sdpa")
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids, past_key_values=DynamicCache(config=cfg), max_new_tokens=6, do_sample=False
        )[0, len(prompt) :].tolist()
        assert out == ref
