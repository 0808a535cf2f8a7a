"""Speculative decoding in generate_batch (assistant_model=...): greedy outputs equal
those without a draft (Llama-like and Qwen3-Next pairs, drafts accepted always, partly
or never), rejected drafts leave nothing in either pool's prefix cache, seeded sampling
is reproducible, and the speculative sampler draws from the target's distribution."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvrs.integrations.speculative import greedy_accept, speculative_sample  # noqa: E402
from kvrs.integrations.transformers import block_pool_from_config, generate_batch  # noqa: E402

LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
)


def llama(layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **LLAMA)).eval()


def truncated(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """The target's first `layers` layers with its embeddings and head: a draft that
    agrees with it part of the time."""
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **LLAMA)).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


@pytest.fixture(scope="module")
def target():
    return llama(4, 3)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 128, 20).tolist()
    return [
        shared + rng.integers(1, 128, 7).tolist(),
        rng.integers(1, 128, 11).tolist(),
        shared + rng.integers(1, 128, 3).tolist(),
        rng.integers(1, 128, 5).tolist(),
    ]


def run(model, ps, budgets, **kw):
    """generate_batch with an events pool; returns outputs, the last step's request
    states and the hashes of the blocks the prefix cache stored."""
    pool = block_pool_from_config(model, num_blocks=64, block_size=4, events=True, seed=1)
    seen: list = []
    out = generate_batch(
        model,
        ps,
        pool=pool,
        max_new_tokens=budgets,
        eos_token_id=[],
        on_step=lambda s, p, st: seen.append(st),
        **kw,
    )
    pool.check_invariants()
    assert pool.stats()["used_blocks"] == 0
    stored = {e["block_hash"] for e in pool.drain_events() if e["type"] == "stored"}
    return out, seen[-1], stored


@pytest.mark.parametrize("draft_kind", ["same", "truncated", "random"])
def test_greedy_outputs_equal_those_without_a_draft(target, draft_kind):
    ps, budgets = prompts(), [12, 9, 1, 14]
    draft = {"same": target, "truncated": truncated(target, 1), "random": llama(1, 9)}[draft_kind]
    plain, _, plain_blocks = run(target, ps, budgets)
    dpool = block_pool_from_config(draft, num_blocks=64, block_size=4, events=True, seed=1)
    got, states, blocks = run(
        target,
        ps,
        budgets,
        assistant_model=draft,
        num_assistant_tokens=3,
        assistant_pool=dpool,
        draft_policy="schedule",  # every step drafts: the counts below are exact
    )
    assert got == plain
    # Only committed tokens were cached: the same blocks as without a draft.
    assert blocks == plain_blocks
    dpool.check_invariants()
    assert dpool.stats()["used_blocks"] == 0
    proposed = sum(s.proposed for s in states)
    accepted = sum(s.accepted for s in states)
    assert proposed > 0 and states[2].proposed == 0  # one new token: nothing to draft
    if draft_kind == "same":
        assert accepted == proposed
    elif draft_kind == "truncated":
        assert 0 < accepted < proposed
    # Every committed draft-pool block holds tokens of a request's own sequence too.
    assert {e["block_hash"] for e in dpool.drain_events() if e["type"] == "stored"} <= plain_blocks


def test_steps_shrink_with_acceptance(target):
    ps, budgets = prompts(1), [16, 16, 16, 16]
    steps = {}
    for name, draft in (("none", None), ("same", target)):
        seen: list[int] = []
        kw = (
            {}
            if draft is None
            else {"assistant_model": draft, "num_assistant_tokens": 4, "draft_policy": "schedule"}
        )
        generate_batch(
            target,
            ps,
            max_new_tokens=budgets,
            eos_token_id=[],
            on_step=lambda s, p, st, seen=seen: seen.append(s),
            **kw,
        )
        steps[name] = len(seen)
    # All four drafts accepted: five tokens a step after the prefill's one (16 tokens
    # in 1 + 3 steps instead of 16; the admission's wait for a shared prefix is the same).
    assert steps["none"] - steps["same"] == 16 - (1 + 3)


def test_the_heuristic_schedule_drafts_less_after_rejections(target):
    ps = prompts(1)
    plain = generate_batch(target, ps, max_new_tokens=10, eos_token_id=[])
    for draft, short in ((llama(1, 9), True), (target, False)):
        seen: list = []
        got = generate_batch(
            target,
            ps,
            max_new_tokens=10,
            eos_token_id=[],
            assistant_model=draft,
            num_assistant_tokens=4,
            num_assistant_tokens_schedule="heuristic",
            draft_policy="schedule",
            on_step=lambda s, p, st, seen=seen: seen.append([r.draft_len for r in st]),
        )
        assert got == plain
        # A draft always rejected drops to 1 token a step; one always accepted stays at 4.
        assert all(n == (1 if short else 4) for n in seen[-1])
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        generate_batch(target, ps, assistant_model=target, num_assistant_tokens_schedule="fast")


def test_stop_tokens_end_a_request_inside_accepted_drafts(target):
    ps = prompts(2)
    free = generate_batch(target, ps, max_new_tokens=12, eos_token_id=[])
    stop = free[0][5]
    want = generate_batch(target, ps, max_new_tokens=12, eos_token_id=stop)
    got = generate_batch(target, ps, max_new_tokens=12, eos_token_id=stop, assistant_model=target)
    assert got == want


def test_seeded_sampling_is_reproducible(target):
    ps = prompts(3)
    draft = truncated(target, 1)
    kw = dict(
        max_new_tokens=10, eos_token_id=[], do_sample=True, temperature=1.3, top_k=50, assistant_model=draft
    )
    a = generate_batch(target, ps, seed=7, **kw)
    assert generate_batch(target, ps, seed=7, **kw) == a
    assert generate_batch(target, ps, seed=8, **kw) != a
    assert generate_batch(target, ps[:2], seed=7, **kw) == a[:2]  # per request, not per batch
    assert all(len(out) == 10 and all(0 <= t < 128 for t in out) for out in a)
    # top_k=1: sampling is greedy, with or without a draft.
    greedy = generate_batch(target, ps, max_new_tokens=10, eos_token_id=[])
    assert generate_batch(target, ps, seed=1, **{**kw, "top_k": 1}) == greedy


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampler_draws_from_the_target_distribution():
    """Tiny vocabulary, a draft far from the target: the first token, and the second
    after an accepted first draft, follow the target's rows (chi-square, 3 degrees of
    freedom, 0.999 quantile 16.27); the draft's own distribution is rejected."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(0)
    n = 6000
    first = np.zeros(4)
    second = np.zeros(4)
    for _ in range(n):
        d = [int(torch.multinomial(q[0], 1, generator=gen)), int(torch.multinomial(q[1], 1, generator=gen))]
        out = speculative_sample(p, q, d, gen)
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == d[: len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square(first, p[0].numpy()) < 16.27
    assert chi_square(second, p[1].numpy()) < 16.27
    assert chi_square(first, q[0].numpy()) > 100  # the test can tell the draft's apart
    # The draft equal to the target: every draft accepted, a bonus token from the last row.
    assert len(speculative_sample(p[:3], p[:2], [0, 3], gen)) == 3


def test_greedy_accept_keeps_drafts_up_to_the_first_disagreement():
    logits = torch.eye(5)[[1, 2, 3, 4]] * 3  # argmax 1, 2, 3, 4
    assert greedy_accept(logits, [1, 2, 3]) == [1, 2, 3, 4]
    assert greedy_accept(logits, [1, 0, 3]) == [1, 2]
    assert greedy_accept(logits, [4, 2, 3]) == [1]


def test_bad_assistants_are_refused(target):
    ps = prompts()[:1]
    other = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **{**LLAMA, "vocab_size": 96})).eval()
    with pytest.raises(ValueError, match=r"vocab_size=96.*128"):
        generate_batch(target, ps, assistant_model=other)
    with pytest.raises(ValueError, match="num_assistant_tokens=0"):
        generate_batch(target, ps, assistant_model=target, num_assistant_tokens=0)
    with pytest.raises(ValueError, match="assistant_pool was given without assistant_model"):
        generate_batch(target, ps, assistant_pool=block_pool_from_config(target, num_blocks=8))
    small = block_pool_from_config(target, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="assistant_pool"):
        generate_batch(target, ps, max_new_tokens=4, assistant_model=target, assistant_pool=small)


# --- hybrid models: the recurrent state at the accepted depth -----------------------------


def test_qwen3_next_greedy_outputs_equal_those_without_a_draft():
    """A draft that agrees part of the time (a perturbed copy): partial acceptances roll
    the recurrent state back in both pools; without that rollback the outputs differ."""
    from hybrid_models import qwen3_next

    _, model = qwen3_next()
    draft = copy.deepcopy(model)
    torch.manual_seed(5)
    with torch.no_grad():
        for w in draft.model.layers[3].parameters():
            w.add_(torch.randn_like(w) * 0.02)
    ps = prompts(4)[:3]
    plain = generate_batch(model, ps, max_new_tokens=12, eos_token_id=[])
    seen: list = []
    got = generate_batch(
        model,
        ps,
        max_new_tokens=12,
        eos_token_id=[],
        assistant_model=draft,
        num_assistant_tokens=4,
        draft_policy="schedule",
        on_step=lambda s, p, st: seen.append(st),
    )
    assert got == plain
    accepted, proposed = sum(s.accepted for s in seen[-1]), sum(s.proposed for s in seen[-1])
    assert 0 < accepted < proposed


# --- transformers' assisted generation over kvrs caches -------------------------------------


def assisted(model, ids, **kw):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            **kw,
        )


def test_assisted_generation_over_kvrs_caches_equals_plain_greedy(target):
    from transformers import DynamicCache

    from kvrs.integrations.transformers import (
        KvrsCache,
        KvrsPagedCache,
        restore_attention,
        use_paged_attention,
    )

    ids = torch.tensor([prompts(5)[0]])
    ref = assisted(target, ids, past_key_values=DynamicCache(config=target.config))
    draft = truncated(target, 1)
    try:
        for switched in (False, True):
            if switched:
                use_paged_attention(target)
            for cache in (
                KvrsCache.from_config(target, 64),
                KvrsPagedCache.from_config(target, max_seq_len=64),
            ):
                assert torch.equal(assisted(target, ids, past_key_values=cache, assistant_model=draft), ref)
    finally:
        restore_attention(target)


@pytest.mark.parametrize("build", ["qwen3_next", "bamba"])
def test_assisted_generation_of_a_hybrid_model_rolls_its_state_back(build):
    """transformers refuses assisted generation of stateful models with its own caches;
    with a KvrsPagedCache (and the model switched), each crop restores the linear
    layers' states and replays the accepted tokens: the output is plain greedy's."""
    import hybrid_models

    from kvrs.integrations.transformers import (
        KvrsCache,
        KvrsPagedCache,
        restore_attention,
        use_paged_attention,
    )

    _, model = getattr(hybrid_models, build)()
    draft = copy.deepcopy(model)
    torch.manual_seed(5)
    with torch.no_grad():
        for w in draft.model.layers[3].parameters():
            w.add_(torch.randn_like(w) * 0.02)
    ids = torch.tensor([prompts(6)[1]])
    ref = assisted(model, ids)
    with pytest.raises(ValueError, match="stateful"):
        assisted(model, ids, assistant_model=draft)
    use_paged_attention(model)
    try:
        cache = KvrsPagedCache.from_config(model, max_seq_len=64)
        crops: list[int] = []
        crop = cache.crop
        cache.crop = lambda k: (crops.append(k), crop(k))[1]  # type: ignore[method-assign]
        assert torch.equal(assisted(model, ids, past_key_values=cache, assistant_model=draft), ref)
        assert any(k < 0 for k in crops)  # some drafts were rejected and rolled back
        assert cache.seq_len() == ids.shape[1] + 16 - 1
        cache.pool.check_invariants()
        # KvrsCache keeps the states in transformers' own layers, which cannot roll back:
        # transformers' refusal stands.
        with pytest.raises(ValueError, match="stateful"):
            assisted(model, ids, past_key_values=KvrsCache.from_config(model, 64), assistant_model=draft)
    finally:
        restore_attention(model)
    assert "generate" not in model.__dict__


def test_a_hybrid_crop_without_recording_is_refused_and_changes_nothing():
    from hybrid_models import qwen3_next

    from kvrs.integrations.transformers import KvrsPagedCache

    _, model = qwen3_next()
    cache = KvrsPagedCache.from_config(model, max_seq_len=32)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache)
    before = cache.state_view(0, "recurrent").clone()
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-2)
    assert cache.seq_len() == 5 and torch.equal(cache.state_view(0, "recurrent"), before)


def test_a_recording_hybrid_cache_commits_on_crop_and_copies_only_after_it():
    import copy as copying

    from hybrid_models import qwen3_next

    from kvrs.integrations.transformers import KvrsPagedCache, restore_attention, use_paged_attention

    _, model = qwen3_next()
    use_paged_attention(model)
    try:
        cache = KvrsPagedCache.from_config(model, max_seq_len=32, max_batch_size=2)  # room for a copy
        cache.activate_past_recording()
        ref = KvrsPagedCache.from_config(model, max_seq_len=32)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
        with torch.no_grad():
            model(ids, past_key_values=cache)
            with pytest.raises(ValueError, match="crop first"):
                copying.deepcopy(cache)
            cache.crop(-3)  # keeps 4 tokens: their K/V and the state after them
            assert cache.seq_len() == 4 and cache.rows[0].seq_len == 4
            model(ids[:, :4], past_key_values=ref)
            assert torch.allclose(cache.state_view(0, "recurrent"), ref.state_view(0, "recurrent"), atol=1e-5)
            assert torch.equal(cache.state_view(0, "conv"), ref.state_view(0, "conv"))
            want = model(ids[:, 4:5], past_key_values=ref).logits
            got = model(ids[:, 4:5], past_key_values=cache).logits
            assert torch.allclose(got, want, atol=1e-5)
            cache.crop(0)
            assert cache.rows[0].seq_len == 5
            copying.deepcopy(cache)
        cache.pool.check_invariants()
    finally:
        restore_attention(model)
