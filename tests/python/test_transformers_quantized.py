"""Accuracy of 8-bit K/V inside transformers: the logits of a decode through a
KvrsPagedCache storing each dtype, against DynamicCache's float32, on the demo's model
and on a tiny random Llama; and generate() with KvrsCache / KvrsPagedCache of each dtype.

The bound is twice the storage format's unit roundoff u, the largest relative error of
one stored element: 2^-8 for bfloat16, 2^-11 for float16, 2^-4 for fp8 E4M3, 2^-3 for
fp8 E5M2, and for int8 half a step of max|row| / 127, 1/254 of the row's largest
element. Every stored K and V element is off by at most u (relatively), attention
averages them, and the model's later layers do not amplify the error past a small
multiple: on these models the logits' relative L2 error is 0.1u to 1.6u (the figures
are in the README), so 2u fails on a format that loses more than it should (a lost
scale, a wrong rounding) and on nothing else."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvrs.demo import logits_error, make_model, make_requests, make_tiny_model  # noqa: E402
from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache  # noqa: E402

UNIT_ROUNDOFF = {
    "float16": 2**-11,
    "bfloat16": 2**-8,
    "int8": 1 / 254,
    "fp8_e4m3": 2**-4,
    "fp8_e5m2": 2**-3,
}


@pytest.fixture(scope="module")
def demo_model():
    return make_model(0, 8)


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model(0)


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_demo_model_logits_stay_within_twice_the_formats_roundoff(demo_model, dtype):
    # A demo request with a 256-token system prompt (the README's table uses 1024; the
    # errors are the same to two digits, and this runs in a second on two cores).
    prompt = make_requests(1, 256, 8, demo_model.config.vocab_size, 0)[0].prompt
    err, _ = logits_error(demo_model, dtype, prompt, 16)
    assert err <= 2 * UNIT_ROUNDOFF[dtype], f"{dtype}: relative logits error {err:.3g}"
    assert err > 0  # the cache really stored fewer bits


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_tiny_llama_logits_stay_within_twice_the_formats_roundoff(tiny_model, dtype):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 128, (200,), generator=g).tolist()
    err, _ = logits_error(tiny_model, dtype, prompt, 32)
    assert err <= 2 * UNIT_ROUNDOFF[dtype], f"{dtype}: relative logits error {err:.3g}"


def test_the_float32_cache_is_exact_to_rounding(tiny_model):
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 128, (50,), generator=g).tolist()
    err, agree = logits_error(tiny_model, "float32", prompt, 8)
    assert err < 1e-5 and agree == 1.0


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_generate_with_8bit_contiguous_and_paged_caches_agrees(tiny_model, dtype):
    """Both caches store the same codes and attention reads the same values, so their
    greedy tokens are equal; int8's are also the float32 cache's (its error is too small
    to flip this model's choices), and every dtype's first token is."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 12), generator=g)

    def run(cache):
        with torch.no_grad():
            return tiny_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )

    config = tiny_model.config
    contiguous = run(KvrsCache.from_config(config, max_seq_len=64, dtype=dtype))
    paged = run(
        KvrsPagedCache.from_config(config, max_seq_len=64, max_batch_size=2, block_size=4, dtype=dtype)
    )
    full = run(KvrsCache.from_config(config, max_seq_len=64, dtype="float32"))
    assert torch.equal(contiguous, paged)
    assert torch.equal(contiguous[:, 12], full[:, 12])
    if dtype == "int8":
        assert torch.equal(contiguous, full)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_checkpoint_scales_reach_every_layer_and_head(tiny_model, kind):
    """fp8 caches take a checkpoint's scales per layer and KV head: the paged cache's pool
    holds them as given, and each contiguous layer's cache (batch rows x KV heads) holds
    its layer's scales repeated for every row."""
    config = tiny_model.config
    k_scale = np.array([[0.02, 0.03], [0.04, 0.05]], np.float32)  # [layers, kv heads]
    v_scale = np.array([0.01, 0.02], np.float32)  # per layer
    if kind == "contiguous":
        cache = KvrsCache.from_config(
            config, max_seq_len=64, dtype="fp8_e4m3", k_scale=k_scale, v_scale=v_scale
        )
    else:
        cache = KvrsPagedCache.from_config(
            config, max_seq_len=64, dtype="fp8_e4m3", k_scale=k_scale, v_scale=v_scale
        )
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        tiny_model(ids, past_key_values=cache, use_cache=True)
    if kind == "paged":
        np.testing.assert_array_equal(cache.pool.k_scale, k_scale)
        np.testing.assert_array_equal(cache.pool.v_scale, np.repeat(v_scale[:, None], 2, axis=1))
    else:
        for layer, held in enumerate(cache.layers):
            # The layer's KVCache holds batch x kv-heads heads: the per-head scales repeat.
            np.testing.assert_array_equal(held.store.k_scale, [np.tile(k_scale[layer], 2)])
            np.testing.assert_array_equal(held.store.v_scale, [[v_scale[layer]] * 4])
    with pytest.raises(ValueError, match="k_scale"):
        KvrsCache.from_config(config, max_seq_len=8, dtype="fp8_e4m3", k_scale=[1.0, 2.0, 3.0])
