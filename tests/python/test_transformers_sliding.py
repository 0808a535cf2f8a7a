"""Sliding-window models in kvrs's transformers caches: tiny randomly initialised
Mistral (every layer sliding) and Gemma2 (sliding and full layers alternating) configs
give the same outputs as DynamicCache, while the paged cache releases what windows left."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache  # noqa: E402

WINDOW = 8
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=WINDOW,
)
MODELS = {
    "mistral": (MistralConfig(**SIZES), MistralForCausalLM),
    "gemma2": (Gemma2Config(**SIZES), Gemma2ForCausalLM),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    config, cls = MODELS[request.param]
    torch.manual_seed(0)
    return cls(config).eval()


def paged(model, rows=4, swa_memory=0):
    return KvrsPagedCache.from_config(
        model.config, max_seq_len=80, max_batch_size=rows, block_size=4, swa_memory=swa_memory
    )


def contiguous(model, rows=4, swa_memory=0):
    return KvrsCache.from_config(model.config, max_seq_len=80)


@pytest.fixture(params=[contiguous, paged], ids=["contiguous", "paged"])
def kvrs_cache(request):
    return request.param


def prompts(batch=2, length=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def generate(model, cache, ids, **kw):
    with torch.no_grad():
        kw.setdefault("attention_mask", torch.ones_like(ids))
        return model.generate(ids, past_key_values=cache, max_new_tokens=24, pad_token_id=0, **kw)


def dynamic(model):
    return DynamicCache(config=model.config)


def test_layer_types_follow_the_config(model):
    pool = paged(model).pool
    expected = {"mistral": ["sliding"] * 4, "gemma2": ["sliding", "full"] * 2}
    kind = "gemma2" if isinstance(model, Gemma2ForCausalLM) else "mistral"
    assert pool.layer_types == expected[kind]
    assert pool.sliding_window == WINDOW


def test_greedy_past_the_window_matches_dynamic_cache(model, kvrs_cache):
    ids = prompts()  # 20 prompt tokens + 24 generated, window 8
    assert torch.equal(generate(model, kvrs_cache(model), ids), generate(model, dynamic(model), ids))


def test_left_padded_batch_matches_dynamic_cache(model, kvrs_cache):
    ids = prompts(batch=3, length=14)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0
    out = generate(model, kvrs_cache(model), ids, attention_mask=mask)
    assert torch.equal(out, generate(model, dynamic(model), ids, attention_mask=mask))


def test_beam_search_matches_dynamic_cache(model, kvrs_cache):
    ids = prompts(length=12)
    kw = {"num_beams": 2, "do_sample": False}
    out = generate(model, kvrs_cache(model, rows=4), ids, **kw)
    assert torch.equal(out, generate(model, dynamic(model), ids, **kw))


def test_assisted_decoding_rolls_back_within_swa_memory(model):
    torch.manual_seed(3)
    assistant = type(model)(model.config).eval()
    ids = prompts(batch=1)
    kw = {"assistant_model": assistant, "do_sample": False}
    out = generate(model, paged(model, rows=1, swa_memory=24), ids, **kw)
    assert torch.equal(out, generate(model, dynamic(model), ids, **kw))


def test_manual_loop_logits_with_chunked_prefill(model):
    ids = prompts(length=20)
    caches = (paged(model), dynamic(model))
    outs: tuple[list, list] = ([], [])
    with torch.no_grad():
        for cache, logits in zip(caches, outs, strict=True):
            for chunk in (ids[:, :7], ids[:, 7:13], ids[:, 13:]):  # chunks shorter than, then past the window
                step = model(chunk, past_key_values=cache, use_cache=True)
                logits.append(step.logits)
            for _ in range(12):
                step = model(step.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
                logits.append(step.logits)
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


def test_paged_cache_releases_what_the_window_left(model):
    cache = paged(model, rows=2)
    generate(model, cache, prompts())  # 44 positions per row
    st = cache.pool.stats()["by_layer_type"]
    # Each row keeps positions seq_len - WINDOW + 1.., rounded down to a 4-token block,
    # plus the block being filled: at most 3 blocks per row and sliding layer group.
    assert st["sliding"]["used_blocks"] <= 2 * 3
    if "full" in st:
        assert st["full"]["used_blocks"] == 2 * 11
    for layer, kind in enumerate(cache.pool.layer_types):
        start = cache.layer_start(layer)
        assert start == 0 if kind == "full" else 44 - WINDOW + 1 - 4 < start <= 44 - WINDOW + 1
    cache.pool.check_invariants()


def test_crop_past_released_positions_is_refused_and_changes_nothing(model):
    cache = paged(model, rows=1)
    with torch.no_grad():
        model(prompts(batch=1, length=30), past_key_values=cache, use_cache=True)
    before = cache.pool.stats()
    with pytest.raises(ValueError, match="larger swa_memory"):
        cache.crop(-10)
    assert cache.get_seq_length() == 30 and cache.pool.stats() == before
    cache.crop(-1)  # the window still holds what position 29 sees
    assert cache.get_seq_length() == 29


def test_paged_from_config_wants_exactly_one_size(model):
    for kw in ({}, {"max_seq_len": 16, "num_blocks": 8}, {"num_blocks": 8, "memory_bytes": "1MiB"}):
        with pytest.raises(ValueError, match="exactly one of max_seq_len"):
            KvrsPagedCache.from_config(model.config, **kw)
    with pytest.raises(ValueError, match="block_size=0: each must be >= 1"):
        KvrsPagedCache.from_config(model.config, max_seq_len=16, block_size=0)
    assert KvrsPagedCache.from_config(model.config, num_blocks=8).pool.num_blocks == 8
