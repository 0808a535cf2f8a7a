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
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
)

import kvrs  # noqa: E402
from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache, generate_batch  # noqa: E402

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
        kw.setdefault("max_new_tokens", 24)
        kw.setdefault("do_sample", False)
        return model.generate(ids, past_key_values=cache, pad_token_id=0, **kw)


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


def test_paged_from_config_sizes(model):
    for kw in ({}, {"num_blocks": 8, "memory_bytes": "1MiB"}, {"max_prompt_len": 8, "num_blocks": 8}):
        with pytest.raises(ValueError, match=r"give max_seq_len|not both|needs max_seq_len beside it"):
            KvrsPagedCache.from_config(model.config, **kw)
    with pytest.raises(ValueError, match="block_size=0: must be >= 1"):
        KvrsPagedCache.from_config(model.config, max_seq_len=16, block_size=0)
    assert KvrsPagedCache.from_config(model.config, num_blocks=8).pool.num_blocks == 8
    # num_blocks beside max_seq_len: exactly that many, which must hold the rows.
    need = KvrsPagedCache.from_config(model.config, max_seq_len=40, max_batch_size=2).pool.num_blocks
    assert (
        KvrsPagedCache.from_config(
            model.config, max_seq_len=40, max_batch_size=2, num_blocks=need + 3
        ).pool.num_blocks
        == need + 3
    )
    with pytest.raises(
        ValueError,
        match=rf"num_blocks={need - 1} makes {need - 1} blocks; max_batch_size=2 rows of "
        rf"max_seq_len=40 need {need}",
    ):
        KvrsPagedCache.from_config(model.config, max_seq_len=40, max_batch_size=2, num_blocks=need - 1)


# Gemma-2-like (sliding and full layers alternating) and Gemma-3-like (5 sliding : 1 full)
# models: each layer kind has its own block tables drawing on the pool's blocks.
GEMMA_SIZES = {**SIZES, "sliding_window": 16, "eos_token_id": None}
GEMMAS = {
    "gemma2": (Gemma2Config(**GEMMA_SIZES), Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig(**{**GEMMA_SIZES, "num_hidden_layers": 6}), Gemma3ForCausalLM),
}


@pytest.fixture(scope="module", params=sorted(GEMMAS))
def gemma(request):
    config, cls = GEMMAS[request.param]
    torch.manual_seed(0)
    return cls(config).eval()


def test_gemma_like_models_reach_max_seq_len_in_a_cache_sized_by_layer_groups(gemma):
    """from_config(max_seq_len=L) sizes every block table: a Gemma-2-like model used to
    stop at position 52 of 64, a Gemma-3-like one could not take a 30-token prompt."""
    kinds = gemma.config.layer_types
    assert kinds.count("sliding_attention") == (2 if len(kinds) == 4 else 5)
    prompt, max_seq_len = (40, 64) if len(kinds) == 4 else (30, 64)
    ids = prompts(batch=1, length=prompt)
    cache = KvrsPagedCache.from_config(gemma, max_seq_len=max_seq_len)
    out = generate(gemma, cache, ids, max_new_tokens=max_seq_len - prompt)
    assert out.shape[1] == max_seq_len
    assert torch.equal(out, generate(gemma, dynamic(gemma), ids, max_new_tokens=max_seq_len - prompt))
    layers = [t.removesuffix("_attention") for t in kinds]
    assert cache.pool.num_blocks == kvrs.blocks_per_sequence(
        max_seq_len, layer_types=layers, sliding_window=16
    )
    cache.pool.check_invariants()
    # generate_batch sizes its own pool the same way.
    assert generate_batch(gemma, ids.tolist(), max_new_tokens=max_seq_len - prompt) == [
        out[0, prompt:].tolist()
    ]


def test_max_prompt_len_sizes_sliding_tables_by_their_window(gemma):
    """A sliding table holds its window plus what one forward adds: with the longest
    prompt given, a 5 sliding : 1 full model needs far fewer blocks than 6 tables of
    max_seq_len, and a longer prompt is a CacheFullError naming max_prompt_len."""
    kinds = [t.removesuffix("_attention") for t in gemma.config.layer_types]
    cache = KvrsPagedCache.from_config(gemma, max_seq_len=128, max_prompt_len=20, block_size=8)
    full = kvrs.blocks_per_sequence(128, block_size=8, layer_types=kinds, sliding_window=16)
    per_table = 128 // 8
    assert cache.pool.num_blocks == kvrs.blocks_per_sequence(
        128, block_size=8, layer_types=kinds, sliding_window=16, max_chunk=20
    )
    assert cache.pool.num_blocks < full == cache.pool.num_layer_groups * per_table
    ids = prompts(batch=1, length=20)
    out = generate(gemma, cache, ids, max_new_tokens=24)  # past the window of 16, twice
    assert torch.equal(out, generate(gemma, dynamic(gemma), ids, max_new_tokens=24))
    cache = KvrsPagedCache.from_config(gemma, max_seq_len=128, max_prompt_len=20, block_size=8)
    with pytest.raises(
        kvrs.CacheFullError, match=r"max_prompt_len=20.*this needs max_prompt_len=100: raise max_prompt_len"
    ):
        generate(gemma, cache, prompts(batch=1, length=100), max_new_tokens=4)


def test_cache_full_names_the_setting_to_raise(gemma):
    cache = KvrsPagedCache.from_config(gemma, max_seq_len=32, block_size=16)
    with pytest.raises(kvrs.CacheFullError, match="this needs max_seq_len=33: raise max_seq_len"):
        generate(gemma, cache, prompts(batch=1, length=20), max_new_tokens=20)
    cache = KvrsPagedCache.from_config(gemma, max_seq_len=32, max_batch_size=1)
    with pytest.raises(kvrs.CacheFullError, match="this needs max_batch_size=2: raise max_batch_size"):
        generate(gemma, cache, prompts(batch=2, length=20), max_new_tokens=2)
    pool = KvrsPagedCache.from_config(gemma, max_seq_len=16).pool
    with pytest.raises(kvrs.CacheFullError, match=r"give it a larger pool \(block_pool_from_config"):
        generate(gemma, KvrsPagedCache(pool), prompts(batch=1, length=20), max_new_tokens=2)
    with pytest.raises(
        kvrs.CacheFullError,
        match="holds max_seq_len=24 positions per layer; make it with a larger max_seq_len",
    ):
        generate(
            gemma, KvrsCache.from_config(gemma, max_seq_len=24), prompts(batch=1, length=20), max_new_tokens=8
        )
