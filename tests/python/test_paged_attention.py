"""Continuous batching of transformers models over a BlockPool (`forward_batch`): ragged
batches of several sequences in one forward pass give each sequence the logits it gets
alone with DynamicCache."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from kvrs.integrations.transformers import (  # noqa: E402
    KvrsCache,
    KvrsLayer,
    KvrsPagedCache,
    block_pool_from_config,
    forward_batch,
    use_paged_attention,
)

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def make(cls, config):
    torch.manual_seed(0)
    return use_paged_attention(cls(config).eval())


@pytest.fixture(
    scope="module",
    params=[
        (LlamaConfig(**SIZES), LlamaForCausalLM),
        (MistralConfig(**SIZES, sliding_window=6), MistralForCausalLM),
    ],
    ids=["llama", "mistral-sliding"],
)
def model(request):
    return make(request.param[1], request.param[0])


def reference_logits(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits of the prompt's last token and of every later token, run alone with
    DynamicCache (prefill, then one token per step)."""
    cache = DynamicCache(config=model.config)
    out = [model(torch.tensor([tokens[:prompt_len]]), past_key_values=cache, use_cache=True).logits[0, -1]]
    for t in tokens[prompt_len:-1]:
        out.append(model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_batches_match_each_sequence_alone(model, dtype):
    pool = block_pool_from_config(model.config, num_blocks=64, block_size=4, dtype=dtype)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n).tolist() for n in (9, 3, 14)]
    seqs = [pool.new_sequence(tokens=p) for p in prompts]
    tokens = [list(p) for p in prompts]
    got: list[list[torch.Tensor]] = [[], [], []]
    with torch.no_grad():
        for step in range(10):
            # The third request arrives at step 3: its prefill runs beside the others' decode.
            live = [i for i in range(3) if i < 2 or step >= 3]
            batch_seqs, ids, last = [], [], []
            for i in live:
                todo = tokens[i][seqs[i].seq_len :]
                batch_seqs += [seqs[i]] * len(todo)
                ids += todo
                last.append(len(ids) - 1)
            with pool.start_forward(batch_seqs, tokens=ids) as batch:
                logits = forward_batch(model, batch, ids)
            assert logits.shape == (len(ids), 128)
            for i, row in zip(live, last, strict=True):
                got[i].append(logits[row])
                tokens[i].append(int(logits[row].argmax()))
    pool.check_invariants()
    tol = 1e-5 if dtype == "float32" else 5e-2
    with torch.no_grad():
        for i in range(3):
            expected = reference_logits(model, tokens[i], len(prompts[i]))
            assert torch.allclose(torch.stack(got[i]), expected, atol=tol), i
    if pool.sliding_window is not None:  # windows released what they left
        assert all(s.layer_start(0) > 0 for s in seqs)


def test_the_model_still_generates_without_a_batch(model):
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        model.set_attn_implementation("sdpa")
        try:
            theirs = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        finally:
            use_paged_attention(model)
    assert torch.equal(ours, theirs)


def test_bad_calls_raise_and_change_nothing(model):
    pool = block_pool_from_config(model.config, num_blocks=16, block_size=4)
    seq = pool.new_sequence()
    with torch.no_grad(), pool.start_forward([seq, seq], tokens=[1, 2]) as batch:
        with pytest.raises(ValueError, match=r"token_ids has shape \(3,\); the batch needs \[2\]"):
            forward_batch(model, batch, [1, 2, 3])
        with pytest.raises(ValueError, match=r"shape \(1, 2\)"):
            forward_batch(model, batch, [[1, 2]])
        with pytest.raises(ValueError, match=r"\[0, 128\) \(the model's vocab_size\)"):
            forward_batch(model, batch, [1, 128])
        batch.cancel()
    assert seq.seq_len == 0 and pool.stats()["used_blocks"] == 0
    plain = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    with pool.start_forward([seq], tokens=[1]) as batch:
        with pytest.raises(ValueError, match="use_paged_attention"):
            forward_batch(plain, batch, [1])
        batch.cancel()


GEMMA2 = (Gemma2Config(**SIZES, head_dim=16, sliding_window=6), Gemma2ForCausalLM)
GPT_OSS = (
    GptOssConfig(**SIZES, head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2),
    GptOssForCausalLM,
)


@pytest.mark.parametrize("arch", [GEMMA2, GPT_OSS], ids=["gemma2-softcap", "gpt-oss-sinks"])
def test_soft_capping_and_sinks_match_dynamic_cache(arch):
    """Gemma 2's logit soft-capping and gpt-oss's attention sinks are computed by kvrs."""
    model = make(arch[1], arch[0])
    test_ragged_batches_match_each_sequence_alone(model, "float32")


@pytest.mark.parametrize("arch", [(LlamaConfig(**SIZES), LlamaForCausalLM), GEMMA2, GPT_OSS],
                         ids=["llama", "gemma2", "gpt-oss"])  # fmt: skip
@pytest.mark.parametrize("cache_kind", ["paged", "contiguous"])
def test_kvrs_caches_attend_in_place_token_identical_to_dynamic_cache(arch, cache_kind, monkeypatch):
    config, cls = arch
    torch.manual_seed(0)
    model = cls(config).eval()
    ids = torch.tensor([[5, 9, 17, 3, 44, 7, 8, 11, 2]])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
        use_paged_attention(model)
        if cache_kind == "paged":
            cache = KvrsPagedCache.from_config(model.config, max_seq_len=64, block_size=4)
        else:
            cache = KvrsCache.from_config(model.config, max_seq_len=64)
        calls = []
        attend = type(cache).attend if cache_kind == "paged" else KvrsLayer.attend
        monkeypatch.setattr(
            type(cache) if cache_kind == "paged" else KvrsLayer,
            "attend",
            lambda self, *a, **k: calls.append(1) or attend(self, *a, **k),
        )
        got = model.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(got, expected)
    # Every layer of every step attended through kvrs (prefill plus 11 decode steps).
    assert len(calls) == config.num_hidden_layers * 12


def test_a_batch_computes_the_token_ids_it_caches_under(model):
    # Regression (trust review, defect 9): other ids than start_forward(tokens=...) stored
    # the K/V of the first under the hashes of the second, and later prompts hit them.
    pool = block_pool_from_config(model.config, num_blocks=16, block_size=4)
    seq = pool.new_sequence(tokens=[5, 6, 7, 8, 9])
    with torch.no_grad(), pool.start_forward([seq] * 4, tokens=[5, 6, 7, 8]) as batch:
        with pytest.raises(ValueError, match=r"token_ids\[2\]=70, but the batch records token id 7"):
            forward_batch(model, batch, [5, 6, 70, 8])
        batch.cancel()
    assert seq.seq_len == 0 and pool.match_prefix([5, 6, 7, 8, 9]) == 0
    # Without ids, the batch computes the ids it records: the given ones, or the prompt's.
    with torch.no_grad(), pool.start_forward([seq] * 4) as batch:
        assert batch.token_ids.tolist() == [5, 6, 7, 8]
        logits = forward_batch(model, batch)
    with torch.no_grad():
        alone = model(torch.tensor([[5, 6, 7, 8]]), past_key_values=DynamicCache(config=model.config))
    assert torch.allclose(logits, alone.logits[0], atol=1e-5)
    assert pool.match_prefix([5, 6, 7, 8, 9]) == 4
    blank = pool.new_sequence()
    with torch.no_grad(), pool.start_forward([blank]) as batch:
        with pytest.raises(ValueError, match="knows no id for batch tokens"):
            forward_batch(model, batch)
        batch.cancel()
