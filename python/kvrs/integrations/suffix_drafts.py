"""Suffix drafts for [`generate_batch`][kvrs.integrations.transformers.generate_batch]:
``speculative_config={"method": "suffix"}``, vLLM's method (SuffixDecoding, Oliaro et al.,
through Arctic Inference) over the pool's own [`SuffixIndex`][kvrs.SuffixIndex].

Every admitted request's prompt goes into the pool's suffix index as a sequence of its
namespace, and its output follows as it is generated (only verified tokens: a rejected
draft never reaches the index). At each decode step a request drafts what followed its
last tokens in any retained sequence of its namespace, its own included: the most
frequent continuation, as long as the match's confidence allows (``floor(match *
suffix_decoding_max_spec_factor)`` tokens, each kept while its path probability is at
least ``suffix_decoding_min_token_prob``), then cut to what the never-slower
[`DraftPolicy`][kvrs.integrations.draft_policy.DraftPolicy] finds worth verifying. A
finished request's tokens stay in the index, so later requests (in this call, or in later
calls given the same `pool`) draft from them: repeated tool calls, templated answers,
agent loops. The index is bounded in tokens (least recently written sequences evicted,
``pool.stats()["suffix_*"]``), and a namespace never drafts from another's tokens.

Verification and sampling are prompt lookup's (`kvrs.integrations.speculative.verify`,
`lookup_sample`): greedy outputs equal those without drafts, and a seed gives the tokens
it gives without drafts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kvrs
from kvrs.integrations.draft_policy import DraftPolicy
from kvrs.integrations.prompt_lookup import plan_tree, tree_proposal
from kvrs.integrations.speculative import Proposal
from kvrs.integrations.token_tree import DraftTree

__all__ = ["MAX_TREE_WIDTH", "SuffixConfig", "SuffixDrafts", "check_speculative_config"]

_KINDS = 8
"""Match lengths the draft policy keeps apart (longer ones share the last rate)."""


class SuffixConfig:
    """The suffix method's settings, vLLM's names and defaults."""

    def __init__(
        self,
        num_speculative_tokens: int = 16,
        max_tree_depth: int = 24,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        tree_width: int = 1,
    ):
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.tree_width = tree_width


_SUFFIX_KEYS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "suffix_decoding_max_tree_depth": "max_tree_depth",
    "suffix_decoding_max_spec_factor": "max_spec_factor",
    "suffix_decoding_max_spec_offset": "max_spec_offset",
    "suffix_decoding_min_token_prob": "min_token_prob",
    "tree_width": "tree_width",
}
_NGRAM_KEYS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "tree_width")
MAX_TREE_WIDTH = 8
"""The most candidates a token tree merges (each adds up to num_speculative_tokens rows)."""


def _width(config: Mapping[str, Any]) -> int:
    width = _int("tree_width", config.get("tree_width", 1), 1)
    if width > MAX_TREE_WIDTH:
        raise ValueError(
            f"speculative_config['tree_width']={width}: at most {MAX_TREE_WIDTH} candidates a step "
            "(each adds up to num_speculative_tokens rows to the verify forward)"
        )
    return width


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config[{name!r}]={value!r}: give an int >= {low}")
    if value < low:
        raise ValueError(f"speculative_config[{name!r}]={value}: must be >= {low}")
    return value


def _float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"speculative_config[{name!r}]={value!r}: give a number in [{low}, {high}]")
    if not low <= float(value) <= high:
        raise ValueError(f"speculative_config[{name!r}]={value}: must be in [{low}, {high}]")
    return float(value)


def check_speculative_config(
    config: Any,
) -> tuple[str, SuffixConfig | tuple[int, int | None, int]] | None:
    """generate_batch's `speculative_config` (vLLM's dict): None, ``("suffix",
    SuffixConfig)``, or ``("ngram", (prompt_lookup_num_tokens, max_matching_ngram_size,
    tree_width))``."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise TypeError(
            f"speculative_config={config!r}: give a dict such as {{'method': 'suffix'}} (vLLM's form)"
        )
    method = config.get("method")
    if method == "suffix":
        unknown = sorted(set(config) - set(_SUFFIX_KEYS) - {"method"})
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown} for method 'suffix'; known: "
                f"{sorted(_SUFFIX_KEYS)}"
            )
        c = SuffixConfig()
        if "num_speculative_tokens" in config:
            c.num_speculative_tokens = _int("num_speculative_tokens", config["num_speculative_tokens"], 1)
        if "suffix_decoding_max_tree_depth" in config:
            c.max_tree_depth = _int(
                "suffix_decoding_max_tree_depth", config["suffix_decoding_max_tree_depth"], 2
            )
        if "suffix_decoding_max_spec_factor" in config:
            c.max_spec_factor = _float(
                "suffix_decoding_max_spec_factor", config["suffix_decoding_max_spec_factor"], 0.0, 1e6
            )
        if "suffix_decoding_max_spec_offset" in config:
            c.max_spec_offset = _float(
                "suffix_decoding_max_spec_offset", config["suffix_decoding_max_spec_offset"], -1e6, 1e6
            )
        if "suffix_decoding_min_token_prob" in config:
            c.min_token_prob = _float(
                "suffix_decoding_min_token_prob", config["suffix_decoding_min_token_prob"], 0.0, 1.0
            )
        c.tree_width = _width(config)
        return "suffix", c
    if method == "ngram":
        unknown = sorted(set(config) - set(_NGRAM_KEYS) - {"method"})
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown} for method 'ngram'; "
                f"known: {sorted(_NGRAM_KEYS)}"
            )
        low = config.get("prompt_lookup_min")
        if low is not None and _int("prompt_lookup_min", low, 1) != 1:
            raise ValueError(
                f"speculative_config['prompt_lookup_min']={low}: kvrs's prompt lookup matches n-grams "
                "down to 1 token (transformers'); leave it unset or 1"
            )
        k = _int("num_speculative_tokens", config.get("num_speculative_tokens", 4), 1)
        high = config.get("prompt_lookup_max")
        return "ngram", (k, None if high is None else _int("prompt_lookup_max", high, 1), _width(config))
    raise ValueError(
        f"speculative_config['method']={method!r}: give 'suffix' (drafts from the pool's suffix index) "
        "or 'ngram' (prompt lookup); a draft model goes in assistant_model="
    )


class SuffixDrafts:
    """The draft side of suffix-method
    [`generate_batch`][kvrs.integrations.transformers.generate_batch]: one sequence of the
    pool's suffix index per admitted request (in its namespace), extended with its output
    as it is generated; the interface of `kvrs.integrations.prompt_lookup.PromptLookup`."""

    hybrid = False

    def __init__(
        self,
        index: kvrs.SuffixIndex,
        config: SuffixConfig,
        namespaces: list[str | bytes | None],
        stops: set[int],
        schedule: str,
        policy: DraftPolicy,
    ):
        self.index, self.config, self.namespaces = index, config, namespaces
        self.k, self.stops, self.schedule, self.policy = (
            config.num_speculative_tokens,
            stops,
            schedule,
            policy,
        )
        self.depth = min(config.max_tree_depth, index.max_depth)
        self.handles: dict[int, int] = {}
        self.indexed: dict[int, int] = {}  # tokens of each request's output in the index
        self.requests: dict[int, Any] = {}  # the requests that decoded, by index
        self.seqs: dict[int, Any] = {}  # no draft sequences
        self.planned: dict[int, list[int]] = {}
        self.trees: dict[int, DraftTree] = {}
        self.shadows: dict[int, DraftTree] = {}
        self.tree_width = config.tree_width

    def admit(self, index: int, prompt: list[int]) -> bool:
        self.handles[index] = self.index.add(prompt, namespace=self.namespaces[index])
        self.indexed[index] = 0
        return True

    def _sync(self, r: Any) -> None:
        """Puts request `r`'s output generated since the last step into the index (again
        as a whole when the budget evicted it meanwhile)."""
        new = r.generated[self.indexed[r.index] :]
        if not new:
            return
        try:
            self.index.extend(self.handles[r.index], new)
        except KeyError:
            self.handles[r.index] = self.index.add(r.prompt + r.generated, namespace=self.namespaces[r.index])
        self.indexed[r.index] = len(r.generated)

    def free(self, index: int) -> None:
        """Request `index` finished: its tokens stay in the index for later requests."""
        r = self.requests.pop(index, None)
        if r is not None and index in self.handles:
            self._sync(r)
        self.handles.pop(index, None)
        self.indexed.pop(index, None)
        self.policy.forget(index)

    def close(self) -> None:
        self.requests.clear()
        self.handles.clear()
        self.indexed.clear()

    def plan(self, items: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
        """The requests that draft this step and how many tokens each (see
        `kvrs.integrations.prompt_lookup.PromptLookup.plan`): each one's suffix draft,
        cut at a stop token and to the policy's length."""
        self.planned, self.trees, self.shadows = {}, {}, {}
        width = self.policy.tree_width(self.tree_width)
        out = []
        for r, cap in items:
            self.requests[r.index] = r
            self._sync(r)
            context = (r.prompt + r.generated)[-(self.depth - 1) :]
            candidates, matched = self._candidates(r.index, context, cap)
            if not candidates:
                continue
            tokens = candidates[0]
            k = min(self.policy.length(r.index, cap, min(matched, _KINDS)), len(tokens))
            if k > 0:
                self.planned[r.index] = plan_tree(self.trees, self.shadows, r, candidates, k, width)
                out.append((r, k))
            else:
                self.policy.watch(r.index, tokens[0])
        return out

    def _candidates(self, index: int, context: list[int], cap: int) -> tuple[list[list[int]], int]:
        """Up to `tree_width` distinct drafts after `context` (each cut after a stop
        token) and the first one's match length: the index's draft for the longest match,
        then for ever shorter ones (each shorter context can follow other occurrences)."""
        c = self.config
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        first = 0
        while context and len(out) < self.tree_width:
            tokens, _, matched = self.index.speculate(
                context,
                namespace=self.namespaces[index],
                max_tokens=cap,
                max_spec_factor=c.max_spec_factor,
                max_spec_offset=c.max_spec_offset,
                min_token_prob=c.min_token_prob,
            )
            for i, t in enumerate(tokens):
                if t in self.stops:
                    tokens = tokens[: i + 1]
                    break
            if not tokens or matched <= 0:
                break
            if not out:
                first = matched
            if tuple(tokens) not in seen:
                seen.add(tuple(tokens))
                out.append(list(tokens))
            context = context[len(context) - matched + 1 :] if matched > 1 else []
        return out, first

    def propose(
        self,
        items: list[tuple[Any, int]],
        sampling: bool,
        temperature: float,
        top_k: int,
        top_p: float,
        process: Any = None,
    ) -> Proposal:
        """The drafts `plan` found for `items` (tokens, no distributions)."""
        return tree_proposal(items, self.planned, self.trees, self.shadows)

    def settle(self, proposal: Proposal, accepted: dict[int, int], tokens: dict[int, list[int]]) -> None:
        """Nothing to undo: the index learns a request's tokens once generated."""
