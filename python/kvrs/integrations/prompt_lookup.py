"""Prompt lookup (n-gram) drafts for [`generate_batch`][kvrs.integrations.transformers.generate_batch]:
``prompt_lookup_num_tokens=`` and ``max_matching_ngram_size=``, transformers' names and
semantics (``PromptLookupCandidateGenerator``).

A request's draft is what followed an earlier occurrence of its last n tokens in its own
prompt and output so far: n from `max_matching_ngram_size` down to 1, the leftmost
occurrence that has a token after it, at most `prompt_lookup_num_tokens` tokens of what
follows it. No draft model and no draft pool: the drafts go straight into the batched
verify forward of the draft-model path (`kvrs.integrations.speculative.verify`),
which keeps the accepted ones and rolls back the rest (a hybrid model's recurrent state
included).

`NgramIndex` keeps, per n-gram size, the first position of every n-gram of a
request's tokens, extended as tokens are generated: a lookup costs `max_matching_ngram_size`
dictionary reads, not a scan of the history. `find_candidates` is the same search
written out over a list (the reference the tests compare both with transformers' own).

Sampling follows transformers' rule for drafts without probabilities
(`kvrs.integrations.speculative.lookup_sample`): at each draft position a token is
drawn from the target's probabilities with the request's generator, and the draft is
kept while the draw equals it. That is speculative sampling with a point-mass draft
distribution (accept ``x`` with probability ``p(x)``, else a token from ``p`` with ``x``
removed, renormalised), and it draws exactly one token per output token, in order, as
plain sampling does: a seed gives the tokens it gives without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrs.integrations.draft_policy import DraftPolicy
from kvrs.integrations.speculative import Proposal, lookup_sample
from kvrs.integrations.token_tree import DraftTree

__all__ = [
    "NgramIndex",
    "PromptLookup",
    "check_prompt_lookup",
    "find_candidates",
    "lookup_sample",
    "plan_tree",
    "tree_proposal",
]

DEFAULT_NGRAM = 2
"""transformers' default n-gram size ("max_matching_ngram_size or 2" in generate())."""


def find_candidates(
    tokens: Sequence[int], num_tokens: int, max_ngram: int = DEFAULT_NGRAM, stops: Sequence[int] = ()
) -> list[int]:
    """The prompt-lookup draft after `tokens` (a request's prompt and output so far), as
    transformers' ``PromptLookupCandidateGenerator.get_candidates`` finds it: for n from
    ``min(max_ngram, len(tokens) - 1)`` down to 1, the leftmost earlier occurrence of the
    last n tokens with a token after it; the draft is up to `num_tokens` tokens after it
    (possibly running into the last n tokens themselves). Empty when no n-gram matches.
    A draft holding a stop token (one of `stops`) ends with it: nothing after a stop is
    ever used (transformers cuts *before* an EOS because its assisted loop could run past
    one; here an accepted stop ends the request as without drafts)."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        tail = list(tokens[n_tokens - n :])
        for start in range(n_tokens - n):
            if list(tokens[start : start + n]) == tail:
                return _cut(list(tokens[start + n : start + n + num_tokens]), stops)
    return []


def _cut(draft: list[int], stops: Sequence[int] | set[int]) -> list[int]:
    for i, t in enumerate(draft):
        if t in stops:
            return draft[: i + 1]
    return draft


class NgramIndex:
    """The first position of every n-gram (n = 1 to `max_ngram`) of a growing token
    list: `extend` adds tokens, `lookup` finds what `find_candidates`
    finds, in `max_ngram` dictionary reads. Memory: at most `max_ngram` entries a token."""

    def __init__(self, tokens: Sequence[int], max_ngram: int = DEFAULT_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_matching_ngram_size={max_ngram}: give an int >= 1")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}
        self.starts: dict[tuple[int, ...], list[int]] = {}
        """Every position of every n-gram (the candidates of a token tree)."""
        self.matched = 0
        """The n-gram size the last `lookup` matched (0: none)."""
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends `tokens`, indexing the n-grams that end at each."""
        seq, first, starts = self.tokens, self.first, self.starts
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            for n in range(1, min(self.max_ngram, end) + 1):
                gram = tuple(seq[end - n :])
                first.setdefault(gram, end - n)
                starts.setdefault(gram, []).append(end - n)

    def lookup(self, num_tokens: int, stops: set[int] | Sequence[int] = ()) -> list[int]:
        """Up to `num_tokens` draft tokens after the current tokens (see
        `find_candidates`); empty when no n-gram matches or `num_tokens` < 1."""
        seq = self.tokens
        end = len(seq)
        self.matched = 0
        if num_tokens < 1:
            return []
        for n in range(min(self.max_ngram, end - 1), 0, -1):
            start = self.first.get(tuple(seq[end - n :]))
            # The leftmost occurrence is the last n tokens themselves only when they
            # occur nowhere before: nothing follows it, and no other occurrence exists.
            if start is not None and start + n < end:
                self.matched = n
                return _cut(seq[start + n : start + n + num_tokens], stops)
        return []

    def candidates(
        self, num_tokens: int, width: int, stops: set[int] | Sequence[int] = ()
    ) -> list[list[int]]:
        """Up to `width` distinct drafts of up to `num_tokens` tokens: `lookup`'s first
        (transformers' draft), then what followed the other occurrences of the longest
        n-gram that matches, the most recent first, then of shorter ones (at most
        `_SCAN` occurrences read per n-gram size)."""
        first = self.lookup(num_tokens, stops)
        if not first or width <= 1:
            return [first] if first else []
        out, seen = [first], {tuple(first)}
        seq = self.tokens
        end = len(seq)
        for n in range(min(self.max_ngram, end - 1), 0, -1):
            for start in reversed(self.starts.get(tuple(seq[end - n :]), [])[-_SCAN:]):
                if start + n >= end:
                    continue
                cand = _cut(seq[start + n : start + n + num_tokens], stops)
                if tuple(cand) not in seen:
                    seen.add(tuple(cand))
                    out.append(cand)
                    if len(out) == width:
                        return out
        return out


_SCAN = 64
"""The most occurrences of one n-gram `NgramIndex.candidates` reads."""


def check_prompt_lookup(num_tokens: Any, max_ngram: Any, assistant_model: Any) -> int:
    """generate_batch's prompt-lookup arguments: the n-gram size to use (default 2)."""
    if num_tokens is None:
        if max_ngram is not None:
            raise ValueError(
                f"max_matching_ngram_size={max_ngram!r} was given without prompt_lookup_num_tokens: "
                "give prompt_lookup_num_tokens (drafts a step) to turn prompt lookup on"
            )
        return DEFAULT_NGRAM
    if assistant_model is not None:
        raise ValueError(
            "prompt_lookup_num_tokens and assistant_model were both given: drafts come either from "
            "the prompt (prompt lookup) or from a draft model; give one of them"
        )
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"prompt_lookup_num_tokens={num_tokens!r}: give an int >= 1 (drafts a step)")
    if num_tokens < 1:
        raise ValueError(
            f"prompt_lookup_num_tokens={num_tokens}: prompt lookup drafts at least 1 token a step "
            "(leave it None to decode without drafts)"
        )
    if max_ngram is None:
        return DEFAULT_NGRAM
    if isinstance(max_ngram, bool) or not isinstance(max_ngram, int):
        raise TypeError(f"max_matching_ngram_size={max_ngram!r}: give an int >= 1")
    if max_ngram < 1:
        raise ValueError(
            f"max_matching_ngram_size={max_ngram}: give an int >= 1 (the longest n-gram matched)"
        )
    return max_ngram


class PromptLookup:
    """The draft side of prompt-lookup [`generate_batch`][kvrs.integrations.transformers.generate_batch]: one
    `NgramIndex`
    per admitted request; the same interface as
    `kvrs.integrations.speculative.Speculation` (no draft pool: nothing to catch
    up, settle or free but the index)."""

    hybrid = False

    def __init__(
        self,
        num_tokens: int,
        max_ngram: int,
        stops: set[int],
        schedule: str,
        policy: DraftPolicy,
        tree_width: int = 1,
    ):
        self.k, self.max_ngram, self.stops, self.schedule = num_tokens, max_ngram, stops, schedule
        self.policy = policy
        self.tree_width = tree_width
        self.indexes: dict[int, NgramIndex] = {}
        self.seqs: dict[int, Any] = {}  # no draft sequences
        self.planned: dict[int, list[int]] = {}
        self.trees: dict[int, DraftTree] = {}
        self.shadows: dict[int, DraftTree] = {}

    def admit(self, index: int, prompt: list[int]) -> bool:
        self.indexes[index] = NgramIndex(prompt, self.max_ngram)
        return True

    def free(self, index: int) -> None:
        self.indexes.pop(index, None)
        self.policy.forget(index)

    def close(self) -> None:
        self.indexes.clear()

    def plan(self, items: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
        """The requests that draft this step and how many tokens each, from (request,
        most drafts) `items`: the n-gram match of each, cut to the policy's length. A
        request whose match the policy does not verify is watched instead (its first
        draft token compared with the token the step generates, which costs nothing)."""
        self.planned, self.trees, self.shadows = {}, {}, {}
        width = self.policy.tree_width(self.tree_width)
        out = []
        for r, cap in items:
            index = self.indexes[r.index]
            index.extend(r.generated[len(index) - len(r.prompt) :])
            matches = index.candidates(cap, self.tree_width, self.stops)
            if not matches:
                continue
            match = matches[0]
            k = min(self.policy.length(r.index, cap, index.matched), len(match))
            if k > 0:
                self.planned[r.index] = plan_tree(self.trees, self.shadows, r, matches, k, width)
                out.append((r, k))
            else:
                self.policy.watch(r.index, match[0])
        return out

    def propose(
        self,
        items: list[tuple[Any, int]],
        sampling: bool,
        temperature: float,
        top_k: int,
        top_p: float,
        process: Any = None,
    ) -> Proposal:
        """The drafts `plan` found for `items` (no forward pass; `process`, the
        per-request logits options, has nothing to process: the drafts are tokens, not
        distributions)."""
        return tree_proposal(items, self.planned, self.trees, self.shadows)

    def settle(self, proposal: Proposal, accepted: dict[int, int], tokens: dict[int, list[int]]) -> None:
        """Nothing to keep or drop: the index learns a request's tokens once generated."""


def plan_tree(
    trees: dict[int, DraftTree],
    shadows: dict[int, DraftTree],
    r: Any,
    candidates: list[list[int]],
    k: int,
    width: int,
) -> list[int]:
    """Request `r`'s drafts this step: its first candidate cut to `k` tokens, or, with
    several candidates and a `width` over 1, their token tree (each cut to `k`; at most
    as many nodes as the request has tokens left to generate, less one, so its drafts
    stay within the blocks it was admitted with), recorded in `trees` (in `shadows` when
    `width` is 1: scored, not verified). The draft tokens in node order."""
    if len(candidates) == 1:
        return candidates[0][:k]
    room = r.max_new_tokens - len(r.generated) - 1
    tree = DraftTree.merge([c[:k] for c in candidates], max_nodes=max(k, min(k * len(candidates), room)))
    if tree.is_chain:
        return tree.tokens
    if width <= 1:
        shadows[r.index] = tree
        return tree.tokens[: tree.first]
    trees[r.index] = tree
    return tree.tokens


def tree_proposal(
    items: list[tuple[Any, int]],
    planned: dict[int, list[int]],
    trees: dict[int, DraftTree],
    shadows: dict[int, DraftTree],
) -> Proposal:
    """The proposal of the requests of `items` from what a drafter without a draft model
    planned: their draft tokens and their trees (verified or only scored)."""
    indexes = [r.index for r, _ in items]
    return Proposal(
        {i: planned[i] for i in indexes},
        {},
        {},
        [],
        None,
        {i: trees[i] for i in indexes if i in trees},
        {i: shadows[i] for i in indexes if i in shadows},
    )
