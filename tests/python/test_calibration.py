"""fp8 scales from calibration prompts (``calibrate_kv_scales``) and the saturation
counts of fp8 pools (``stats()["fp8_saturated"]``).

The scales are checked against amaxes computed independently, from the keys and values
a plain DynamicCache holds after each prompt runs alone; the counts against NumPy's
``|x / scale| > max`` over the rows written."""

from __future__ import annotations

import copy
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvrs.demo import logits_error, make_loud_model, make_tiny_model  # noqa: E402
from kvrs.integrations.calibration import scale_for  # noqa: E402
from kvrs.integrations.transformers import (  # noqa: E402
    KvrsCache,
    KvrsPagedCache,
    KvScales,
    calibrate_kv_scales,
)

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
NP_DTYPES = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model(0)


@pytest.fixture(scope="module")
def loud_model():
    """Layer 1's K and V reach past E4M3's 448, layer 0's stay below 1 (same function)."""
    return make_loud_model(0)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def reference_amax(model, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[layers, kv heads] amax of |K| and |V| from a DynamicCache after each prompt runs
    alone (no padding anywhere)."""
    layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    k, v = np.zeros((layers, heads), np.float32), np.zeros((layers, heads), np.float32)
    for row in rows:
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([row]), past_key_values=cache, use_cache=True)
        for i, layer in enumerate(cache.layers):
            k[i] = np.maximum(k[i], layer.keys.abs().amax(dim=(0, 2, 3)).numpy())
            v[i] = np.maximum(v[i], layer.values.abs().amax(dim=(0, 2, 3)).numpy())
    return k, v


def check_scales(scales: list, amax: np.ndarray, fmt_max: float) -> None:
    """Each scale is amax / fmt_max in float32."""
    got = np.asarray(scales, np.float32)
    np.testing.assert_array_equal(got, amax.astype(np.float32) / np.float32(fmt_max))


def test_scales_are_each_heads_amax_over_the_formats_max(tiny_model):
    rows = prompts(0, [5, 17, 9, 30])
    k_amax, v_amax = reference_amax(tiny_model, rows)
    # Two batches (batch_size=3): a short row padded to the longest of its batch.
    scales = calibrate_kv_scales(tiny_model, rows, batch_size=3)
    assert isinstance(scales, KvScales) and scales.dtype == "fp8_e4m3" and scales.tokens == 61
    np.testing.assert_allclose(scales.k_amax, k_amax, rtol=1e-5)
    np.testing.assert_allclose(scales.v_amax, v_amax, rtol=1e-5)
    check_scales(scales.k_scale, np.asarray(scales.k_amax, np.float32), 448.0)
    check_scales(scales.v_scale, np.asarray(scales.v_amax, np.float32), 448.0)
    assert np.asarray(scales.k_scale).shape == (2, 2)  # [layers, kv heads]
    # One scale per layer: the largest head's.
    per_layer = calibrate_kv_scales(tiny_model, rows, per_head=False, dtype="E5M2")
    assert per_layer.dtype == "fp8_e5m2"
    check_scales(per_layer.k_scale, np.asarray(per_layer.k_amax, np.float32).max(axis=1), 57344.0)
    check_scales(per_layer.v_scale, np.asarray(per_layer.v_amax, np.float32).max(axis=1), 57344.0)
    # margin leaves room: the amax maps to max / margin.
    wide = calibrate_kv_scales(tiny_model, rows, margin=448 / 200)
    check_scales(wide.k_scale, np.asarray(wide.k_amax, np.float32), np.float32(448 / (448 / 200)))


def test_padding_is_left_out_whichever_side_and_whatever_form(tiny_model):
    """A tokenizer's left-padded batch gives the scales of its rows run alone, though the
    pad token's embedding points along layer 0's largest k_proj row (its key there is
    the largest any normalized input makes, and would set the amax if padded positions
    counted); so do right padding and the plain forms."""
    model = copy.deepcopy(tiny_model)
    pad = 1
    with torch.no_grad():
        w = model.model.layers[0].self_attn.k_proj.weight
        top = int(w.norm(dim=1).argmax())
        model.model.embed_tokens.weight[pad] = w[top] / w[top].norm()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    rows = prompts(1, [12, 4, 8])
    k_amax, v_amax = reference_amax(model, rows)
    width = 12
    left = {
        "input_ids": torch.tensor([[pad] * (width - len(r)) + r for r in rows]),
        "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]),
    }
    right = transformers.BatchEncoding(
        {
            "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        }
    )
    for given_prompts in (left, right, rows):
        s = calibrate_kv_scales(model, given_prompts)
        assert s.tokens == 24
        np.testing.assert_allclose(s.k_amax, k_amax, rtol=1e-5)
        np.testing.assert_allclose(s.v_amax, v_amax, rtol=1e-5)
    # Without the mask the pad token's K count, and they are far larger.
    unmasked = calibrate_kv_scales(model, left["input_ids"])
    assert unmasked.k_amax[0][top // head_dim] > 1.5 * k_amax[0][top // head_dim]
    # Equal-length prompts as a tensor, an array, a list and one prompt's ids.
    same = prompts(2, [7, 7])
    want = calibrate_kv_scales(model, same)
    for form in (torch.tensor(same), np.array(same)):
        assert calibrate_kv_scales(model, form) == want
    one = calibrate_kv_scales(model, same[0])
    assert one == calibrate_kv_scales(model, [same[0]]) and one.tokens == 7


def test_the_scales_plug_into_every_cache(tiny_model):
    config = tiny_model.config
    for per_head in (True, False):
        scales = calibrate_kv_scales(tiny_model, prompts(3, [10, 6]), per_head=per_head)
        want_k = np.broadcast_to(np.asarray(scales.k_scale, np.float32).reshape(2, -1), (2, 2))
        want_v = np.broadcast_to(np.asarray(scales.v_scale, np.float32).reshape(2, -1), (2, 2))
        pool = kvrs.BlockPool(2, 2, 16, num_blocks=8, **scales.as_kwargs())
        assert pool.dtype == "fp8_e4m3"
        np.testing.assert_array_equal(pool.k_scale, want_k)
        np.testing.assert_array_equal(pool.v_scale, want_v)
        paged = KvrsPagedCache.from_config(config, max_seq_len=32, **scales.as_kwargs())
        np.testing.assert_array_equal(paged.pool.k_scale, want_k)
        np.testing.assert_array_equal(paged.pool.v_scale, want_v)
        for cache in (
            KvrsCache(2, 32, **scales.as_kwargs()),
            KvrsCache.from_config(
                config, 32, dtype=scales.dtype, k_scale=scales.k_scale, v_scale=scales.v_scale
            ),
        ):
            ids = torch.tensor(prompts(4, [5, 5]))
            with torch.no_grad():
                tiny_model(ids, past_key_values=cache, use_cache=True)
            for layer, held in enumerate(cache.layers):
                # Each layer's KVCache holds batch x kv heads: the scales repeat per row.
                np.testing.assert_array_equal(held.store.k_scale, [np.tile(want_k[layer], 2)])
                np.testing.assert_array_equal(held.store.v_scale, [np.tile(want_v[layer], 2)])


def test_a_calibrated_cache_does_not_saturate_and_its_logits_beat_unit_scales(loud_model):
    rows = prompts(5, [40, 24])
    scales = calibrate_kv_scales(loud_model, rows)
    k_amax = np.asarray(scales.k_amax)
    assert k_amax[0].max() < 448 < k_amax[1].min()  # layer 1 needs a scale, layer 0 does not

    def saturated(**kwargs) -> list[int]:
        cache = KvrsPagedCache.from_config(loud_model.config, max_seq_len=64, max_batch_size=1, **kwargs)
        for row in rows:
            with torch.no_grad():
                loud_model(torch.tensor([row]), past_key_values=cache, use_cache=True)
            cache.reset()
        return cache.pool.stats()["fp8_saturated"]

    # Layer 0 stores the K/V calibration saw; layer 1's inputs carry layer 0's fp8
    # error, so its largest values may come out a little past the amax, but E4M3 rounds
    # up to 464 to 448 without saturating. Scale 1.0 clamps layer 1's K/V by hundreds.
    assert saturated(**scales.as_kwargs()) == [0, 0]
    assert saturated(**calibrate_kv_scales(loud_model, rows, margin=1.1).as_kwargs()) == [0, 0]
    unit = saturated(dtype="fp8_e4m3")
    assert unit[0] == 0 and unit[1] > 100
    # The logits error of a decode after a calibration prompt: within the format's 2u
    # with calibrated scales, and several times larger with 1.0.
    calibrated, _ = logits_error(
        loud_model, "fp8_e4m3", rows[0], 8, k_scale=scales.k_scale, v_scale=scales.v_scale
    )
    clamped, _ = logits_error(loud_model, "fp8_e4m3", rows[0], 8)
    assert calibrated <= 2 * 2**-4 and 3 * calibrated < clamped, (calibrated, clamped)


def test_calibration_restores_training_mode_and_refuses_what_takes_no_scales(tiny_model):
    model = copy.deepcopy(tiny_model).train()
    calibrate_kv_scales(model, [[5, 6, 7]])
    assert model.training
    for dtype in ("int8", "float16", "bogus"):
        with pytest.raises(ValueError, match="fp8"):
            calibrate_kv_scales(tiny_model, [[5, 6]], dtype=dtype)
    for spelling in ("fp8", "float8_e4m3fn", " E4M3 "):
        assert calibrate_kv_scales(tiny_model, [[5, 6]], dtype=spelling).dtype == "fp8_e4m3"
    for margin in (0, -1.0, float("inf"), (1.0,), (1.0, 0.0)):
        with pytest.raises(ValueError, match="margin"):
            calibrate_kv_scales(tiny_model, [[5, 6]], margin=margin)
    # vLLM's runtime constants: K / 200, V / 100.
    vllm = calibrate_kv_scales(tiny_model, [[5, 6]], margin=(448 / 200, 448 / 100), per_head=False)
    check_scales(vllm.k_scale, np.asarray(vllm.k_amax, np.float32).max(axis=1), np.float32(200.0))
    check_scales(vllm.v_scale, np.asarray(vllm.v_amax, np.float32).max(axis=1), np.float32(100.0))
    with pytest.raises(ValueError, match="no tokens"):
        calibrate_kv_scales(tiny_model, {"input_ids": [[5, 6]], "attention_mask": [[0, 0]]})
    with pytest.raises(TypeError, match="token ids"):
        calibrate_kv_scales(tiny_model, "some text")
    with pytest.raises(TypeError, match="integer"):
        calibrate_kv_scales(tiny_model, torch.ones(1, 3))


@given(amax=st.floats(0, float(np.finfo(np.float32).max), width=32), margin=st.sampled_from([1.0, 2.24, 0.5]))
def test_a_scale_puts_its_amax_at_the_top_of_the_format_unsaturated(amax, margin):
    for fmt_max, dtype in ((448.0, "fp8_e4m3"), (57344.0, "fp8_e5m2")):
        scale = np.float32(scale_for(amax, fmt_max, margin))
        assert np.isfinite(scale) and scale > 0
        if amax == 0:
            assert scale == 1.0  # nothing seen: kvrs's default, which saturates nothing new
            continue
        top = np.float32(fmt_max / margin)
        assert scale == max(np.float32(amax) / top, np.finfo(np.float32).tiny)
        if scale > np.finfo(np.float32).tiny and margin >= 1:
            # The amax itself is stored without saturating: at (or rounding to) max / margin.
            x = np.float32(amax) / scale
            assert np.isfinite(x.astype(NP_DTYPES[dtype]))


# --- saturation counts ----------------------------------------------------------------


def expected_saturated(rows: np.ndarray, scales: np.ndarray, dtype: str) -> int:
    """NumPy's count of `rows` ([n, heads, dim]) clamped when stored: the elements whose
    x / scale (in float32) ml_dtypes' unclamped cast overflows to NaN (E4M3FN) or
    infinity (E5M2), which the clamp turns into the largest value; NaN never counts."""
    x = rows.astype(np.float32) / scales.astype(np.float32)[None, :, None]
    with np.errstate(invalid="ignore", over="ignore"):
        cast = x.astype(NP_DTYPES[dtype]).astype(np.float32)
    return int(np.count_nonzero(~np.isnan(x) & ~np.isfinite(cast)))


@st.composite
def rows_and_scales(draw):
    dtype = draw(st.sampled_from(["fp8_e4m3", "fp8_e5m2"]))
    layers, heads, dim = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 16, 40]))
    n = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # Scales per layer and head, and magnitudes around the format's top after division.
    scales = rng.choice([0.25, 1.0, 3.0, 1000.0], size=(2, layers, heads)).astype(np.float32)
    fmt_max = FP8_MAX[dtype]
    spread = fmt_max * draw(st.sampled_from([0.5, 1.0, 4.0]))
    rows = rng.standard_normal((2, layers, n, heads, dim)).astype(np.float32) * spread
    rows *= scales[:, :, None, :, None]
    # A few infinities (counted) and NaNs (not), and values at exactly the top (stored exactly).
    flat = rows.reshape(-1)
    picks = rng.choice(flat.size, size=min(flat.size, 6), replace=False)
    flat[picks[:2]] = [np.inf, -np.inf][: len(picks[:2])]
    flat[picks[2:4]] = np.nan
    rows[0, 0, 0, 0, 0] = np.float32(fmt_max) * scales[0, 0, 0]  # exactly the top: stored exactly
    input_dtype = draw(st.sampled_from([np.float32, np.float16]))
    if input_dtype == np.float16:
        rows = rows.clip(-60000, 60000).astype(np.float16)
    return dtype, scales, rows


@settings(max_examples=40, deadline=None)
@given(case=rows_and_scales(), path=st.sampled_from(["append", "write", "write_layers"]))
def test_saturation_counts_equal_numpys_per_layer(case, path):
    dtype, scales, rows = case
    _, layers, n, heads, dim = rows.shape
    fmt_max = FP8_MAX[dtype]
    pool = kvrs.BlockPool(
        layers, heads, dim, block_size=8, num_blocks=layers * (n // 8 + 3), dtype=dtype,
        k_scale=scales[0], v_scale=scales[1],
    )  # fmt: skip
    assert pool.stats()["fp8_saturated"] == [0] * layers
    k, v = rows
    seq = pool.new_sequence()
    if path == "append":
        for layer in range(layers):
            seq.append(layer, k[layer], v[layer])
    else:
        slots = pool.reserve([seq], [n])
        if path == "write":
            for layer in range(layers):
                pool.write(layer, k[layer], v[layer], slots)
        else:
            pool.write_layers(k, v, slots)
    seq.advance(n)
    want = [
        expected_saturated(k[layer], scales[0, layer], dtype)
        + expected_saturated(v[layer], scales[1, layer], dtype)
        for layer in range(layers)
    ]
    assert pool.stats()["fp8_saturated"] == want
    # What was stored is the clamped value: NumPy's clip, then its cast, bit for bit.
    codes, _ = seq.get(0)
    x = k[0].astype(np.float32) / scales[0, 0][None, :, None]
    want_codes = np.clip(x, -fmt_max, fmt_max).astype(NP_DTYPES[dtype]).transpose(1, 0, 2)
    np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))
    # Counts accumulate over writes.
    seq.append(0, k[0][:1], v[0][:1])
    extra = expected_saturated(k[0][:1], scales[0, 0], dtype)
    extra += expected_saturated(v[0][:1], scales[1, 0], dtype)
    assert pool.stats()["fp8_saturated"] == [want[0] + extra, *want[1:]]


def test_other_pools_count_nothing():
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        pool = kvrs.BlockPool(2, 1, 8, num_blocks=4, dtype=dtype)
        seq = pool.new_sequence()
        big = np.full((1, 1, 8), 1e6, np.float32)
        seq.append(0, big, big)
        assert pool.stats()["fp8_saturated"] is None
    pool = kvrs.BlockPool(2, 1, 8, num_blocks=4, dtype="fp8_e4m3")
    assert pool.stats()["fp8_saturated"] == [0, 0]


def test_a_margin_whose_scale_float32_cannot_hold_is_refused():
    from kvrs.integrations.calibration import scale_for

    for margin in (1e308, 1e-300):
        with pytest.raises(ValueError, match=re.escape(f"margin={margin}:")):
            scale_for(1.0, 448.0, margin)
