"""KvrsCache inside Hugging Face transformers: outputs equal DynamicCache's, on a tiny
randomly initialised LlamaForCausalLM (no download)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvrs.integrations.transformers import KvrsCache, KvrsPagedCache  # noqa: E402

CFG = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG).eval()


def prompts(batch=2, length=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def generate(model, cache, ids, **kw):
    with torch.no_grad():
        kw.setdefault("attention_mask", torch.ones_like(ids))
        return model.generate(ids, past_key_values=cache, max_new_tokens=16, pad_token_id=0, **kw)


def contiguous(dtype=None, max_seq_len=128, rows=8):
    """A KvrsCache (rows: unused, the contiguous layers size themselves on first use)."""
    return KvrsCache.from_config(CFG, max_seq_len=max_seq_len, dtype=dtype)


def paged(dtype=None, max_seq_len=128, rows=8):
    """A KvrsPagedCache whose pool holds `rows` rows of `max_seq_len` positions."""
    return KvrsPagedCache.from_config(
        CFG, num_blocks=rows * -(-max_seq_len // 4), block_size=4, dtype=dtype or "float32"
    )


@pytest.fixture(params=[contiguous, paged], ids=["contiguous", "paged"])
def kvrs_cache(request):
    """Makes a kvrs-backed transformers cache: contiguous KVCache layers or a BlockPool."""
    return request.param


def test_greedy_matches_dynamic_cache(model, kvrs_cache):
    ids = prompts()
    assert torch.equal(generate(model, kvrs_cache(), ids), generate(model, DynamicCache(config=CFG), ids))


def test_left_padded_batch_matches_dynamic_cache(model, kvrs_cache):
    ids = prompts(batch=3, length=9)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # shorter prompts, padded on the left
    ids[2, :2], mask[2, :2] = 0, 0
    out = generate(model, kvrs_cache(), ids, attention_mask=mask)
    assert torch.equal(out, generate(model, DynamicCache(config=CFG), ids, attention_mask=mask))


def test_sampling_matches_dynamic_cache(model, kvrs_cache):
    ids = prompts()
    torch.manual_seed(7)
    out = generate(model, kvrs_cache(), ids, do_sample=True, top_k=20)
    torch.manual_seed(7)
    assert torch.equal(out, generate(model, DynamicCache(config=CFG), ids, do_sample=True, top_k=20))


def test_beam_search_matches_dynamic_cache(model, kvrs_cache):
    ids = prompts()
    out = generate(model, kvrs_cache(), ids, num_beams=3, do_sample=False)
    assert torch.equal(out, generate(model, DynamicCache(config=CFG), ids, num_beams=3, do_sample=False))


def test_assisted_decoding_crops(model, kvrs_cache):
    torch.manual_seed(3)
    assistant = LlamaForCausalLM(CFG).eval()
    ids = prompts(batch=1)
    kw = {"assistant_model": assistant, "do_sample": False}
    out = generate(model, kvrs_cache(), ids, **kw)
    assert torch.equal(out, generate(model, DynamicCache(config=CFG), ids, **kw))


@pytest.mark.parametrize(("dtype", "tol"), [(None, 1e-5), ("float16", 3e-2), ("bfloat16", 2e-1)])
def test_manual_loop_logits(model, kvrs_cache, dtype, tol):
    ids = prompts(batch=2, length=12)
    caches = (kvrs_cache(dtype), DynamicCache(config=CFG))
    outs = ([], [])
    with torch.no_grad():
        for cache, logits in zip(caches, outs, strict=True):
            step = model(ids[:, :8], past_key_values=cache, use_cache=True)  # chunked prefill
            logits.append(step.logits)
            step = model(ids[:, 8:], past_key_values=cache, use_cache=True)
            logits.append(step.logits)
            for _ in range(6):
                nxt = step.logits[:, -1:].argmax(-1)
                step = model(nxt, past_key_values=cache, use_cache=True)
                logits.append(step.logits)
    assert caches[0].get_seq_length() == 18
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, atol=tol), float((a - b).abs().max())


def test_prompt_cache_reused_across_calls(model, kvrs_cache):
    ids = prompts(batch=1, length=10)
    prompt_cache = kvrs_cache()
    with torch.no_grad():
        model(ids, past_key_values=prompt_cache, use_cache=True)
    for suffix in ([5, 6, 7], [9]):
        full = torch.cat([ids, torch.tensor([suffix])], dim=1)
        reused = generate(model, copy.deepcopy(prompt_cache), full)
        assert torch.equal(reused, generate(model, DynamicCache(config=CFG), full))
    assert prompt_cache.get_seq_length() == 10  # the copies did not touch it


def test_crop_and_reset(model, kvrs_cache):
    cache = kvrs_cache()
    with torch.no_grad():
        model(prompts(batch=1, length=10), past_key_values=cache, use_cache=True)
    cache.crop(-4)
    assert cache.get_seq_length() == 6
    cache.crop(0)
    assert cache.get_seq_length() == 6
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_full_cache_raises_a_clear_error(model, kvrs_cache):
    import kvrs

    with pytest.raises(kvrs.CacheFullError), torch.no_grad():
        model(prompts(batch=1, length=20), past_key_values=kvrs_cache(max_seq_len=16, rows=1), use_cache=True)


def test_paged_beam_search_shares_blocks_and_frees_them(model):
    cache = paged(rows=8)
    ids = prompts(batch=2, length=12)
    generate(model, cache, ids, num_beams=3, do_sample=False)
    st = cache.pool.stats()
    # 6 beam rows of 28 positions would take 6 * 7 blocks unshared; forks share the prompt.
    assert st["used_blocks"] < 6 * 7 and st["num_sequences"] == 6
    cache.pool.check_invariants()
    cache.reset()
    assert cache.pool.stats()["used_blocks"] == 0


def test_paged_prompt_copies_share_blocks(model):
    cache = paged()
    with torch.no_grad():
        model(prompts(batch=1, length=16), past_key_values=cache, use_cache=True)
    used = cache.pool.stats()["used_blocks"]
    copies = [copy.deepcopy(cache) for _ in range(3)]
    assert cache.pool.stats()["used_blocks"] == used  # forks: no new block
    assert all(c.get_seq_length() == 16 for c in copies)


def test_kvrs_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvrs\n"
        "try:\n"
        "    import kvrs.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install torch transformers" in out


def test_unsupported_transformers_versions_are_refused_at_import():
    code = (
        "import transformers; transformers.__version__ = '4.57.1'\n"
        "try:\n"
        "    import kvrs.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "supports transformers >=5.15,<6" in out and "found 4.57.1" in out
