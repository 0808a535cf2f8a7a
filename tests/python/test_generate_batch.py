"""generate_batch (continuous batching of a transformers model over a BlockPool) and
the ForwardBatch fields a sampler or kernel reads: qo_indptr, last_token_indices,
forward_batch(..., logits_to_keep=...)."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    ContinuousBatchingConfig,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

import kvrs  # noqa: E402
from kvrs.demo import make_tiny_model  # noqa: E402
from kvrs.integrations.transformers import (  # noqa: E402
    block_pool_from_config,
    forward_batch,
    generate_batch,
    restore_attention,
    use_paged_attention,
)

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(3)


def prompts(seed: int = 0) -> list[list[int]]:
    """Five prompts: three share a 40-token prefix, two are their own."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 128, 40).tolist()
    return [
        shared + rng.integers(1, 128, 7).tolist(),
        shared + rng.integers(1, 128, 12).tolist(),
        rng.integers(1, 128, 23).tolist(),
        shared + rng.integers(1, 128, 3).tolist(),
        rng.integers(1, 128, 5).tolist(),
    ]


def reference(model, prompt: list[int], new: int, eos=None) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=DynamicCache(config=model.config),
            max_new_tokens=new,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_outputs_equal_generate_with_dynamic_cache(model):
    ps = prompts()
    budgets = [9, 4, 12, 1, 7]
    got = generate_batch(model, ps, max_new_tokens=budgets, eos_token_id=[])
    assert got == [reference(model, p, n) for p, n in zip(ps, budgets, strict=True)]


def test_a_given_pool_serves_shared_prefixes_from_its_cache(model):
    ps = prompts(1)
    pool = block_pool_from_config(model.config, num_blocks=64, block_size=8)
    seen = []
    got = generate_batch(
        model,
        ps,
        pool=pool,
        max_new_tokens=5,
        eos_token_id=[],
        on_step=lambda step, p, states: seen.append(states),
    )
    assert got == [reference(model, p, 5) for p in ps]
    states = seen[-1]
    # The second request sharing the 40-token prefix waited a step and attached it.
    assert states[1].cached >= 40 or states[3].cached >= 40
    assert all(s.finished >= s.admitted >= 0 for s in states)
    assert pool.stats()["used_blocks"] == 0  # every sequence freed; blocks stay cached
    pool.check_invariants()


def test_stop_tokens_end_a_request_and_are_included(model):
    ps = prompts(2)
    free = generate_batch(model, ps, max_new_tokens=10, eos_token_id=[])
    stop = free[0][3]
    got = generate_batch(model, ps, max_new_tokens=10, eos_token_id=stop)
    for out, full, p in zip(got, free, ps, strict=True):
        cut = full[: full.index(stop) + 1] if stop in full else full
        assert out == cut
        assert out == reference(model, p, 10, eos=stop)


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    ps = prompts(3)
    kw = dict(max_new_tokens=8, eos_token_id=[], do_sample=True, temperature=1.5)
    a = generate_batch(model, ps, seed=7, **kw)
    b = generate_batch(model, ps, seed=7, **kw)
    c = generate_batch(model, ps, seed=8, **kw)
    assert a == b
    assert a != c
    # A request's draws depend on the seed and its index only: not on the other
    # requests, nor on what the pool had cached.
    pool = block_pool_from_config(model.config, num_blocks=64, block_size=8)
    assert generate_batch(model, ps, pool=pool, seed=7, **kw) == a
    assert generate_batch(model, ps, pool=pool, seed=7, **kw) == a
    assert pool.stats()["prefix_hit_tokens"] > 0
    assert generate_batch(model, ps[:2], seed=7, **kw) == a[:2]
    assert all(0 <= t < 128 for out in a for t in out)
    greedy = generate_batch(model, ps, max_new_tokens=8, eos_token_id=[])
    assert (
        generate_batch(model, ps, seed=1, max_new_tokens=8, eos_token_id=[], do_sample=True, top_k=1)
        == greedy
    )
    # top_p small enough keeps only the most likely token: greedy again.
    assert (
        generate_batch(model, ps, seed=1, max_new_tokens=8, eos_token_id=[], do_sample=True, top_p=1e-6)
        == greedy
    )


def test_generate_batch_leaves_the_model_as_it_was():
    """A model the caller did not switch comes back unswitched, also after an exception:
    its config (shared with any model built from it) keeps its attention, and
    transformers' own generate_batch runs on it. use_paged_attention is the explicit
    switch, and restore_attention undoes it."""
    config = LlamaConfig(**TINY)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    before = config._attn_implementation
    ps = prompts()[:3]
    ours = generate_batch(model, ps, max_new_tokens=4, eos_token_id=[])
    assert config._attn_implementation == before
    assert LlamaForCausalLM(config).config._attn_implementation == before
    assert not model._forward_pre_hooks
    assert all("forward" not in m.__dict__ and not hasattr(m, "_kvrs_layer") for m in model.modules())
    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    # A small cache: left to size itself, transformers takes most of the host's memory.
    small = ContinuousBatchingConfig(num_blocks=4, max_batch_tokens=64)
    with torch.no_grad():
        theirs = model.generate_batch(
            ps, generation_config=gc, continuous_batching_config=small, warmup=False
        )
    assert [list(out.generated_tokens) for out in theirs.values()] == ours

    def fail(step, pool, states):
        raise RuntimeError("a caller's on_step failed")

    with pytest.raises(RuntimeError, match="on_step failed"):
        generate_batch(model, ps, max_new_tokens=4, on_step=fail)
    assert config._attn_implementation == before and not model._forward_pre_hooks

    # The explicit switch stays switched through generate_batch, until restored.
    use_paged_attention(model)
    assert config._attn_implementation == "kvrs_paged"
    assert generate_batch(model, ps, max_new_tokens=4, eos_token_id=[]) == ours
    assert config._attn_implementation == "kvrs_paged"
    assert restore_attention(model) is model
    assert config._attn_implementation == before and not model._forward_pre_hooks
    assert restore_attention(model) is model  # a model not switched: nothing to undo
    assert [reference(model, p, 4) for p in ps] == ours


def test_progress_bar_shows_tokens_per_second_before_a_request_ends(model, capsys):
    """vLLM's line: requests, and prompt (input) and generated (output) tokens per
    second, shown while the first request still runs."""
    import time

    seen = []

    def slow(step, pool, states):
        seen.append(sum(s.finished >= 0 for s in states))
        time.sleep(0.12)

    generate_batch(model, prompts()[:2], max_new_tokens=4, eos_token_id=[], progress_bar=True, on_step=slow)
    err = capsys.readouterr().err
    first = err[: err.index("1/2")] if "1/2" in err else err
    assert "Processed prompts:   0%" in first
    speeds = re.findall(r"0/2 \[[^]]*est\. speed input: ([\d,.]+) toks/s, output: ([\d,.]+) toks/s\]", first)
    assert speeds and float(speeds[-1][0].replace(",", "")) > 0 and float(speeds[-1][1].replace(",", "")) > 0
    assert seen[:2] == [0, 0]


def test_arrivals_progress_bar_and_zero_budgets(model):
    ps = prompts(4)
    got = generate_batch(
        model,
        ps,
        max_new_tokens=[3, 0, 2, 5, 1],
        arrivals=[0, 0, 4, 9, 2],
        eos_token_id=[],
        progress_bar=True,
    )
    assert [len(o) for o in got] == [3, 0, 2, 5, 1]
    assert got[3] == reference(model, ps[3], 5)
    assert generate_batch(model, [], max_new_tokens=3) == []


def test_bad_arguments_are_clear_errors(model):
    with pytest.raises(ValueError, match=r"inputs\[1\] is empty"):
        generate_batch(model, [[1, 2], []])
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        generate_batch(model, [[1, 500]])
    with pytest.raises(ValueError, match="max_new_tokens: 1 values for 2 inputs"):
        generate_batch(model, [[1], [2]], max_new_tokens=[3])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        generate_batch(model, [[1]], max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        generate_batch(model, [[1]], do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match=r"top_k=-1"):
        generate_batch(model, [[1]], do_sample=True, top_k=-1)
    with pytest.raises(ValueError, match=r"top_p=0.0: give a probability in \(0, 1\]"):
        generate_batch(model, [[1]], do_sample=True, top_p=0.0)
    small = block_pool_from_config(model.config, num_blocks=2, block_size=4)
    with pytest.raises(
        ValueError,
        match=r"inputs\[0\]: 9 prompt \+ 4 new tokens need 4 blocks of 4, more than the pool's 2: "
        r"give generate_batch a larger pool \(num_blocks=\)",
    ):
        generate_batch(model, [list(range(1, 10))], pool=small, max_new_tokens=4)


def test_a_pool_held_by_others_raises_instead_of_waiting_forever(model):
    pool = block_pool_from_config(model.config, num_blocks=4, block_size=4)
    held = pool.new_sequence()
    pool.reserve([held], [12])  # three of the four blocks
    with pytest.raises(
        kvrs.CacheFullError,
        match=r"cache full: inputs\[0\] needs 3 more blocks but 1 of 4 blocks are free \(other sequences "
        r"hold the rest\): free them, or give generate_batch a pool with more blocks \(num_blocks=\)",
    ):
        generate_batch(model, [[1, 2, 3, 4, 5]], pool=pool, max_new_tokens=4)
    assert pool.stats()["used_blocks"] == 3  # the request's sequence was freed
    held.free()


def run_batch(model, pool, seqs, ids, **kw):
    with torch.no_grad(), pool.start_forward(seqs, tokens=ids) as batch:
        return batch, forward_batch(model, batch, **kw)


def test_batch_fields_and_logits_to_keep(model):
    pool = block_pool_from_config(model.config, num_blocks=32, block_size=4, prefix_caching=False)
    a, b, c = pool.new_sequence(), pool.new_sequence(), pool.new_sequence()
    with torch.no_grad(), pool.start_forward([a] * 5 + [b] * 2 + [c] * 3, tokens=list(range(1, 11))) as batch:
        assert batch.qo_indptr.tolist() == [0, 5, 7, 10]
        assert batch.qo_indptr.dtype == np.int32
        assert batch.last_token_indices.tolist() == [4, 6, 9]
        full = forward_batch(model, batch)
        last = forward_batch(model, batch, logits_to_keep="last")
        some = forward_batch(model, batch, logits_to_keep=[0, 6])
        batch.cancel()
    assert torch.allclose(last, full[[4, 6, 9]], atol=1e-5)
    assert torch.allclose(some, full[[0, 6]], atol=1e-5)
    # Interleaved tokens: no qo_indptr, but the last rows still.
    with pool.start_forward([a, b, a, c], tokens=[1, 2, 3, 4]) as batch:
        with pytest.raises(ValueError, match="not one contiguous run"):
            batch.qo_indptr  # noqa: B018
        assert batch.last_token_indices.tolist() == [2, 1, 3]
        with pytest.raises(IndexError, match=r"\[0, 4\)"):
            forward_batch(model, batch, logits_to_keep=[4])
        with pytest.raises(ValueError, match="logits_to_keep='first'"):
            forward_batch(model, batch, logits_to_keep="first")
        batch.cancel()
