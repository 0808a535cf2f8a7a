"""Prompt lookup decoding in generate_batch (prompt_lookup_num_tokens=...): greedy
outputs equal those without drafts (Llama-like and Qwen3-Next models, prompts that
repeat text and prompts that do not), seeded sampling draws what plain sampling draws,
the n-gram matcher finds what transformers' PromptLookupCandidateGenerator finds, the
draft policy stops drafting where drafts do not pay, and bad arguments are refused."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvrs.integrations.draft_policy import DraftPolicy  # noqa: E402
from kvrs.integrations.prompt_lookup import NgramIndex, find_candidates  # noqa: E402
from kvrs.integrations.speculative import lookup_sample  # noqa: E402
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


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **LLAMA)).eval()


def repeating(seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (drafts get accepted) beside ones that do not."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(1, 128, 9).tolist()
    return [
        phrase * 3 + rng.integers(1, 128, 2).tolist(),
        rng.permutation(np.arange(1, 128))[:23].tolist(),  # no token twice
        rng.integers(1, 128, 5).tolist() + phrase * 2,
        rng.permutation(np.arange(1, 128))[:6].tolist(),
    ]


def run(model, ps, budgets, **kw):
    """generate_batch over an events pool; the outputs, the last step's request states,
    the hashes the prefix cache stored and the number of steps."""
    pool = block_pool_from_config(model, num_blocks=96, block_size=4, events=True, seed=1)
    seen: list = []
    out = generate_batch(
        model,
        ps,
        pool=pool,
        max_new_tokens=budgets,
        eos_token_id=[],
        on_step=lambda s, p, states: seen.append(states),
        **kw,
    )
    pool.check_invariants()
    assert pool.stats()["used_blocks"] == 0
    stored = {e["block_hash"] for e in pool.drain_events() if e["type"] == "stored"}
    return out, seen[-1], stored, len(seen)


@pytest.mark.parametrize("policy", ["schedule", "adaptive"])
def test_greedy_outputs_equal_those_without_drafts(model, policy):
    ps, budgets = repeating(0), [20, 12, 16, 1]
    plain, _, plain_blocks, plain_steps = run(model, ps, budgets)
    got, states, blocks, steps = run(
        model, ps, budgets, prompt_lookup_num_tokens=5, max_matching_ngram_size=3, draft_policy=policy
    )
    assert got == plain
    assert blocks == plain_blocks  # rejected drafts were never cached
    assert states[3].proposed == 0  # one new token: nothing to draft
    if policy == "schedule":
        accepted = sum(s.accepted for s in states)
        assert 0 < accepted < sum(s.proposed for s in states)
        assert steps < plain_steps


def test_vllm_options_combine_with_prompt_lookup_exactly(model):
    """Repetition and presence penalties, min_new_tokens and stop sequences see each draft
    row as if its earlier drafts were generated: the same tokens as without drafts."""
    ps, budgets = repeating(2), [16, 12, 16, 4]
    options = dict(repetition_penalty=1.3, presence_penalty=0.4, min_new_tokens=3, stop_sequences=[[7, 7]])
    plain, *_ = run(model, ps, budgets, **options)
    got, states, _, _ = run(
        model, ps, budgets, prompt_lookup_num_tokens=5, draft_policy="schedule", **options
    )
    assert got == plain
    assert sum(s.proposed for s in states) > 0


def test_drafts_come_from_the_request_own_tokens(model):
    """A prompt of one repeated phrase makes the greedy output copy it (on this model):
    with drafts verified every step most of them are accepted and the request needs far
    fewer steps; a prompt with no repeated token and no repetition in its output drafts
    nothing it does not find."""
    phrase = [17, 99, 5, 61, 23, 88, 42, 7]
    ps = [phrase * 4]
    plain, _, _, plain_steps = run(model, ps, [24])
    got, states, _, steps = run(model, ps, [24], prompt_lookup_num_tokens=8, draft_policy="schedule")
    assert got == plain
    assert states[0].accepted > 0
    assert steps < plain_steps


def test_sampling_draws_what_plain_sampling_draws(model):
    """Transformers' rule (keep a draft while the model's own draw equals it) draws one
    token per output token from each request's generator, in order: a seed gives the
    tokens sampling without drafts gives, whatever the draft lengths."""
    ps = repeating(1)
    kw = dict(max_new_tokens=16, eos_token_id=[], do_sample=True, temperature=0.7, top_k=20)
    plain = generate_batch(model, ps, seed=5, **kw)
    seen: list = []
    a = generate_batch(
        model,
        ps,
        seed=5,
        prompt_lookup_num_tokens=4,
        draft_policy="schedule",
        on_step=lambda s, p, states: seen.append(states),
        **kw,
    )
    assert a == plain
    assert sum(s.accepted for s in seen[-1]) > 0
    assert generate_batch(model, ps, seed=5, prompt_lookup_num_tokens=2, **kw) == plain
    assert generate_batch(model, ps, seed=6, prompt_lookup_num_tokens=4, **kw) != a


@pytest.mark.parametrize(("build", "seed"), [("qwen3_next", 2), ("bamba", 1)])
def test_a_hybrid_model_rolls_rejected_drafts_back(build, seed):
    """Qwen3-Next (gated delta-net layers) and Bamba (Mamba-2): a partial acceptance
    restores the recurrent state and replays the accepted tokens; the outputs are plain
    greedy's."""
    import hybrid_models

    _, hybrid = getattr(hybrid_models, build)()
    ps = repeating(seed)[:3]
    plain = generate_batch(hybrid, ps, max_new_tokens=14, eos_token_id=[])
    seen: list = []
    got = generate_batch(
        hybrid,
        ps,
        max_new_tokens=14,
        eos_token_id=[],
        prompt_lookup_num_tokens=4,
        draft_policy="schedule",
        on_step=lambda s, p, states: seen.append(states),
    )
    assert got == plain
    accepted, proposed = sum(s.accepted for s in seen[-1]), sum(s.proposed for s in seen[-1])
    assert 0 < accepted < proposed  # both kept and rolled-back drafts


def test_stop_tokens_inside_accepted_drafts_end_the_request(model):
    ps = repeating(3)
    free = generate_batch(model, ps, max_new_tokens=14, eos_token_id=[])
    stop = free[0][6]
    want = generate_batch(model, ps, max_new_tokens=14, eos_token_id=stop)
    got = generate_batch(
        model, ps, max_new_tokens=14, eos_token_id=stop, prompt_lookup_num_tokens=6, draft_policy="schedule"
    )
    assert got == want


# --- the n-gram matcher ------------------------------------------------------------------


def reference(tokens: list[int], k: int, n_max: int) -> list[int]:
    """The search written from its definition: the longest n <= n_max (and < the length)
    whose last-n tokens occur earlier; the first such occurrence's next k tokens."""
    for n in range(min(n_max, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tail]
        if starts:
            return tokens[starts[0] + n : starts[0] + n + k]
    return []


def transformers_candidates(tokens: list[int], k: int, n_max: int) -> list[int]:
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=n_max, max_length=10**6)
    ids = torch.tensor([tokens])
    out, _ = gen.get_candidates(ids)
    return out[0, len(tokens) :].tolist()


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    k=st.integers(1, 6),
    n_max=st.integers(1, 4),
    cut=st.integers(0, 40),
)
def test_the_matcher_finds_what_transformers_finds(tokens, k, n_max, cut):
    want = reference(tokens, k, n_max)
    assert find_candidates(tokens, k, n_max) == want
    assert transformers_candidates(tokens, k, n_max) == want
    # The index, built in two pieces, finds the same, and records the n-gram it used.
    index = NgramIndex(tokens[:cut], n_max)
    index.extend(tokens[cut:])
    assert index.lookup(k) == want
    assert (index.matched > 0) == bool(want)


def test_drafts_end_at_a_stop_token():
    tokens = [1, 2, 3, 9, 4, 5, 1, 2]
    assert find_candidates(tokens, 5) == [3, 9, 4, 5, 1]
    assert find_candidates(tokens, 5, stops=[9]) == [3, 9]
    index = NgramIndex(tokens)
    assert index.lookup(5, {9}) == [3, 9] and index.matched == 2
    assert index.lookup(0) == [] and NgramIndex([7]).lookup(3) == []


def test_lookup_sample_accepts_a_draft_with_its_probability():
    """A point-mass draft x is accepted with probability p(x); a rejection yields p with
    x removed, renormalised (chi-square, 0.999 quantiles)."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(0)
    n, accepted = 6000, 0
    rejected = np.zeros(4)
    for _ in range(n):
        out = lookup_sample(p, [1], gen)
        if out[0] == 1:
            accepted += 1
            assert len(out) == 2
        else:
            rejected[out[0]] += 1
            assert len(out) == 1
    assert abs(accepted / n - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)
    want = np.array([0.5, 0.0, 0.15, 0.05]) / 0.7
    expected = rejected.sum() * want
    mask = want > 0
    assert rejected[1] == 0
    assert (((rejected - expected) ** 2)[mask] / expected[mask]).sum() < 13.82  # 2 degrees of freedom
    with pytest.raises(ValueError, match="3 rows for 1 drafts"):
        lookup_sample(torch.ones(3, 4) / 4, [1])


# --- the draft policy ----------------------------------------------------------------------


def timed_policy(plain: float, per_row: float, probes: bool = False) -> DraftPolicy:
    """A policy that saw steps of 1 and of 6 rows costing `plain` + `per_row` * (rows - 1)."""
    policy = DraftPolicy("adaptive", probes=probes)
    for rows in (1, 6, 1, 6):
        policy.timed(rows, plain + per_row * (rows - 1), True, 0.0, 0)
    policy.begin(1)
    return policy


def test_the_policy_drafts_while_drafts_pay():
    # A row costs a tenth of a plain step: drafts pay down to acceptance 0.1.
    policy = timed_policy(0.1, 0.01)
    assert math.isclose(policy.threshold, 0.1, rel_tol=1e-6)
    for _ in range(6):
        policy.length(0, 8)
        policy.verified(0, 8, 8)  # everything accepted
    assert policy.length(0, 8) == 8
    rejected = timed_policy(0.1, 0.01)
    for _ in range(6):
        rejected.length(1, 8)
        rejected.verified(1, 8, 0)  # nothing accepted
    assert rejected.length(1, 8) == 0
    # Acceptance about 0.5: drafts j with 0.5**j >= 0.1, i.e. 3.
    half = timed_policy(0.1, 0.01)
    for _ in range(30):
        half.length(2, 2)
        half.verified(2, 2, 1)
    assert abs(half.rate(2) - 0.5) < 0.02
    assert half.length(2, 8) == 3
    # A new request starts from the acceptance of those before it.
    assert policy.rate(7) > 0.9 and rejected.rate(7) < 0.1
    # Rows as costly as the plain step itself: no draft pays, whatever the acceptance.
    costly = timed_policy(0.1, 0.1)
    costly.verified(0, 8, 8)
    assert costly.length(0, 8) == 0


def test_the_policy_watches_for_free_and_probes_a_draft_model():
    policy = timed_policy(0.1, 0.05)  # threshold 0.5
    for _ in range(5):
        policy.length(0, 4, kind=2)
        policy.verified(0, 4, 0)
    assert policy.length(0, 4, kind=2) == 0  # prompt lookup: only watched now
    for _ in range(10):
        assert policy.length(0, 4, kind=2) == 0 or policy.rate(0, 2) >= 0.5
        policy.watch(0, 7)
        policy.generated(0, 7)  # the watched draft would have been right, every step
    assert policy.length(0, 4, kind=2) > 0
    assert policy.rate(0, 1) < 0.5  # 1-gram matches keep their own rate
    # A draft model cannot watch: a request that stopped drafting probes one draft
    # after 1 step, then 2, 4, ... while the probes find nothing.
    model = timed_policy(0.1, 0.05, probes=True)
    picks = []
    for _ in range(40):
        k = model.length(0, 4)
        picks.append(k)
        if k:
            model.verified(0, k, 0)
    probes = [i for i, k in enumerate(picks) if k]
    assert [b - a for a, b in itertools.pairwise(probes)] == [2, 3, 5, 9, 17]
    # A new request of that workload waits as long before its first probe.
    assert [model.length(1, 4) for _ in range(33)].index(1) == 32
    # Until a decode step was timed, nobody drafts.
    fresh = DraftPolicy("adaptive")
    fresh.begin(4)
    assert fresh.length(0, 4) == 0
    assert DraftPolicy("schedule").length(0, 4) == 4


def test_bad_arguments_are_refused(model):
    ps = repeating(0)[:1]
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens and assistant_model"):
        generate_batch(model, ps, prompt_lookup_num_tokens=4, assistant_model=model)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=0"):
        generate_batch(model, ps, prompt_lookup_num_tokens=0)
    with pytest.raises(TypeError, match=r"prompt_lookup_num_tokens=2\.5"):
        generate_batch(model, ps, prompt_lookup_num_tokens=2.5)
    with pytest.raises(ValueError, match="max_matching_ngram_size=0"):
        generate_batch(model, ps, prompt_lookup_num_tokens=4, max_matching_ngram_size=0)
    with pytest.raises(TypeError, match="max_matching_ngram_size='2'"):
        generate_batch(model, ps, prompt_lookup_num_tokens=4, max_matching_ngram_size="2")
    with pytest.raises(ValueError, match="without prompt_lookup_num_tokens"):
        generate_batch(model, ps, max_matching_ngram_size=3)
    with pytest.raises(ValueError, match="draft_policy='fast'"):
        generate_batch(model, ps, prompt_lookup_num_tokens=4, draft_policy="fast")
