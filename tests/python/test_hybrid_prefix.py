"""Prefix caching for hybrid models (issue 39): recurrent-state checkpoints beside the
blocks, token-granular hits that restore the state of exactly their length, rollbacks to
a checkpoint, and generate_batch on Qwen3-Next, Bamba and GraniteMoeHybrid hitting a
shared prefix whose length is not a multiple of the block size."""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

BS = 16


def toy_pool(**kw):
    """One attention layer and one state layer of a toy recurrence (see `run`)."""
    args = dict(
        block_size=BS,
        num_blocks=32,
        dtype="float32",
        state_layers=1,
        state_shapes={"h": (2,)},
        state_slots=4,
        seed=7,
    )
    return kvrs.BlockPool(1, 1, 2, **{**args, **kw})


def emb(t):
    return np.array([(t % 7) / 8 - 0.375, (t % 5) / 16 + 0.0625], np.float32)


def run(tokens, h=None):
    """The toy model: `h = h / 2 + emb(token)`; K = h, V = -h at every position."""
    h = np.zeros(2, np.float32) if h is None else h.copy()
    ks = []
    for t in tokens:
        h = h * np.float32(0.5) + emb(t)
        ks.append(h.copy())
    return h, np.array(ks, np.float32).reshape(-1, 1, 2)


def compute(seq, tokens, upto):
    """Runs `seq`'s tokens from its length to `upto` as a model does: state in place,
    K/V appended, committed with the token ids."""
    start = seq.seq_len
    state = seq.state(0)["h"]
    h, k = run(tokens[start:upto], state)
    state[...] = h
    seq.append(0, k, -k)
    seq.advance(upto - start, tokens=tokens[start:upto])


def test_a_shared_prefix_inside_a_block_is_hit_whole_with_its_state():
    shared = list(range(1, 38))  # 37 tokens: two blocks and 5 tokens of the third
    prompts = [shared + [100 + i] * 12 for i in range(3)]
    pool = toy_pool()
    first = pool.new_sequence(tokens=prompts[0])
    # Alone, its prefill would end a chunk at its last block boundary (48 of 49).
    assert first.checkpoint_due == 48 and first.seq_len == 0
    compute(first, prompts[0], 37)  # the prefill chunk ends where the prompts branch
    compute(first, prompts[0], len(prompts[0]))
    assert pool.match_prefix(prompts[1]) == 37
    second = pool.new_sequence(tokens=prompts[1])
    assert second.seq_len == second.num_cached_tokens == 37
    np.testing.assert_array_equal(second.state(0)["h"], run(prompts[1][:37])[0])
    compute(second, prompts[1], len(prompts[1]))
    h, k = run(prompts[1])
    np.testing.assert_array_equal(second.state(0)["h"], h)
    np.testing.assert_array_equal(second.get(0)[0][0], k[:, 0])
    st = pool.stats()
    assert st["checkpoint_hits"] == 1 and st["state_checkpoints_cached"] >= 1
    assert st["state_checkpoints"] == 8  # two per state slot by default
    pool.check_invariants()


def test_the_branch_point_is_checkpointed_for_the_next_request():
    # The first request's prefill ran in one chunk: the second computes up to where it
    # leaves the cached K/V (checkpoint_due), so the third hits that whole prefix.
    shared = list(range(1, 38))
    prompts = [shared + [100 + i] * 12 for i in range(3)]
    pool = toy_pool()
    a = pool.new_sequence(tokens=prompts[0])
    compute(a, prompts[0], len(prompts[0]))
    b = pool.new_sequence(tokens=prompts[1])
    assert b.seq_len == 0 and b.checkpoint_due == 37
    compute(b, prompts[1], b.checkpoint_due)
    assert b.checkpoint_due == 48 and 37 in b.checkpoints  # next: its last block boundary
    compute(b, prompts[1], len(prompts[1]))
    c = pool.new_sequence(tokens=prompts[2])
    assert c.seq_len == 37
    np.testing.assert_array_equal(c.state(0)["h"], run(prompts[2][:37])[0])


def test_rollbacks_restore_a_checkpoint_and_refuse_elsewhere():
    tokens = list(range(1, 21))
    pool = toy_pool()
    s = pool.new_sequence(tokens=tokens)
    compute(s, tokens, 20)
    assert s.checkpoint() and 20 in s.checkpoints
    more = tokens + [50, 51, 52]
    compute(s, more, 23)
    with pytest.raises(kvrs.NotSupportedError, match=r"state checkpoint .* not to 21"):
        s.truncate(21)
    assert s.seq_len == 23
    s.truncate(20)
    np.testing.assert_array_equal(s.state(0)["h"], run(tokens)[0])
    assert s.seq_len == 20
    s.truncate(0)
    assert not s.state(0)["h"].any()
    pool.check_invariants()


def test_checkpoints_are_counted_in_memory_and_refused_without_prefix_caching():
    pool = toy_pool(state_checkpoints=3)
    slot = 2 * 4
    st = pool.stats()
    assert st["state_bytes"] == (4 + 3) * slot and st["state_checkpoints"] == 3
    with pytest.raises(ValueError, match="prefix_caching=True"):
        toy_pool(prefix_caching=False, state_checkpoints=2)
    with pytest.raises(ValueError, match="block_size"):
        toy_pool(checkpoint_interval=BS + 1)
    with pytest.raises(ValueError, match="state_checkpoints"):
        toy_pool(state_checkpoints=0)


# --- hybrid models through generate_batch ---------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_next", "bamba", "granite_hybrid"])
def hybrid(request):
    import hybrid_models

    return getattr(hybrid_models, request.param)()


def test_generate_batch_hits_a_shared_prefix_token_by_token(hybrid):
    from transformers import DynamicCache

    from kvrs.integrations.layout import block_pool_from_config
    from kvrs.integrations.transformers import generate_batch

    cfg, model = hybrid
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, cfg.vocab_size, (37,), generator=gen).tolist()
    # Questions of 12 tokens: the block the shared prefix ends in fills during prefill.
    prompts = [shared + torch.randint(0, cfg.vocab_size, (12,), generator=gen).tolist() for _ in range(3)]
    pool = block_pool_from_config(model, num_blocks=24, block_size=BS, state_slots=3, prefix_caching=True)
    cached = {}

    def on_step(step, pool, states):
        for r in states:
            if r.admitted >= 0:
                cached[r.index] = r.cached

    try:
        outs = generate_batch(model, prompts, pool=pool, max_new_tokens=4, on_step=on_step)
    finally:
        model.set_attn_implementation("sdpa")
    assert cached == {0: 0, 1: 37, 2: 37}, cached
    for prompt, out in zip(prompts, outs, strict=True):
        ref = model.generate(
            torch.tensor([prompt]),
            past_key_values=DynamicCache(config=cfg),
            max_new_tokens=4,
            do_sample=False,
        )
        assert ref[0, len(prompt) :].tolist() == out
    assert pool.stats()["checkpoint_hits"] == 2


def _cached_per_request(model, prompts, pool, arrivals=None):
    """generate_batch's outputs and each request's cached prompt tokens."""
    from kvrs.integrations.transformers import generate_batch

    cached = {}

    def on_step(step, pool, states):
        for r in states:
            if r.admitted >= 0:
                cached[r.index] = r.cached

    outs = generate_batch(model, prompts, pool=pool, max_new_tokens=4, arrivals=arrivals, on_step=on_step)
    return outs, [cached[i] for i in range(len(prompts))]


def _greedy(cfg, model, prompt):
    from transformers import DynamicCache

    ref = model.generate(
        torch.tensor([prompt]), past_key_values=DynamicCache(config=cfg), max_new_tokens=4, do_sample=False
    )
    return ref[0, len(prompt) :].tolist()


def _chat_prompts(cfg, n, shared_len=37, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, cfg.vocab_size, (shared_len,), generator=gen).tolist()
    return [shared + torch.randint(0, cfg.vocab_size, (12,), generator=gen).tolist() for _ in range(n)]


def test_requests_one_at_a_time_hit_the_shared_prefix_at_an_interval_boundary(hybrid):
    """A chat service: each request arrives after the previous one finished. The first
    request's prefill checkpoints every checkpoint_interval tokens, so the second hits the
    last interval boundary inside the shared 37-token prefix (32) and recomputes less than
    one interval of it; the third hits all 37 (the second one's branch point)."""
    from kvrs.integrations.layout import block_pool_from_config

    cfg, model = hybrid
    prompts = _chat_prompts(cfg, 3)
    pool = block_pool_from_config(
        model, num_blocks=24, block_size=BS, state_slots=1, state_checkpoints=8, checkpoint_interval=BS
    )
    try:
        got = [_cached_per_request(model, [p], pool) for p in prompts]
    finally:
        model.set_attn_implementation("sdpa")
    assert [c for _, (c,) in got] == [0, 32, 37]
    for prompt, (out, _) in zip(prompts, got, strict=True):
        assert out == [_greedy(cfg, model, prompt)]


def test_requests_of_one_step_compute_a_shared_prefix_once(hybrid):
    """Seven requests arrive together, six sharing a 37-token prefix: the first computes it
    and every other one of the six waits and hits all of it."""
    from kvrs.integrations.layout import block_pool_from_config

    cfg, model = hybrid
    gen = torch.Generator().manual_seed(5)
    prompts = _chat_prompts(cfg, 6) + [torch.randint(0, cfg.vocab_size, (20,), generator=gen).tolist()]
    pool = block_pool_from_config(model, num_blocks=64, block_size=BS, state_slots=7)
    try:
        outs, cached = _cached_per_request(model, prompts, pool)
    finally:
        model.set_attn_implementation("sdpa")
    assert cached == [0, 37, 37, 37, 37, 37, 0], cached
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == _greedy(cfg, model, prompt)


def test_a_fresh_pool_hits_the_block_end_checkpoints_a_prefill_left_in_a_disk_tier(hybrid, tmp_path):
    """A pool served one request and left its blocks and block-end checkpoints on disk; a
    fresh pool (a restarted server) on the same directory hits the shared prefix's last
    interval boundary from disk and generates the same tokens."""
    import kvrs
    from kvrs.integrations.layout import block_pool_from_config

    cfg, model = hybrid
    prompts = _chat_prompts(cfg, 2)

    def pool():
        return block_pool_from_config(
            model,
            num_blocks=24,
            block_size=BS,
            state_slots=1,
            checkpoint_interval=BS,
            seed=7,
            tiers=[kvrs.DiskTier(tmp_path, "64MiB")],
        )

    try:
        first = pool()
        _cached_per_request(model, prompts[:1], first)
        first.evict_all()
        first.flush_tiers()
        outs, cached = _cached_per_request(model, prompts[1:], pool())
    finally:
        model.set_attn_implementation("sdpa")
    assert cached == [32]
    assert outs == [_greedy(cfg, model, prompts[1])]
