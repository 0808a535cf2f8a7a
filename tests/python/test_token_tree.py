"""Token trees in speculative generate_batch (``speculative_config={..., "tree_width": w}``):
several n-gram or suffix candidates merged into one tree, verified in one forward with a
tree mask and depth positions, the accepted path moved to the front with Sequence.accept.
Greedy outputs equal those without drafts (and the blocks cached are the same: a rejected
branch is never cached), seeded sampling draws what plain sampling draws, a hybrid model
falls back to chains; the tree, its mask and its walk against simple references."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_prompt_lookup import model, run  # noqa: E402, F401

import kvrs.integrations.speculative as speculative  # noqa: E402
from kvrs.integrations.prompt_lookup import NgramIndex  # noqa: E402
from kvrs.integrations.token_tree import DraftTree, tree_accept, tree_mask  # noqa: E402
from kvrs.integrations.transformers import generate_batch  # noqa: E402

candidates = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(candidates, st.integers(1, 30))
def test_merge_is_the_trie_of_the_candidates(cands, max_nodes):
    tree = DraftTree.merge(cands, max_nodes)
    # Reference: the distinct prefixes, in the order the candidates first reach them.
    order: list[tuple[int, ...]] = []
    for c in cands:
        for i in range(1, len(c) + 1):
            if tuple(c[:i]) not in order:
                if len(order) == max_nodes:
                    break
                order.append(tuple(c[:i]))
    assert len(tree) <= max_nodes
    assert [tuple(tree.path_tokens(j)) for j in range(len(tree))] == order[: len(tree)]
    assert all(p < j for j, p in enumerate(tree.parents))
    assert tree.depths() == [len(o) for o in order[: len(tree)]]
    assert tree.is_chain == all(tree.parents[j] == j - 1 for j in range(len(tree)))
    first = cands[0][: min(len(cands[0]), max_nodes)]
    assert tree.tokens[: len(first)] == first  # the first candidate is nodes 0..len-1
    assert tree.first == len(first)
    for c in cands:
        nodes = tree.follow(c)  # each candidate's path, as far as the node budget let it in
        assert nodes == (tree.path(nodes[-1]) if nodes else [])
        assert [tree.tokens[j] for j in nodes] == list(c[: len(nodes)])


@settings(max_examples=100, deadline=None)
@given(candidates, st.integers(0, 5), st.integers(1, 3))
def test_the_mask_shows_a_node_its_prefix_todo_and_ancestors(cands, prefix, todo):
    tree = DraftTree.merge(cands, 64)
    m = tree_mask(prefix, todo, tree)
    n = len(tree)
    assert m.shape == (todo + n, prefix + todo + n)
    for row in range(todo + n):
        for col in range(prefix + todo + n):
            if col < prefix:
                want = True
            elif col < prefix + todo:
                want = row >= todo or col - prefix <= row
            else:
                want = row >= todo and (col - prefix - todo) in tree.path(row - todo)
            assert m[row, col] == want, (row, col)


@settings(max_examples=100, deadline=None)
@given(candidates, st.lists(st.integers(0, 5), min_size=40, max_size=40))
def test_the_walk_follows_the_targets_tokens(cands, best):
    tree = DraftTree.merge(cands, 64)
    vocab = 6
    logits = torch.zeros((len(tree) + 1, vocab))
    for row in range(len(tree) + 1):
        logits[row, best[row]] = 1.0
    new, nodes = tree_accept(logits, tree, sampling=False)
    # Reference: from the root, follow the child holding the target's token.
    at, want_nodes = -1, []
    while True:
        t = best[at + 1]
        child = next((j for j in range(len(tree)) if tree.parents[j] == at and tree.tokens[j] == t), None)
        if child is None:
            break
        want_nodes.append(child)
        at = child
    assert nodes == want_nodes
    assert new == [tree.tokens[j] for j in nodes] + [best[(nodes[-1] if nodes else -1) + 1]]


def test_the_adaptive_policy_branches_only_while_branches_pay():
    """Off-candidate nodes keep their own acceptance rate: below the step's threshold a
    tree verifies its first candidate alone; the scored shadow trees bring it back."""
    from kvrs.integrations.draft_policy import DraftPolicy

    policy = DraftPolicy("adaptive")
    for rows in (1, 2, 4, 8) * 3:
        policy.timed(rows, 0.010 + 0.001 * rows, True, 0.0, 0)
    policy.begin(1)  # a row costs 0.001 s, a plain token 0.011 s: threshold about 0.09
    assert policy.tree_width(4) == 4  # the prior (0.3) pays
    for _ in range(10):
        policy.branched(6, 0)
    assert policy.tree_width(4) == 1
    for _ in range(10):
        policy.branched(3, 2)
    assert policy.tree_width(4) == 4
    assert DraftPolicy("schedule").tree_width(3) == 3


def test_candidates_are_the_first_match_then_other_occurrences():
    index = NgramIndex([1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 5, 1, 2], max_ngram=2)
    assert index.candidates(2, 1) == [[3, 9]]  # transformers' draft: the leftmost occurrence
    assert index.candidates(2, 3) == [[3, 9], [5, 1], [4, 8]]
    assert index.candidates(2, 9)[:3] == [[3, 9], [5, 1], [4, 8]]


def branching_prompts(seed: int) -> list[list[int]]:
    """Prompts where one phrase recurs with different continuations: the first occurrence
    (transformers' draft) is often the wrong one, another is right."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, 128, 3).tolist()
    tails = [rng.integers(1, 128, 4).tolist() for _ in range(3)]
    return [
        [tok for t in tails for tok in head + t] * 2 + head,
        head + tails[0] + head + tails[1] + rng.integers(1, 128, 3).tolist() + head,
        rng.permutation(np.arange(1, 128))[:12].tolist(),
    ]


@pytest.fixture
def spy(monkeypatch):
    """Counts verify forwards that held a branching tree, and accepted paths that left
    the first candidate (moved by Sequence.accept)."""
    seen = {"trees": 0, "moved": 0}
    layout, accept = speculative._tree_layout, speculative.tree_accept

    def counted_layout(*a, **k):
        seen["trees"] += 1
        return layout(*a, **k)

    def counted_accept(rows, tree, *a, **k):
        new, nodes = accept(rows, tree, *a, **k)
        seen["moved"] += nodes != list(range(len(nodes)))
        return new, nodes

    monkeypatch.setattr(speculative, "_tree_layout", counted_layout)
    monkeypatch.setattr(speculative, "tree_accept", counted_accept)
    return seen


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_outputs_equal_those_without_drafts(model, spy, method):  # noqa: F811
    ps, budgets = branching_prompts(0) + branching_prompts(1), [32, 24, 8, 32, 24, 8]
    plain, _, plain_blocks, _ = run(model, ps, budgets)
    config = {"method": method, "num_speculative_tokens": 4, "tree_width": 4}
    got, states, blocks, _ = run(model, ps, budgets, speculative_config=config, draft_policy="schedule")
    assert got == plain
    assert blocks == plain_blocks  # rejected branches were never cached
    assert spy["trees"] > 0 and sum(s.accepted for s in states) > 0
    if method == "ngram":
        assert spy["moved"] > 0  # some accepted paths were not the first candidate


def test_sampling_draws_what_plain_sampling_draws(model, spy):  # noqa: F811
    ps = branching_prompts(2)
    kw = dict(max_new_tokens=16, eos_token_id=[], do_sample=True, temperature=0.8, top_k=30)
    plain = generate_batch(model, ps, seed=11, **kw)
    config = {"method": "ngram", "num_speculative_tokens": 4, "tree_width": 4}
    assert (
        generate_batch(model, ps, seed=11, speculative_config=config, draft_policy="schedule", **kw) == plain
    )
    assert spy["trees"] > 0


def test_logprobs_come_from_the_rows_of_the_accepted_path(model, spy):  # noqa: F811
    """A path that leaves the first candidate takes its tokens from rows out of node
    order: each token's reported log-probabilities are still plain decoding's."""
    ps = branching_prompts(0)[:2]
    kw = dict(max_new_tokens=32, eos_token_id=[], logprobs=2, return_dict=True)
    plain = generate_batch(model, ps, **kw)
    config = {"method": "ngram", "num_speculative_tokens": 4, "tree_width": 4}
    tree = generate_batch(model, ps, speculative_config=config, draft_policy="schedule", **kw)
    assert spy["moved"] > 0
    for a, t in zip(plain, tree, strict=True):
        assert list(a.token_ids) == list(t.token_ids)
        for u, v in zip(a.logprobs, t.logprobs, strict=True):
            assert u.keys() == v.keys() and all(abs(u[k] - v[k]) < 1e-4 for k in u)


def test_a_hybrid_model_verifies_chains(spy):
    import hybrid_models

    _, hybrid = hybrid_models.qwen3_next()
    ps = branching_prompts(3)
    plain = generate_batch(hybrid, ps, max_new_tokens=12, eos_token_id=[])
    config = {"method": "ngram", "num_speculative_tokens": 4, "tree_width": 3}
    got = generate_batch(
        hybrid, ps, max_new_tokens=12, eos_token_id=[], speculative_config=config, draft_policy="schedule"
    )
    assert got == plain
    assert spy["trees"] == 0


@pytest.mark.parametrize(
    ("width", "error", "match"),
    [(0, ValueError, "tree_width.*>= 1"), (9, ValueError, "at most 8"), ("2", TypeError, "tree_width")],
)
def test_bad_widths_are_refused(model, width, error, match):  # noqa: F811
    with pytest.raises(error, match=match):
        generate_batch(
            model, [[1, 2, 3]], max_new_tokens=2, speculative_config={"method": "ngram", "tree_width": width}
        )
