"""Continuous batching of a transformers model over a [`BlockPool`][kvrs.BlockPool]:
[`generate_batch`][kvrs.integrations.transformers.generate_batch].

Every step is one [`ForwardBatch`][kvrs.ForwardBatch] holding the uncached prompt of each newly
admitted request beside the last generated token of every running request, run in one
forward pass by [`forward_batch`][kvrs.integrations.transformers.forward_batch], which computes
logits only for the rows to sample. Admission is prefix-aware: a request is admitted
when the pool can grow every admitted request to its end (so nothing is ever preempted),
and a request whose first block another request admitted in the same step computes waits
one step, then attaches that block from the prefix cache instead of computing it again.
A finished request frees its sequence; its blocks stay cached for the requests after it.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import kvrs
from kvrs._log import TierWatch
from kvrs.integrations._torch import torch
from kvrs.integrations.draft_policy import POLICIES, DraftPolicy
from kvrs.integrations.layout import (
    _attention_layout,
    _is_hybrid,
    _pool_layout,
    block_pool_from_config,
    check_pool,
)
from kvrs.integrations.paged_attention import _switched, forward_batch
from kvrs.integrations.prompt_lookup import PromptLookup, check_prompt_lookup
from kvrs.integrations.results import GenerationResult, prompt_lists
from kvrs.integrations.sampling import Sampler, SamplingParams, plan, token_id_list
from kvrs.integrations.speculative import Proposal, Speculation, check_assistant, choose, verify
from kvrs.integrations.suffix_drafts import SuffixConfig, SuffixDrafts, check_speculative_config

__all__ = ["GenerationResult", "RequestState", "SamplingParams", "generate_batch"]

_DEFAULT_MAX_NEW_TOKENS = 20
"""New tokens per request when neither the call nor the generation config says."""


@dataclass
class RequestState:
    """One input of [`generate_batch`][kvrs.integrations.transformers.generate_batch] while it runs (what
    ``on_step`` sees)."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    generated: list[int] = field(default_factory=list)
    cached: int = 0
    """Prompt tokens the pool's prefix cache served (not computed)."""
    admitted: int = -1
    """The step it was admitted at (-1: waiting), and the step it finished at."""
    finished: int = -1
    stopped: bool = False
    """Whether it ended on a stop token (else on max_new_tokens)."""
    generator: Any = None
    """The generator its sampled tokens are drawn with (None when greedy)."""
    proposed: int = 0
    """Draft tokens proposed for it (by the assistant, or by prompt lookup), and how
    many of them the target accepted (speculative decoding; 0 without drafts)."""
    accepted: int = 0
    draft_len: int = 0
    """The most drafts it asks for at its next step (num_assistant_tokens or
    prompt_lookup_num_tokens, or less where the "heuristic" schedule lowered it after
    rejections); the "adaptive" draft_policy may draft fewer, or none."""
    namespace: str | bytes | None = None
    """Its tenant: the prefix cache and the suffix index it shares are its namespace's."""

    @property
    def done(self) -> bool:
        """Whether it generated its last token."""
        return self.stopped or len(self.generated) >= self.max_new_tokens


def _token_ids(inputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """`inputs` as lists of int token ids; anything else (text, floats) is a TypeError
    naming the input and what to pass."""
    if isinstance(inputs, (str, bytes)):
        raise TypeError(
            "inputs is a string: generate_batch takes token ids, one list per prompt; tokenize first "
            "(tokenizer(texts).input_ids, or tokenizer.apply_chat_template(..., tokenize=True))"
        )
    prompts = []
    for i, p in enumerate(inputs):
        if isinstance(p, (str, bytes)):
            raise TypeError(
                f"inputs[{i}] is a {type(p).__name__} ({p[:20]!r}): generate_batch takes token ids, one list "
                "per prompt; tokenize first (tokenizer(texts).input_ids)"
            )
        ids = []
        for j, t in enumerate(p):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise TypeError(
                    f"inputs[{i}][{j}] is {t!r}: token ids are ints (tokenize text first: "
                    "tokenizer(texts).input_ids)"
                )
            ids.append(int(t))
        prompts.append(ids)
    return prompts


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens two prompts share at their beginning."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _branch_points(prompts: list[list[int]]) -> list[list[int]]:
    """For each prompt, the lengths of the prefixes it shares with the others (where it
    branches off them), ascending: a hybrid model's prefill chunks end there, so that
    the state there is checkpointed and every later request sharing it hits it whole.

    The prefixes a prompt shares with the others are the running minima of the common
    beginnings of neighbours in sorted order, walking away from it on either side."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    adj = [_common(prompts[a], prompts[b]) for a, b in itertools.pairwise(order)]
    points: list[list[int]] = [[] for _ in prompts]
    for rank, i in enumerate(order):
        found = set()
        for side in (reversed(adj[:rank]), adj[rank:]):
            low = None
            for c in side:
                low = c if low is None else min(low, c)
                if low == 0:
                    break
                found.add(low)
        points[i] = sorted(p for p in found if 0 < p < len(prompts[i]))
    return points


def _per_request(value: int | Sequence[int], n: int, name: str) -> list[int]:
    values = [value] * n if isinstance(value, int) else [int(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} inputs (give one, or one per input)")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} must be >= 0")
    return values


def _stop_ids(eos: Any) -> set[int]:
    return set(token_id_list(eos, "eos_token_id"))


def _check_models(model: Any, assistant_model: Any) -> None:
    """A loaded causal LM (with its LM head) for `model`, and a loaded model or None for
    `assistant_model`: else a TypeError naming the argument and what to pass."""
    for name, m in (("model", model), ("assistant_model", assistant_model)):
        if m is None and name == "assistant_model":
            continue
        if isinstance(m, (str, bytes)) or hasattr(m, "__fspath__"):
            raise TypeError(
                f"{name}={m!r} is a name: generate_batch takes a loaded model; load it first, e.g. "
                f"{name} = AutoModelForCausalLM.from_pretrained({str(m)!r})"
            )
        if not hasattr(m, "config") or not callable(m):
            raise TypeError(
                f"{name} is a {type(m).__name__}: give a loaded transformers causal LM "
                "(AutoModelForCausalLM.from_pretrained(...))"
            )
        head = getattr(m, "get_output_embeddings", None)
        if callable(head) and head() is None:
            cls = type(m).__name__
            lm = cls[: -len("Model")] + "ForCausalLM" if cls.endswith("Model") else "...ForCausalLM"
            raise TypeError(
                f"{name} is a {cls}, a base model without a language-modeling head (it gives hidden states, "
                f"not logits): load the {lm} class instead (or AutoModelForCausalLM)"
            )


@overload
def generate_batch(
    model: Any, inputs: Any, *, return_dict: Literal[False] = False, **options: Any
) -> list[list[int]]: ...


@overload
def generate_batch(
    model: Any, inputs: Any, *, return_dict: Literal[True], **options: Any
) -> list[GenerationResult]: ...


# The overloads give callers the return type return_dict selects; they spell the other
# options as **options, which mypy cannot match with the implementation's keywords.
def generate_batch(  # type: ignore[misc]
    model: Any,
    inputs: Sequence[Sequence[int]] | Any,
    *,
    attention_mask: Any = None,
    pool: kvrs.BlockPool | None = None,
    generation_config: Any = None,
    max_new_tokens: int | Sequence[int] | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_new_tokens: int | None = None,
    stop_sequences: Sequence[Sequence[int]] | None = None,
    logprobs: int | None = None,
    sampling_params: SamplingParams
    | dict[str, Any]
    | Sequence[SamplingParams | dict[str, Any]]
    | None = None,
    return_dict: bool = False,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    progress_bar: bool = False,
    block_size: int = 16,
    arrivals: Sequence[int] | None = None,
    on_step: Callable[[int, kvrs.BlockPool, list[RequestState]], None] | None = None,
    assistant_model: Any = None,
    num_assistant_tokens: int | None = None,
    assistant_pool: kvrs.BlockPool | None = None,
    num_assistant_tokens_schedule: str | None = None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    draft_policy: str | None = None,
    speculative_config: dict[str, Any] | None = None,
    namespace: str | bytes | Sequence[str | bytes | None] | None = None,
) -> list[list[int]] | list[GenerationResult]:
    """Generates tokens for every prompt of `inputs` with continuous batching over a
    BlockPool; returns each input's generated ids, in input order (a stop token, when
    one ended the request, included, as ``model.generate`` does; a matched stop
    sequence left out), or with ``return_dict=True`` one
    [`GenerationResult`][kvrs.integrations.transformers.GenerationResult] per
    input (token ids, finish reason "stop" or "length", stop reason, cached prompt
    tokens, logprobs).

    `inputs`: lists of token ids (one per prompt, unpadded), or a padded batch: a
    tokenizer's ``BatchEncoding`` (``tokenizer(texts, padding=True,
    return_tensors="pt")``) or a 2-D tensor or array with its `attention_mask`; each
    row's padding (left or right) is removed. A 2-D tensor without a mask is a
    ValueError.

    Settings not given come from `generation_config`, else ``model.generation_config``
    (``max_new_tokens``: an int, or one per input; default 20; ``eos_token_id``: the stop
    tokens). Greedy unless ``do_sample``; sampling applies ``temperature``, ``top_k`` and
    ``top_p`` as transformers does, each request drawing from its own ``torch.Generator``
    seeded from `seed` and its index (the same inputs and seed give the same tokens,
    whatever else shares the batch or the pool has cached). Greedy outputs equal
    ``model.generate`` with ``DynamicCache`` in float32.

    vLLM's options, applied to each step's batched logits (transformers' processors'
    formulas and order): `repetition_penalty` (over prompt and output), `presence_penalty`
    and `frequency_penalty` (over the output, vLLM's), `min_p` (sampling),
    `min_new_tokens` (stop tokens masked until then, stop sequences not matched),
    `stop_sequences` (token-id lists ending a request when its output ends with one;
    the match is left out of the output and reported as its stop reason), `logprobs`
    (the top-n raw log-probabilities of each generated token: ``return_dict=True``).
    `sampling_params`: per-request options instead of those keywords, a
    [`SamplingParams`][kvrs.integrations.transformers.SamplingParams] (vLLM's names and defaults:
    ``temperature=0`` is greedy) or a
    dict of its fields, one for every input or one per input. All of them work with
    `assistant_model`, exactly: each verified row sees the drafts before it.

    Arguments that are ignored (``temperature`` without ``do_sample``, the
    ``num_assistant_tokens*`` settings without an assistant, ``seed`` when greedy) warn;
    tier failures of the pools are logged to the ``kvrs`` logger.

    `pool`: where the K/V live (prefix caching on, so shared prompt prefixes are computed
    once); by default one built from the model (its layers, dtype and device) with room
    for every request at once, each table of the model's layer kinds sized by
    [`blocks_per_sequence`][kvrs.blocks_per_sequence]; a given pool must match the model (ValueError
    otherwise). `arrivals` (the step each input arrives at; default all at step 0) and
    `on_step` (called after every step with the step, the pool and every request's
    state) let a caller replay a server's workload and trace it. `progress_bar` shows
    vLLM's line (tqdm): requests done, and prompt ("input") and generated ("output")
    tokens per second, refreshed as steps run.

    `assistant_model` turns on speculative decoding (see the manual's "Speculative
    decoding" page): at every decode step the assistant (a draft model sharing the
    model's vocabulary) proposes `num_assistant_tokens` tokens per running request over
    its own pool (`assistant_pool`, by default one built from it as `pool` is), the
    model verifies them in the same forward pass as the other requests' tokens, and
    each request keeps the accepted ones and one more token of the model's: greedy
    outputs are those without an assistant, sampled ones follow the model's
    distribution (speculative sampling). Rejected drafts are rolled back in both pools
    before anything else sees them: they are never committed, cached or checkpointed,
    and a hybrid model's recurrent state is the one after the accepted tokens.
    ``RequestState.proposed`` and ``accepted`` count the drafts per request.
    `num_assistant_tokens_schedule` is transformers' setting: "constant", or
    "heuristic" (each request drafts 2 more after a step whose drafts were all accepted,
    1 fewer after a rejection; between 1 and `num_assistant_tokens`, or
    `prompt_lookup_num_tokens`); it sets the cap `draft_policy` drafts under.

    `prompt_lookup_num_tokens` turns on prompt lookup decoding instead, transformers'
    setting (no draft model, no draft pool): each decode request's draft is up to that
    many tokens that followed an earlier occurrence of its last n tokens in its own
    prompt and output (n from `max_matching_ngram_size`, default 2, down to 1; the
    leftmost occurrence), verified as a draft model's are; a request whose tokens match
    nothing decodes as without drafts that step. Sampling keeps a draft while the
    model's own draw equals it (transformers' rule), so a seed gives the tokens it gives
    without drafts. Giving it with `assistant_model` is a ValueError.

    `speculative_config`: vLLM's form. ``{"method": "suffix"}`` drafts from the pool's
    [`SuffixIndex`][kvrs.SuffixIndex] (SuffixDecoding): every request's prompt and
    output go in as they are admitted and generated, and each decode request drafts
    what followed its last tokens in any of them (its own, the other running requests',
    the finished ones', and those of earlier calls given the same `pool`), the most
    frequent continuation, as long as the match's confidence allows; vLLM's keys
    ``num_speculative_tokens`` (default 16, the cap), ``suffix_decoding_max_tree_depth``
    (24), ``suffix_decoding_max_spec_factor`` (1.0), ``suffix_decoding_min_token_prob``
    (0.1) and ``suffix_decoding_max_spec_offset`` (0.0). ``{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": n}`` is prompt lookup. Verified,
    sampled and gated as prompt lookup is.

    `namespace`: the tenant (str or bytes; one for all inputs or one per input): its
    requests hit only their namespace's cached prefixes and draft only from their
    namespace's suffix sequences.

    `draft_policy`: "adaptive" drafts at most what the schedule says, fewer or none
    where the drafts' expected accepted tokens do not pay for the time they cost
    (measured per step), so drafting that cannot help costs about nothing; "schedule"
    drafts what the schedule says every step. Default "adaptive", except "schedule" when
    sampling with an `assistant_model` and a `seed` (speculative sampling's draws depend
    on the draft lengths, which "adaptive" takes from timings: only "schedule" keeps a
    seed's tokens reproducible there).

    The model's attention is kvrs's while the call runs
    ([`use_paged_attention`][kvrs.integrations.transformers.use_paged_attention])
    and what it was on return, also after an exception: a model the caller switched
    stays switched.

    Args:
        model: A transformers causal LM (its attention runs on kvrs's while the call runs).
        inputs: Token-id lists, one per prompt, or a padded batch (``BatchEncoding``, 2-D
            tensor or array) with its `attention_mask`.
        attention_mask: The padded batch's mask, when `inputs` is a tensor or array.
        pool: The [`BlockPool`][kvrs.BlockPool] holding the K/V; default: one built from
            the model.
        generation_config: Where settings not given come from; default
            ``model.generation_config``.
        max_new_tokens: Tokens to generate, one int or one per input; default 20.
        do_sample: Sample instead of greedy decoding.
        temperature: Sampling temperature.
        top_k: Sample from the `top_k` most likely tokens.
        top_p: Nucleus sampling threshold.
        min_p: vLLM's minimum probability, relative to the most likely token.
        repetition_penalty: Penalty on tokens of the prompt and output.
        presence_penalty: vLLM's penalty on tokens present in the output.
        frequency_penalty: vLLM's penalty per occurrence in the output.
        min_new_tokens: Stop tokens masked until this many tokens are generated.
        stop_sequences: Token-id lists that end a request (left out of its output).
        logprobs: Top-n log-probabilities of each generated token (with `return_dict`).
        sampling_params: Per-request options: a
            [`SamplingParams`][kvrs.integrations.transformers.SamplingParams]
            or dict, one for all inputs or one per input.
        return_dict: Return [`GenerationResult`][kvrs.integrations.transformers.GenerationResult]s
            instead of token-id lists.
        eos_token_id: Stop token(s); default the generation config's.
        seed: Seeds each request's own generator (reproducible sampling).
        progress_bar: Show vLLM's progress line (tqdm).
        block_size: Tokens per block of the default pool.
        arrivals: The step each input arrives at (default all at step 0).
        on_step: Called after every step with the step, the pool and every request's state.
        assistant_model: A draft model for speculative decoding.
        num_assistant_tokens: Drafted tokens per step (the cap of the schedule).
        assistant_pool: The draft model's pool; default: one built from it.
        num_assistant_tokens_schedule: "constant" or "heuristic".
        prompt_lookup_num_tokens: Prompt lookup decoding: at most this many drafted tokens.
        max_matching_ngram_size: Prompt lookup's longest n-gram (default 2).
        draft_policy: "adaptive" or "schedule".
        speculative_config: vLLM's ``{"method": "suffix"}`` or ``{"method": "ngram", ...}``.
        namespace: Tenant of the requests (one, or one per input).

    Returns:
        Each input's generated token ids, or its
        [`GenerationResult`][kvrs.integrations.transformers.GenerationResult]
            with `return_dict=True`, in input order.
    """
    _check_models(model, assistant_model)
    gc = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    prompts = _token_ids(prompt_lists(inputs, attention_mask))
    n = len(prompts)
    if n == 0:
        return []
    vocab = model.config.get_text_config().vocab_size
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"inputs[{i}] is empty: every prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"inputs[{i}]: token ids must lie in [0, {vocab}) (the model's vocab_size)")
    budget = max_new_tokens if max_new_tokens is not None else getattr(gc, "max_new_tokens", None)
    budgets = _per_request(_DEFAULT_MAX_NEW_TOKENS if budget is None else budget, n, "max_new_tokens")
    steps_in = _per_request(list(arrivals) if arrivals is not None else 0, n, "arrivals")
    stops = _stop_ids(eos_token_id if eos_token_id is not None else getattr(gc, "eos_token_id", None))
    given = {
        "do_sample": do_sample,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "min_new_tokens": min_new_tokens,
        "stop_sequences": stop_sequences,
        "logprobs": logprobs,
    }
    options = plan(n, vocab, gc, stops, budgets, given, sampling_params)
    budgets = options.budgets
    scalar = options.scalar
    sampler = None if scalar is not None else Sampler(options.options, vocab)
    sampling, temp, k, p_top = (
        scalar if scalar is not None else (sampler is not None and sampler.sampling, 1.0, 0, 1.0)
    )
    if scalar is not None:
        stops = set(options.options[0].stop_ids)
    if seed is not None and not sampling:
        warnings.warn(
            f"seed={seed} is ignored: it seeds sampling, and generate_batch decodes greedily here; pass "
            "do_sample=True to sample (or a temperature > 0 in sampling_params), or unset seed",
            UserWarning,
            stacklevel=2,
        )
    if assistant_model is None:
        for name, value in (
            ("num_assistant_tokens", num_assistant_tokens),
            ("num_assistant_tokens_schedule", num_assistant_tokens_schedule),
        ):
            if value is not None:
                warnings.warn(
                    f"{name}={value!r} is ignored: it is a setting of speculative decoding, which needs a "
                    "draft model; pass assistant_model=<a loaded draft model of the same vocabulary>, "
                    f"or unset {name}",
                    UserWarning,
                    stacklevel=2,
                )
    num_assistant_tokens = 4 if num_assistant_tokens is None else num_assistant_tokens
    num_assistant_tokens_schedule = num_assistant_tokens_schedule or "constant"
    if assistant_model is not None:
        check_assistant(model, assistant_model, num_assistant_tokens)
    method = check_speculative_config(speculative_config)
    suffix: SuffixConfig | None = None
    tree_width = 1
    if method is not None:
        if prompt_lookup_num_tokens is not None or assistant_model is not None:
            raise ValueError(
                "speculative_config was given with prompt_lookup_num_tokens or assistant_model: drafts "
                "come from one method; give one of them"
            )
        if isinstance(method[1], SuffixConfig):
            suffix = method[1]
            tree_width = suffix.tree_width
        else:
            prompt_lookup_num_tokens, max_matching_ngram_size, tree_width = method[1]
    ngram = check_prompt_lookup(prompt_lookup_num_tokens, max_matching_ngram_size, assistant_model)
    namespaces = _namespaces(namespace, n)
    if draft_policy is None:
        keep_seed = sampling and seed is not None and assistant_model is not None
        draft_policy = "schedule" if keep_seed else "adaptive"
    if draft_policy not in POLICIES:
        raise ValueError(f"draft_policy={draft_policy!r}: give 'adaptive' or 'schedule'")
    if num_assistant_tokens_schedule not in ("constant", "heuristic"):
        raise ValueError(
            f"num_assistant_tokens_schedule={num_assistant_tokens_schedule!r}: give 'constant' or 'heuristic'"
        )
    if assistant_model is None and assistant_pool is not None:
        raise ValueError("assistant_pool was given without assistant_model: give both, or neither")
    lookahead = num_assistant_tokens if assistant_model is not None else (prompt_lookup_num_tokens or 0)
    if suffix is not None:
        lookahead = suffix.num_speculative_tokens
    if pool is None:
        # Each request's peak, its prompt computed in one step: every table of the
        # model's layer kinds (a sliding table holds its window, not the whole request).
        layout = _attention_layout(model.config)
        need = sum(
            kvrs.blocks_per_sequence(
                len(p) + b, block_size=block_size, max_chunk=max(len(p), lookahead + 1), **layout
            )
            for p, b in zip(prompts, budgets, strict=True)
        )
        # A hybrid model's sequences each hold a state slot: one per request.
        slots = {"state_slots": n} if _is_hybrid(model.config) else {}
        pool = block_pool_from_config(model, num_blocks=need, block_size=block_size, **slots)
        if suffix is not None and suffix.max_tree_depth != pool.suffix_index.max_depth:
            pool.suffix_index = kvrs.SuffixIndex(max_depth=suffix.max_tree_depth)
    else:
        check_pool(pool, model)
    spec: Speculation | PromptLookup | SuffixDrafts | None = None
    if tree_width > 1 and not _trees_verify(model, pool):
        tree_width = 1  # the best candidate alone: a chain (see _trees_verify)
    if suffix is not None:
        suffix.tree_width = tree_width
        spec = SuffixDrafts(
            pool.suffix_index,
            suffix,
            namespaces,
            stops,
            num_assistant_tokens_schedule,
            DraftPolicy(draft_policy),
        )
    if prompt_lookup_num_tokens is not None:
        spec = PromptLookup(
            prompt_lookup_num_tokens,
            ngram,
            stops,
            num_assistant_tokens_schedule,
            DraftPolicy(draft_policy),
            tree_width=tree_width,
        )
    if assistant_model is not None:
        if assistant_pool is None:
            layout = _attention_layout(assistant_model.config)
            need = sum(
                kvrs.blocks_per_sequence(len(p) + b, block_size=block_size, max_chunk=len(p) + 1, **layout)
                for p, b in zip(prompts, budgets, strict=True)
            )
            slots = {"state_slots": n} if _is_hybrid(assistant_model.config) else {}
            assistant_pool = block_pool_from_config(
                assistant_model, num_blocks=need, block_size=block_size, **slots
            )
        else:
            check_pool(assistant_pool, assistant_model)
        draft_peaks = {
            i: _peak(assistant_pool, len(p), b, len(p) + 1)
            for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))
        }
        for i, peak in draft_peaks.items():
            if peak > assistant_pool.num_blocks:
                raise ValueError(
                    f"inputs[{i}]: its draft needs {peak} blocks of {assistant_pool.block_size}, more than "
                    f"the assistant_pool's {assistant_pool.num_blocks}: give a larger assistant_pool"
                )
        spec = Speculation(
            assistant_model,
            assistant_pool,
            num_assistant_tokens,
            draft_peaks,
            num_assistant_tokens_schedule,
            DraftPolicy(draft_policy, probes=True),
        )
    states = [
        RequestState(i, p, b, a, namespace=ns)
        for i, (p, b, a, ns) in enumerate(zip(prompts, budgets, steps_in, namespaces, strict=True))
    ]
    peaks = {
        r.index: _peak(pool, len(r.prompt), r.max_new_tokens, max(len(r.prompt), lookahead + 1))
        for r in states
    }
    for r in states:
        if peaks[r.index] > pool.num_blocks:
            raise ValueError(
                f"inputs[{r.index}]: {len(r.prompt)} prompt + {r.max_new_tokens} new tokens need "
                f"{peaks[r.index]} blocks of {pool.block_size}, more than the pool's {pool.num_blocks}: "
                "give generate_batch a larger pool (num_blocks=), or fewer max_new_tokens"
            )
    for r in states:
        if sampling:
            # One generator per request, from (seed, its index): its draws do not depend on
            # the batches it shares with others (or on what the pool had cached).
            r.generator = torch.Generator(device=model.device)
            own = options.options[r.index].seed
            if own is not None:
                r.generator.manual_seed(own)
            elif seed is None:
                r.generator.seed()
            else:
                r.generator.manual_seed(hash((seed, r.index)) & (2**63 - 1))
    progress = _Progress(n) if progress_bar else None
    watches = [TierWatch(p) for p in (pool, assistant_pool) if p is not None]
    try:
        drafter = _switched(assistant_model) if assistant_model is not None else nullcontext()
        with _switched(model), drafter:
            _run(
                model, pool, states, peaks, stops, sampling, temp, k, p_top, progress, on_step, spec, sampler,
                watches,
            )  # fmt: skip
    finally:
        if progress is not None:
            progress.close()
        for w in watches:
            w.check(force=True)
    return _outputs(states, sampler, return_dict)


def _outputs(
    states: list[RequestState], sampler: Sampler | None, return_dict: bool
) -> list[list[int]] | list[GenerationResult]:
    """Each request's generated ids (a matched stop sequence left out), or its
    GenerationResult."""
    trim = sampler.trim if sampler is not None else {}
    ids = [r.generated[: len(r.generated) - trim.get(r.index, 0)] for r in states]
    if not return_dict:
        return ids
    out = []
    for r, tokens in zip(states, ids, strict=True):
        reason: int | list[int] | None = None
        if r.stopped:
            reason = sampler.stop_reason.get(r.index) if sampler is not None else r.generated[-1]
        lps = sampler.logprobs.get(r.index) if sampler is not None else None
        if lps is not None:
            lps = lps[: len(tokens)]
        out.append(
            GenerationResult(
                index=r.index,
                prompt_token_ids=r.prompt,
                token_ids=tokens,
                finish_reason="stop" if r.stopped else "length",
                stop_reason=reason,
                num_cached_tokens=r.cached,
                logprobs=lps,
                cumulative_logprob=None
                if lps is None
                else sum(d[t] for d, t in zip(lps, tokens, strict=True)),
            )
        )
    return out


def _trees_verify(model: Any, pool: kvrs.BlockPool) -> bool:
    """Whether token trees verify exactly on `model`: every attention layer full (a
    window or chunk is measured in slots, and a node's slot is past its depth), no state
    layers (a recurrent layer runs the nodes as one chain), no latent attention, and a
    host pool (a CUDA pool's kernels take no custom mask)."""
    text = model.config.get_text_config()
    full = all(t == "full" for t in pool.layer_types)
    host = pool.device == "cpu"
    return full and host and not pool.state_layers and getattr(text, "kv_lora_rank", None) is None


def _peak(pool: kvrs.BlockPool, prompt: int, new: int, chunk: int) -> int:
    """The most blocks a request of `prompt` + `new` tokens holds in `pool`, computing
    at most `chunk` tokens in one step."""
    return kvrs.blocks_per_sequence(
        prompt + new, block_size=pool.block_size, max_chunk=chunk, **_pool_layout(pool)
    )


class _Progress:
    """generate_batch's progress bar, vLLM's line: requests finished, and prompt
    ("input") and generated ("output") tokens per second, refreshed as steps run (at most
    10 times a second), so a long batch shows its speed before its first request ends."""

    def __init__(self, n: int):
        from tqdm.auto import tqdm  # type: ignore[import-untyped]

        self.bar = tqdm(total=n, desc="Processed prompts", unit="req", dynamic_ncols=True, smoothing=0)
        self.start = self.shown = time.perf_counter()
        self.prompt_tokens = self.generated = 0

    def step(self, admitted: int, generated: int, finished: int) -> None:
        """After a step: the prompt tokens of the requests it admitted, the tokens it
        generated and the requests it finished."""
        self.prompt_tokens += admitted
        self.generated += generated
        now = time.perf_counter()
        if finished:
            self.bar.update(finished)
        if finished or now - self.shown >= 0.1:
            self.shown = now
            elapsed = max(now - self.start, 1e-9)
            self.bar.set_postfix_str(
                f"est. speed input: {self.prompt_tokens / elapsed:,.2f} toks/s, "
                f"output: {self.generated / elapsed:,.2f} toks/s"
            )

    def close(self) -> None:
        self.bar.close()


def _run(
    model: Any,
    pool: kvrs.BlockPool,
    states: list[RequestState],
    peaks: dict[int, int],
    stops: set[int],
    sampling: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    progress: _Progress | None,
    on_step: Any,
    spec: Speculation | PromptLookup | SuffixDrafts | None,
    sampler: Sampler | None = None,
    watches: Sequence[TierWatch] = (),
) -> None:
    """The scheduler: admits, runs one forward pass per step, samples, finishes.
    `sampler` (per-request options) processes the logits the model and the draft give,
    and decides when a request stops; without it every request samples with the scalar
    settings and stops on `stops`."""
    bs = pool.block_size
    waiting = sorted((r for r in states if r.max_new_tokens > 0), key=lambda r: r.arrival)
    running: list[tuple[RequestState, kvrs.Sequence]] = []
    # A hybrid model's pool restores a recurrent state only at a checkpoint: prefill
    # chunks end where prompts branch off each other (and where the pool asks), so the
    # state there is checkpointed once and hit by every later request sharing it.
    hybrid = bool(pool.state_layers) and pool.stats().get("state_checkpoints", 0) > 0

    branches = _branch_points([r.prompt for r in states]) if hybrid else [[] for _ in states]

    def growth(rs: list[tuple[RequestState, kvrs.Sequence]]) -> int:
        return sum(peaks[r.index] - s.num_blocks for r, s in rs)

    step = 0
    try:
        while waiting or running:
            if not running:
                step = max(step, waiting[0].arrival)
            computing: set[tuple[int, ...]] = set()
            admitted = 0
            while waiting and waiting[0].arrival <= step:
                r = waiting[0]
                head = tuple(r.prompt[:bs])
                if head in computing and pool.match_prefix(r.prompt, namespace=r.namespace) < bs:
                    break  # next step it attaches the block the other request computes now
                if hybrid:
                    # Another request still prefilling a prefix it shares checkpoints the
                    # state there: it waits to hit all of it instead of computing it again.
                    hit = pool.match_prefix(r.prompt, namespace=r.namespace)
                    busy = (q.prompt for q, s in running if s.seq_len < len(q.prompt))
                    if any(_common(r.prompt, q) > hit for q in busy):
                        break
                try:
                    seq = pool.new_sequence(tokens=r.prompt, namespace=r.namespace)
                except kvrs.CacheFullError:
                    break
                if pool.free_blocks < growth([*running, (r, seq)]):
                    seq.free()
                    break
                if spec is not None and not spec.admit(r.index, r.prompt):
                    seq.free()
                    break
                waiting.pop(0)
                computing.add(head)
                r.cached, r.admitted = seq.num_cached_tokens, step
                r.draft_len = spec.k if spec is not None else 0
                admitted += len(r.prompt)
                running.append((r, seq))
            if not running:
                _refuse(pool, waiting[0], peaks)
            todos: list[list[int]] = []
            for r, seq in running:
                computed = seq.seq_len
                todo = (r.prompt + r.generated)[computed:]
                if hybrid:
                    due = seq.checkpoint_due
                    ends = [p for p in branches[r.index] if p > computed] + ([due] if due else [])
                    if ends:
                        todo = todo[: min(ends) - computed]
                todos.append(todo)
            # Decode requests with at least two tokens to go may draft (at most all but one
            # of them), as the draft policy says.
            start = time.perf_counter()
            drafting = []
            if spec is not None:
                decoding = [
                    (r, min(r.draft_len, r.max_new_tokens - len(r.generated) - 1))
                    for r, seq in running
                    if r.generated and seq.seq_len == len(r.prompt) + len(r.generated) - 1
                ]
                spec.policy.begin(len(decoding))
                drafting = spec.plan([(r, cap) for r, cap in decoding if cap > 0])
            proposal = None
            if drafting and spec is not None:
                proposal = spec.propose(
                    drafting, sampling, temperature, top_k, top_p,
                    process=sampler.draft if sampler is not None else None,
                )  # fmt: skip
            drafts = proposal.drafts if proposal is not None else {}
            drafted = time.perf_counter()
            seqs: list[kvrs.Sequence] = []
            ids: list[int] = []
            rows: list[int] = []
            prefilling: list[bool] = []
            for (r, seq), todo in zip(running, todos, strict=True):
                todo = todo + drafts.get(r.index, [])
                seqs += [seq] * len(todo)
                ids += todo
                # A chunk that stops short of the prompt's end samples nothing.
                prefilling.append(seq.seq_len + len(todo) < len(r.prompt))
                if r.index in drafts:
                    rows += range(len(ids) - len(todo), len(ids))
                elif not prefilling[-1]:
                    rows.append(len(ids) - 1)
            try:
                batch = pool.start_forward(seqs, tokens=ids)
            except kvrs.CacheFullError as e:  # another holder of the pool took the room admitted
                raise kvrs.CacheFullError(
                    f"{e}: other sequences of the pool took blocks these requests were admitted with; "
                    "give generate_batch a pool of its own, or one with more blocks (num_blocks=)"
                ) from e
            if proposal is None or spec is None:
                with torch.no_grad(), batch:
                    logits = forward_batch(model, batch, logits_to_keep=rows)
                sampled = [r for (r, _), p in zip(running, prefilling, strict=True) if not p]
                if sampler is not None:
                    logits = sampler.target(logits, sampled, [[] for _ in sampled])
                chosen = choose(logits, sampled, sampling, temperature, top_k, top_p)
            else:
                chosen = verify(
                    model, batch, rows, running, todos, prefilling, proposal, spec, sampling, temperature,
                    top_k, top_p, process=sampler.target if sampler is not None else None,
                    follow=sampler.follow if sampler is not None else None,
                )  # fmt: skip
            if spec is not None:
                _observe(spec.policy, start, drafted, ids, running, todos, drafts, proposal, chosen)
            generated = 0
            for r, tokens in chosen:
                for j, token in enumerate(tokens):
                    if r.done:
                        break
                    r.generated.append(int(token))
                    r.stopped = sampler.accepted(r, j) if sampler is not None else int(token) in stops
                    generated += 1
            done = [(r, s) for r, s in running if r.done]
            for r, seq in done:
                seq.free()  # its blocks stay cached for the next requests
                if spec is not None:
                    spec.free(r.index)
                running.remove((r, seq))
                r.finished = step
            if progress is not None:
                progress.step(admitted, generated, len(done))
            if on_step is not None:
                on_step(step, pool, states)
            for w in watches:
                w.check()
            step += 1
    finally:
        for _, seq in running:
            seq.free()
        if spec is not None:
            spec.close()


def _namespaces(namespace: Any, n: int) -> list[str | bytes | None]:
    """generate_batch's `namespace`: one per input."""
    if namespace is None or isinstance(namespace, str | bytes):
        return [namespace] * n
    out = list(namespace)
    if len(out) != n:
        raise ValueError(f"namespace: {len(out)} values for {n} inputs; give one, or one per input")
    for i, ns in enumerate(out):
        if ns is not None and not isinstance(ns, str | bytes):
            raise TypeError(f"namespace[{i}]={ns!r}: give str, bytes or None")
    return out


def _observe(
    policy: DraftPolicy,
    start: float,
    drafted: float,
    ids: list[int],
    running: list[tuple[RequestState, kvrs.Sequence]],
    todos: list[list[int]],
    drafts: dict[int, list[int]],
    proposal: Proposal | None,
    chosen: list[tuple[RequestState, list[int]]],
) -> None:
    """Tells the draft policy what a step cost and what its drafts (or the drafts it
    only watched) were worth (a token tree proposes as many as its depth: what one
    path can accept; its nodes off the first candidate are scored apart)."""
    trees = proposal.trees if proposal is not None else {}
    shadows = proposal.shadows if proposal is not None else {}
    decode = all(len(todo) == 1 for todo in todos)
    n_drafts = sum(len(d) for d in drafts.values())
    policy.timed(len(ids), time.perf_counter() - drafted, decode, drafted - start, n_drafts)
    for r, new in chosen:
        d = drafts.get(r.index)
        if d is None:
            policy.generated(r.index, new[0])
        else:
            tree = trees.get(r.index)
            policy.verified(r.index, max(tree.depths()) if tree is not None else len(d), len(new) - 1)
            if tree is not None:
                off = sum(1 for j in tree.follow(new[:-1]) if j >= tree.first)
                policy.branched(len(tree) - tree.first, off)
            shadow = shadows.get(r.index)
            if shadow is not None:
                # Verified as its chain: would a branch have taken the model's next token?
                at = len(new) - 2
                child = shadow.children.get((at, new[-1]))
                policy.branched(len(shadow) - shadow.first, int(child is not None and child >= shadow.first))


def _refuse(pool: kvrs.BlockPool, r: RequestState, peaks: dict[int, int]) -> None:
    """Nothing runs and `r` cannot start: the CacheFullError saying what holds the pool."""
    if pool.state_layers and pool.free_state_slots == 0:
        raise kvrs.CacheFullError(
            f"cache full: inputs[{r.index}] needs 1 more state slots but 0 of "
            f"{pool.state_slots} state slots are free (other sequences hold them): free them, "
            "or give generate_batch a pool with more state_slots"
        )
    raise kvrs.CacheFullError(
        f"cache full: inputs[{r.index}] needs {peaks[r.index]} more blocks but "
        f"{pool.free_blocks} of {pool.num_blocks} blocks are free (other sequences hold the "
        "rest): free them, or give generate_batch a pool with more blocks (num_blocks=)"
    )
