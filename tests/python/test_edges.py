"""The user's edge: spellings as transformers and vLLM users write them, torch dtypes,
DLPack for every view (bfloat16 and fp8 included), and errors that say what to do."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrs

torch = pytest.importorskip("torch")

H, D = 2, 4
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


def mixed_case(draw, word: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    return "".join(c.upper() if f else c.lower() for c, f in zip(word, flips, strict=True))


# --- spellings ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_spellings_are_case_insensitive_and_vllm_names_are_accepted(data):
    hash_name = data.draw(st.sampled_from(["blake3", "xxh3", "xxhash", "xxh3_128"]))
    layout = data.draw(st.sampled_from(["nhd", "hnd"]))
    kind = data.draw(st.sampled_from(["full", "sliding_attention", "chunked"]))
    dtype = data.draw(st.sampled_from(["bfloat16", "float16", "fp8_e4m3", "int8"]))
    style = data.draw(st.sampled_from(["neox", "gptj"]))
    pool = kvrs.BlockPool(
        1,
        H,
        D,
        block_size=4,
        num_blocks=4,
        hash=mixed_case(data.draw, hash_name),
        layout=mixed_case(data.draw, layout),
        dtype=mixed_case(data.draw, dtype),
        layer_types=[mixed_case(data.draw, kind)],
        sliding_window=8,
        chunk_size=8,
        rope=kvrs.RoPE(style=mixed_case(data.draw, style)),
    )
    assert pool.hash == ("blake3" if hash_name == "blake3" else "xxh3")
    assert pool.layout == layout.upper()
    assert pool.dtype == dtype
    assert pool.layer_types == [kind.removesuffix("_attention")]


def test_a_sha256_hash_is_refused_with_what_to_use_instead():
    with pytest.raises(ValueError, match=r"hash=\"sha256\": kvrs has no SHA-256 chains: use 'blake3'"):
        kvrs.BlockPool(1, H, D, num_blocks=4, hash="sha256")


# --- torch dtypes -----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_torch_dtypes_go_in_and_come_out(name):
    want = TORCH_DTYPES[name]
    pool = kvrs.BlockPool(1, H, D, num_blocks=4, dtype=want)
    cache = kvrs.KVCache(1, H, D, 8, dtype=want)
    assert (pool.dtype, cache.dtype) == (name, name)
    assert pool.torch_dtype is want and cache.torch_dtype is want


def test_auto_is_refused_where_there_is_no_model_with_where_it_works():
    for make in (
        lambda: kvrs.BlockPool(1, H, D, num_blocks=4, dtype="auto"),
        lambda: kvrs.KVCache(1, H, D, 8, dtype="Auto"),
    ):
        with pytest.raises(ValueError, match=r"dtype='auto'.*block_pool_from_config\(model"):
            make()


# --- DLPack ---------------------------------------------------------------------------------


def filled_pool(dtype: str, layout: str = "NHD"):
    pool = kvrs.BlockPool(2, H, D, block_size=4, num_blocks=4, dtype=dtype, layout=layout)
    seq = pool.new_sequence()
    rng = np.random.default_rng(0)
    k = rng.uniform(-3, 3, (6, H, D)).astype(np.float32)
    for layer in range(2):
        seq.append(layer, k, -k)
    return pool, seq, k


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_torch_imports_every_view_of_an_ml_dtypes_pool_without_a_copy(dtype):
    pool, seq, _ = filled_pool(dtype)
    whole = pool.kv_cache(0)
    assert isinstance(whole, kvrs.HostArray) and whole.dtype.name == np.dtype(whole.dtype).name
    t = torch.from_dlpack(whole)
    assert t.dtype is TORCH_DTYPES[dtype] and list(t.shape) == list(whole.shape)
    assert t.data_ptr() == whole.ctypes.data  # the pool's memory, not a copy
    # The bits agree with NumPy's (ml_dtypes) reading of the same memory.
    assert np.array_equal(t.view(torch.uint8).numpy(), whole.view(np.uint8))
    # Writes through kvrs show in the tensor: it is a view.
    before = t.float().clone()
    seq.append(0, np.full((1, H, D), 2.0, np.float32), np.full((1, H, D), 2.0, np.float32))
    assert not torch.equal(before, t.float())
    # A sequence's copy and a slice are HostArrays too.
    keys, _ = seq.get(1)
    assert isinstance(keys, kvrs.HostArray) and isinstance(keys[1:3], kvrs.HostArray)
    assert torch.equal(torch.from_dlpack(keys[1:3]).float(), torch.from_numpy(keys[1:3].astype(np.float32)))


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(["bfloat16", "fp8_e4m3", "fp8_e5m2"]),
    n=st.integers(1, 8),
    start=st.integers(0, 7),
    step=st.integers(1, 3),
    head=st.integers(0, H - 1),
)
def test_strided_slices_export_what_numpy_reads(dtype, n, start, step, head):
    cache = kvrs.KVCache(1, H, D, 8, dtype=dtype)
    rng = np.random.default_rng(n)
    cache.append(0, rng.normal(size=(n, H, D)).astype(np.float32), np.zeros((n, H, D), np.float32))
    keys, _ = cache.get(0)
    view = keys[head, start::step, ::2]  # a KVCache reads head-major [heads, n, head_dim]
    t = torch.from_dlpack(view)
    assert t.dtype is TORCH_DTYPES[dtype] and list(t.shape) == list(view.shape)
    assert np.array_equal(t.float().numpy(), view.astype(np.float32))


def test_read_only_views_are_signalled_and_legacy_export_is_refused():
    _, seq, _ = filled_pool("bfloat16")
    view = seq.get(0)[0]
    view.flags.writeable = False
    assert torch.from_dlpack(view).dtype is torch.bfloat16  # torch asks for a versioned capsule
    with pytest.raises(BufferError, match="read-only view is exported only as a versioned"):
        view.__dlpack__()
    with pytest.raises(BufferError, match="copy=True"):
        view.__dlpack__(max_version=(1, 0), copy=True)
    assert view.__dlpack_device__() == (1, 0)


def test_a_capsule_keeps_the_memory_alive():
    pool, seq, _ = filled_pool("bfloat16")
    t = torch.from_dlpack(seq.get(0)[0])
    want = t.float().clone()
    del seq, pool
    import gc

    gc.collect()
    assert torch.equal(t.float(), want)


# --- errors that say what to do ---------------------------------------------------------------


def test_head_major_and_hugging_face_shapes_name_the_transpose():
    cache = kvrs.KVCache(1, H, D, 16)
    head_major = np.zeros((H, 5, D), np.float32)
    with pytest.raises(
        ValueError,
        match=r"k looks head-major \[num_kv_heads, n_tokens, head_dim\]: pass k\.transpose\(0, 1\)",
    ):
        cache.append(0, head_major, head_major.swapaxes(0, 1))
    hf = torch.zeros((1, H, 5, D))
    with pytest.raises(ValueError, match=r"Hugging Face's layout.*k\[b\]\.transpose\(0, 1\)"):
        cache.append(0, hf, hf)
    pool = kvrs.BlockPool(1, H, D, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"v looks head-major"):
        pool.new_sequence().append(0, head_major.swapaxes(0, 1), head_major)
    assert cache.seq_len == 0 and cache.layer_len(0) == 0


def test_an_ambiguous_shape_is_read_in_the_documented_order():
    """[n, H, D] with n == H cannot be told from head-major: it is token-major, as documented."""
    cache = kvrs.KVCache(1, H, D, 16)
    k = np.arange(H * H * D, dtype=np.float32).reshape(H, H, D)
    cache.append(0, k, k)
    assert np.array_equal(
        cache.get(0)[0], k.swapaxes(0, 1)
    )  # get is [heads, n, dim]: head h, token t is k[t, h]


def test_a_meta_tensor_gets_a_kvrs_error_not_a_torch_backtrace():
    meta = torch.zeros((1, H, D), device="meta")
    cache = kvrs.KVCache(1, H, D, 8)
    with pytest.raises(kvrs.DeviceError, match=r"k is on meta, which kvrs cannot read.*k\.to\('cpu'\)"):
        cache.append(0, meta, meta)
    seq = kvrs.BlockPool(1, H, D, num_blocks=2, block_size=4).new_sequence()
    with pytest.raises(kvrs.DeviceError, match="k is on meta"):
        seq.append(0, meta, meta)


FULL = re.compile(r"cache full: .* needs (\d+) more (positions|blocks) but (\d+) of (\d+) \2 are free")


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 6),
    held=st.integers(0, 24),
    more=st.integers(1, 30),
    block_size=st.sampled_from([2, 4]),
)
def test_cache_full_counts_one_unit_with_free_and_total(num_blocks, held, more, block_size):
    pool = kvrs.BlockPool(1, H, D, num_blocks=num_blocks, block_size=block_size, prefix_caching=False)
    seq = pool.new_sequence()
    held = min(held, num_blocks * block_size)
    seq.append(0, np.zeros((held, H, D), np.float32), np.zeros((held, H, D), np.float32))
    free = pool.free_blocks
    before = (seq.seq_len, seq.layer_len(0), free)
    try:
        seq.append(0, np.zeros((more, H, D), np.float32), np.zeros((more, H, D), np.float32))
    except kvrs.CacheFullError as e:
        m = FULL.fullmatch(str(e))
        assert m, str(e)
        needed, unit, free_said, total = int(m[1]), m[2], int(m[3]), int(m[4])
        assert unit == "blocks" and (free_said, total) == (free, num_blocks) and needed > free
        assert (seq.seq_len, seq.layer_len(0), pool.free_blocks) == before
    cache = kvrs.KVCache(1, H, D, num_blocks * block_size)
    cache.append(0, np.zeros((held, H, D), np.float32), np.zeros((held, H, D), np.float32))
    try:
        cache.append(0, np.zeros((more, H, D), np.float32), np.zeros((more, H, D), np.float32))
    except kvrs.CacheFullError as e:
        m = FULL.fullmatch(str(e))
        assert m, str(e)
        assert (int(m[1]), m[2], int(m[3]), int(m[4])) == (
            more,
            "positions",
            cache.max_seq_len - held,
            cache.max_seq_len,
        )


def test_seed_takes_an_int_or_its_hex_string_and_names_what_is_wrong():
    assert kvrs.BlockPool(1, H, D, num_blocks=2, seed="0xFF").seed == 255
    assert kvrs.BlockPool(1, H, D, num_blocks=2, seed=" ff ").seed == 255
    for bad in ("", "0x", "xyz", "1" * 33, -1, 2**128):
        with pytest.raises(ValueError, match=r"seed=.*must be an int in \[0, 2\*\*128\) or its hex string"):
            kvrs.BlockPool(1, H, D, num_blocks=2, seed=bad)
    for bad in (1.5, True, b"ff"):
        with pytest.raises(TypeError, match="seed must be an int or a hex string"):
            kvrs.BlockPool(1, H, D, num_blocks=2, seed=bad)


def test_no_rust_syntax_in_messages_or_reprs(tmp_path):
    texts = [repr(kvrs.RoPE(rotary_dim=2)), repr(kvrs.RoPE()), repr(kvrs.EncoderCache(1, H, D, 4))]
    with pytest.raises(ValueError) as e:
        kvrs.BlockPool(1, H, D, num_blocks=2, memory_bytes=1 << 20)
    texts.append(str(e.value))
    sliding = kvrs.BlockPool(
        1, H, D, num_blocks=4, block_size=4, layer_types=["sliding"], sliding_window=8, seed=1
    )
    seq = sliding.new_sequence(tokens=list(range(8)))
    seq.append(0, np.ones((8, H, D), np.float32), np.ones((8, H, D), np.float32))
    seq.free()
    sliding.save_prefix_cache(tmp_path / "c")
    other = kvrs.BlockPool(
        1, H, D, num_blocks=4, block_size=4, layer_types=["sliding"], sliding_window=4, seed=1
    )
    with pytest.raises(ValueError) as e:
        other.load_prefix_cache(tmp_path / "c")
    texts.append(str(e.value))
    assert "window=8" in texts[-1] and "window=4" in texts[-1]
    for text in texts:
        assert "Some(" not in text, text


# --- the model's dtype and device --------------------------------------------------------------


def test_pools_and_caches_from_a_model_take_its_dtype_and_device():
    pytest.importorskip("transformers")
    from kvrs.demo import make_tiny_model
    from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache, block_pool_from_config

    model = make_tiny_model(1).to(torch.bfloat16)
    for dtype in (None, "auto", "AUTO"):
        pool = block_pool_from_config(model, num_blocks=4, dtype=dtype)
        assert (pool.dtype, pool.device, pool.torch_dtype) == ("bfloat16", "cpu", torch.bfloat16)
    assert block_pool_from_config(model, num_blocks=4, dtype=torch.float16).dtype == "float16"
    assert block_pool_from_config(model, num_blocks=4, dtype="FP8_E4M3").dtype == "fp8_e4m3"
    paged = KvrsPagedCache.from_config(model, max_seq_len=16)
    assert paged.pool.dtype == "bfloat16"
    cache = KvrsCache.from_config(model, 16)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert cache.layers[0].store.dtype == "bfloat16" and cache.layers[0].store.torch_dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype='auto': the model computes in torch.float64"):
        block_pool_from_config(make_tiny_model(1).to(torch.float64), num_blocks=4)
    with pytest.raises(ValueError, match="dtype"):
        KvrsCache.from_config(model, 16, dtype="float12")


def test_numpy_results_of_a_host_array_export_as_numpy_would():
    """`view > 0`, `astype`, `view(np.uint16)` of a HostArray stay HostArrays: NumPy exports them."""
    cache = kvrs.KVCache(1, H, D, 8, dtype="bfloat16")
    k = np.ones((3, H, D), np.float32)
    cache.append(0, k, k)
    v = cache.keys_for(0, 1, 3)
    assert torch.from_dlpack(v > 0).dtype is torch.bool
    assert torch.from_dlpack(v.astype(np.float64)).dtype is torch.float64
    bits = torch.from_dlpack(v.view(np.uint16))
    assert bits.dtype is torch.uint16 and bits.data_ptr() == v.ctypes.data


def test_size_one_and_empty_axes_export_whatever_their_strides():
    import ml_dtypes

    raw = np.zeros((1, 5), np.uint8).view(kvrs.HostArray)[:, :2].view(ml_dtypes.bfloat16)  # strides (5, 2)
    assert tuple(torch.from_dlpack(raw).shape) == (1, 1)
    empty = kvrs.KVCache(1, H, D, 8, dtype="bfloat16").get(0)[0]
    assert tuple(torch.from_dlpack(empty).shape) == tuple(empty.shape)


def test_numpy_integer_seeds_and_signed_hex_strings():
    assert kvrs.BlockPool(1, H, D, num_blocks=2, seed=np.int64(5)).seed == 5
    for bad in ("0x+ff", "-ff", "+ff"):
        with pytest.raises(ValueError, match="seed="):
            kvrs.BlockPool(1, H, D, num_blocks=2, seed=bad)


def test_the_hint_does_not_advise_a_transpose_for_repeated_kv_heads():
    cache = kvrs.KVCache(1, 2, D, 16)
    repeated = np.zeros((2, 8, D), np.float32)  # 2 tokens of 8 query heads: keys after repeat_kv
    with pytest.raises(
        ValueError,
        match=r"if k is head-major .*; if it holds one vector per query head .* pass the 2 KV heads",
    ):
        cache.append(0, repeated, repeated)
