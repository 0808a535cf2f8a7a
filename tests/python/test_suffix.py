"""Suffix drafts (speculative_config={"method": "suffix"}) and kvrs.SuffixIndex: the index
drafts what a brute-force scan over its retained sequences drafts, within its token
budget; generate_batch's greedy outputs equal those without drafts (Llama-like and hybrid
models), a seed gives plain sampling's tokens, later requests draft earlier requests'
outputs, a tenant never drafts from another's tokens, and bad input is refused with the
index unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import kvrs

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

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
SUFFIX = {"method": "suffix"}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **LLAMA)).eval()


def templated(seed: int, n: int = 4) -> list[list[int]]:
    """Requests sharing a template (a long common instruction) with a different input
    each: their outputs repeat across requests, not within one."""
    rng = np.random.default_rng(seed)
    template = rng.integers(1, 128, 12).tolist()
    return [template + rng.integers(1, 128, 3).tolist() for _ in range(n)]


def run(model, ps, budgets, pool=None, **kw):
    """generate_batch (one pool, given or new); the outputs, the last step's states, the
    number of steps and the pool."""
    pool = pool or block_pool_from_config(model, num_blocks=128, block_size=4, seed=1)
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
    return out, seen[-1], len(seen), pool


# --- the index ---------------------------------------------------------------------------


class Reference:
    """Retained sequences as plain lists, least recently written first."""

    def __init__(self, budget: int, depth: int):
        self.budget, self.depth = budget, depth
        self.seqs: list[tuple[int, str, list[int]]] = []

    def write(self, handle: int, ns: str, tokens: list[int]) -> None:
        pos = next((i for i, s in enumerate(self.seqs) if s[0] == handle), None)
        h, n, t = self.seqs.pop(pos) if pos is not None else (handle, ns, [])
        t = t + tokens[: self.budget - len(t)]
        self.seqs.append((h, n, t))
        while sum(len(s[2]) for s in self.seqs) > self.budget:
            self.seqs.pop(next(i for i, s in enumerate(self.seqs) if s[0] != handle))

    def count(self, ns: str, path: list[int]) -> int:
        k = len(path)
        if k > self.depth:
            return 0
        return sum(t[i : i + k] == path for _, n, t in self.seqs if n == ns for i in range(len(t) - k + 1))

    def draft(self, ns: str, ctx: list[int], k: int, prob_min: float) -> tuple[list[int], int]:
        best: tuple[list[int], int] = ([], 0)
        best_score = 0.0
        for p in range(1, min(len(ctx), self.depth - 1) + 1):
            path = ctx[-p:]
            if self.count(ns, path) == 0:
                break
            cap = min(p, k, self.depth - p)
            out, prob, score = [], 1.0, 0.0
            while len(out) < cap:
                counts = [(self.count(ns, path + [t]), -t) for t in range(4)]
                c, neg = max(counts)
                if c == 0:
                    break
                prob *= c / self.count(ns, path)
                if prob < prob_min:
                    break
                out.append(-neg)
                path = path + [-neg]
                score += prob
            if out and score >= best_score:
                best, best_score = (out, p), score
        return best


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(["a", "b"]), st.lists(st.integers(0, 3), max_size=10)),
        st.tuples(st.just("extend"), st.integers(0, 6), st.lists(st.integers(0, 3), max_size=5)),
        st.tuples(st.just("remove"), st.integers(0, 6), st.just([])),
        st.tuples(st.just("draft"), st.sampled_from(["a", "b"]), st.lists(st.integers(0, 3), max_size=6)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_the_index_drafts_what_a_scan_drafts(steps):
    index, ref = kvrs.SuffixIndex(max_tokens=30, max_depth=5), Reference(30, 5)
    handles: list[int] = []
    for op, arg, tokens in steps:
        if op == "add":
            h = index.add(tokens, namespace=arg)
            ref.write(h, arg, tokens)
            handles.append(h)
        elif op == "extend" and arg < len(handles):
            h = handles[arg]
            kept = next((s[1] for s in ref.seqs if s[0] == h), None)
            if kept is None:
                with pytest.raises(KeyError, match="handle"):
                    index.extend(h, tokens)
            else:
                index.extend(h, tokens)
                ref.write(h, kept, tokens)
        elif op == "remove" and arg < len(handles):
            h = handles[arg]
            assert index.remove(h) == any(s[0] == h for s in ref.seqs)
            ref.seqs = [s for s in ref.seqs if s[0] != h]
        elif op == "draft":
            got, _, matched = index.speculate(tokens, namespace=arg, max_tokens=3, min_token_prob=0.3)
            assert (got, matched) == ref.draft(arg, tokens, 3, 0.3)
        assert index.handles() == [s[0] for s in ref.seqs]
        assert [index.tokens(s[0]) for s in ref.seqs] == [s[2] for s in ref.seqs]
        stats = index.stats()
        assert stats["tokens"] == sum(len(s[2]) for s in ref.seqs) <= 30
        assert stats["nodes"] <= stats["tokens"] * 5 + 2


def test_bad_input_is_refused_and_leaves_the_index_unchanged():
    index = kvrs.SuffixIndex(max_tokens=100, max_depth=6)
    h = index.add([1, 2, 3, 4], namespace="t")
    before = (index.stats(), index.handles(), index.tokens(h))
    with pytest.raises(ValueError, match="max_tokens"):
        kvrs.SuffixIndex(max_tokens=0)
    with pytest.raises(ValueError, match="max_depth"):
        kvrs.SuffixIndex(max_depth=1)
    with pytest.raises(ValueError, match="tokens"):
        index.add([1, -2])
    with pytest.raises(ValueError, match="tokens"):
        index.extend(h, [2**40])
    with pytest.raises(KeyError, match="handle=99"):
        index.extend(99, [1])
    with pytest.raises(KeyError, match="handle"):
        index.tokens(-1)
    with pytest.raises(TypeError, match="namespace"):
        index.add([1], namespace=3)
    with pytest.raises(ValueError, match="min_token_prob"):
        index.speculate([1, 2], min_token_prob=2.0)
    with pytest.raises(ValueError, match="max_spec_factor"):
        index.speculate([1, 2], max_spec_factor=float("nan"))
    with pytest.raises(ValueError, match="max_tokens"):
        index.speculate([1, 2], max_tokens=-1)
    assert (index.stats(), index.handles(), index.tokens(h)) == before
    assert index.speculate([9, 2, 3], namespace="t", max_spec_offset=2) == ([4], [1.0], 2)
    assert index.speculate([9, 2, 3], namespace="u") == ([], [], 0)
    assert len(index) == 1 and h in index and "x" not in index
    assert "SuffixIndex(sequences=1" in repr(index)


def test_the_pool_counts_its_index():
    pool = kvrs.BlockPool(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4, block_size=4)
    assert pool.stats()["suffix_tokens"] == 0
    pool.suffix_index = kvrs.SuffixIndex(max_tokens=10, max_depth=4)
    for i in range(5):
        pool.suffix_index.add([i, i + 1, i + 2])
    s = pool.stats()
    assert s["suffix_max_tokens"] == 10 and s["suffix_tokens"] == 9 and s["suffix_evictions"] == 2
    assert s["suffix_sequences"] == 3 and s["suffix_bytes"] > 0


def test_threads_share_one_index():
    """Threads adding, extending and drafting at once (the GIL released while they wait
    for the index's lock): every operation lands, and the retained tokens add up."""
    import threading

    index = kvrs.SuffixIndex(max_tokens=10_000, max_depth=6)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(50):
                h = index.add(rng.integers(0, 5, 20).tolist(), namespace=str(seed % 2))
                index.extend(h, rng.integers(0, 5, 5).tolist())
                index.speculate(rng.integers(0, 5, 4).tolist(), namespace=str(seed % 2))
        except BaseException as e:  # reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = index.stats()
    assert s["sequences"] == 200 and s["tokens"] == 200 * 25 and s["lookups"] == 200
    assert sum(len(index.tokens(h)) for h in index.handles()) == s["tokens"]


# --- generate_batch ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["schedule", "adaptive"])
def test_greedy_outputs_equal_those_without_drafts(model, policy):
    ps, budgets = templated(0), [16, 16, 12, 1]
    plain, _, plain_steps, _ = run(model, ps, budgets)
    got, states, _, pool = run(model, ps, budgets, speculative_config=SUFFIX, draft_policy=policy)
    assert got == plain
    assert states[3].proposed == 0
    assert pool.stats()["suffix_lookups"] > 0
    # The same requests again, from the same pool: the earlier outputs are drafted.
    again, states, steps_again, _ = run(
        model, ps, budgets, pool=pool, speculative_config=SUFFIX, draft_policy="schedule"
    )
    assert again == plain
    assert sum(s.accepted for s in states) > 0
    assert steps_again < plain_steps


def test_later_requests_draft_what_earlier_ones_generated(model):
    """One request at a time (arrivals far apart): the second and later ones, whose
    prompts repeat the first's, accept drafts taken from its output."""
    ps = [templated(1, 1)[0]] * 3
    plain, *_ = run(model, ps, 20)
    got, states, _, pool = run(
        model, ps, 20, arrivals=[0, 40, 80], speculative_config=SUFFIX, draft_policy="schedule"
    )
    assert got == plain
    assert states[0].accepted < states[1].accepted
    assert states[1].accepted >= 15 and states[2].accepted >= 15
    assert pool.stats()["suffix_sequences"] == 3


def test_sampling_draws_what_plain_sampling_draws(model):
    ps = templated(2)
    kw = dict(max_new_tokens=16, eos_token_id=[], do_sample=True, temperature=0.7, top_k=20)
    plain = generate_batch(model, ps, seed=5, **kw)
    pool = block_pool_from_config(model, num_blocks=128, block_size=4)
    first = generate_batch(model, ps, pool=pool, seed=5, speculative_config=SUFFIX, **kw)
    seen: list = []
    again = generate_batch(
        model,
        ps,
        pool=pool,
        seed=5,
        speculative_config=SUFFIX,
        draft_policy="schedule",
        on_step=lambda s, p, states: seen.append(states),
        **kw,
    )
    assert first == again == plain
    assert sum(s.accepted for s in seen[-1]) > 0


@pytest.mark.parametrize(("build", "seed"), [("qwen3_next", 2), ("bamba", 1)])
def test_a_hybrid_model_rolls_rejected_drafts_back(build, seed):
    import hybrid_models

    _, hybrid = getattr(hybrid_models, build)()
    ps = templated(seed, 3)
    plain = generate_batch(hybrid, ps, max_new_tokens=14, eos_token_id=[])
    pool = block_pool_from_config(hybrid, num_blocks=128, block_size=4, state_slots=4)
    seen: list = []
    for _ in range(2):
        got = generate_batch(
            hybrid,
            ps,
            pool=pool,
            max_new_tokens=14,
            eos_token_id=[],
            speculative_config={"method": "suffix", "num_speculative_tokens": 6},
            draft_policy="schedule",
            on_step=lambda s, p, states: seen.append(states),
        )
        assert got == plain
    assert sum(s.accepted for s in seen[-1]) > 0


def test_a_tenant_never_drafts_from_another_tenant_tokens(model):
    """Tenant "a" runs first on a pool; tenant "b" then runs the same prompts there and
    drafts exactly what it drafts on a pool nobody used (its own tokens only), and hits
    none of "a"'s cached prefixes; "a" again drafts its earlier outputs."""
    ps, budgets = templated(3), 16
    plain, *_ = run(model, ps, budgets)
    kw = dict(speculative_config=SUFFIX, draft_policy="schedule")
    _, _, _, pool = run(model, ps, budgets, namespace="a", **kw)
    out_b, states_b, _, _ = run(model, ps, budgets, pool=pool, namespace="b", **kw)
    fresh_b, states_fresh, _, _ = run(model, ps, budgets, namespace="b", **kw)
    assert out_b == fresh_b == plain
    assert [s.proposed for s in states_b] == [s.proposed for s in states_fresh]
    assert [s.accepted for s in states_b] == [s.accepted for s in states_fresh]
    out_a, states_a, _, _ = run(model, ps, budgets, pool=pool, namespace=["a"] * 4, **kw)
    assert out_a == plain
    assert sum(s.accepted for s in states_a) > sum(s.accepted for s in states_b)
    assert all(s.cached > 0 for s in states_a)


def test_the_index_stays_within_its_budget(model):
    ps = templated(4, 6)
    plain, *_ = run(model, ps, 16)
    pool = block_pool_from_config(model, num_blocks=128, block_size=4)
    pool.suffix_index = kvrs.SuffixIndex(max_tokens=40, max_depth=8)
    got, *_ = run(model, ps, 16, pool=pool, speculative_config=SUFFIX)
    assert got == plain
    s = pool.stats()
    assert s["suffix_tokens"] <= 40 and s["suffix_evictions"] > 0
    assert s["suffix_nodes"] <= 40 * 8 + 1


def test_bad_arguments_are_refused(model):
    ps = [[1, 2, 3]]
    for config, err, match in [
        ({"method": "eagle"}, ValueError, "method"),
        ("suffix", TypeError, "speculative_config"),
        ({"method": "suffix", "max_cached_requests": 3}, ValueError, "unknown key"),
        ({"method": "suffix", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, ValueError, "min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": "x"}, TypeError, "max_tree_depth"),
        ({"method": "ngram", "prompt_lookup_min": 2}, ValueError, "prompt_lookup_min"),
    ]:
        with pytest.raises(err, match=match):
            generate_batch(model, ps, max_new_tokens=2, speculative_config=config)
    with pytest.raises(ValueError, match="one method"):
        generate_batch(model, ps, max_new_tokens=2, speculative_config=SUFFIX, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="namespace"):
        generate_batch(model, ps, max_new_tokens=2, namespace=["a", "b"])
    with pytest.raises(TypeError, match=r"namespace\[0\]"):
        generate_batch(model, ps, max_new_tokens=2, namespace=[3])


def test_the_ngram_method_is_prompt_lookup(model):
    ps = [[17, 99, 5, 61, 23, 88, 42, 7] * 4]
    want = generate_batch(model, ps, max_new_tokens=12, eos_token_id=[], prompt_lookup_num_tokens=3)
    got = generate_batch(
        model,
        ps,
        max_new_tokens=12,
        eos_token_id=[],
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    )
    assert got == want
