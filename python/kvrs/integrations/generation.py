"""Continuous batching of a transformers model over a :class:`kvrs.BlockPool`:
:func:`generate_batch`.

Every step is one :class:`kvrs.ForwardBatch` holding the uncached prompt of each newly
admitted request beside the last generated token of every running request, run in one
forward pass by :func:`kvrs.integrations.paged_attention.forward_batch`, which computes
logits only for the rows to sample. Admission is prefix-aware: a request is admitted
when the pool can grow every admitted request to its end (so nothing is ever preempted),
and a request whose first block another request admitted in the same step computes waits
one step, then attaches that block from the prefix cache instead of computing it again.
A finished request frees its sequence; its blocks stay cached for the requests after it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import kvrs
from kvrs.integrations._torch import torch
from kvrs.integrations.layout import block_pool_from_config, is_hybrid
from kvrs.integrations.paged_attention import forward_batch, use_paged_attention

__all__ = ["RequestState", "generate_batch"]

#: New tokens per request when neither the call nor the generation config says.
DEFAULT_MAX_NEW_TOKENS = 20


@dataclass
class RequestState:
    """One input of :func:`generate_batch` while it runs (what ``on_step`` sees)."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    generated: list[int] = field(default_factory=list)
    #: Prompt tokens the pool's prefix cache served (not computed).
    cached: int = 0
    #: The step it was admitted at (-1: waiting), and the step it finished at.
    admitted: int = -1
    finished: int = -1
    #: Whether it ended on a stop token (else on max_new_tokens).
    stopped: bool = False
    #: The generator its sampled tokens are drawn with (None when greedy).
    generator: Any = None

    @property
    def done(self) -> bool:
        """Whether it generated its last token."""
        return self.stopped or len(self.generated) >= self.max_new_tokens


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


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
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(e) for e in eos}


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gens: list[Any]) -> list[int]:
    """One token per row, as transformers' sampling does: temperature, then top-k, then
    top-p (nucleus) filtering, then a draw from the softmax with row `i`'s generator
    `gens[i]` (each request has its own, so what it draws does not depend on which
    other requests share its steps)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum - ordered.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, gens, strict=True)]


def generate_batch(
    model: Any,
    inputs: Sequence[Sequence[int]],
    *,
    pool: kvrs.BlockPool | None = None,
    generation_config: Any = None,
    max_new_tokens: int | Sequence[int] | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    progress_bar: bool = False,
    block_size: int = 16,
    arrivals: Sequence[int] | None = None,
    on_step: Callable[[int, kvrs.BlockPool, list[RequestState]], None] | None = None,
) -> list[list[int]]:
    """Generates tokens for every prompt of `inputs` (lists of token ids) with continuous
    batching over a BlockPool; returns each input's generated ids, in input order (a
    stop token, when one ended the request, included, as ``model.generate`` does).

    Settings not given come from `generation_config`, else ``model.generation_config``
    (``max_new_tokens``: an int, or one per input; default 20; ``eos_token_id``: the stop
    tokens). Greedy unless ``do_sample``; sampling applies ``temperature``, ``top_k`` and
    ``top_p`` as transformers does, each request drawing from its own ``torch.Generator``
    seeded from `seed` and its index (the same inputs and seed give the same tokens,
    whatever else shares the batch or the pool has cached). Greedy outputs equal
    ``model.generate`` with ``DynamicCache`` in float32.

    `pool`: where the K/V live (prefix caching on, so shared prompt prefixes are computed
    once); by default one built from the model (its layers, dtype and device) with room
    for every request at once. `arrivals` (the step each input arrives at; default all
    at step 0) and `on_step` (called after every step with the step, the pool and every
    request's state) let a caller replay a server's workload and trace it.
    """
    gc = generation_config if generation_config is not None else model.generation_config
    prompts = [[int(t) for t in p] for p in inputs]
    n = len(prompts)
    if n == 0:
        return []
    vocab = model.config.get_text_config().vocab_size
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"inputs[{i}] is empty: every prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"inputs[{i}]: token ids must lie in [0, {vocab}) (the model's vocab_size)")
    budget = max_new_tokens if max_new_tokens is not None else gc.max_new_tokens
    budgets = _per_request(DEFAULT_MAX_NEW_TOKENS if budget is None else budget, n, "max_new_tokens")
    steps_in = _per_request(list(arrivals) if arrivals is not None else 0, n, "arrivals")
    stops = _stop_ids(eos_token_id if eos_token_id is not None else gc.eos_token_id)
    sampling = bool(do_sample if do_sample is not None else gc.do_sample)
    temp = float(temperature if temperature is not None else (gc.temperature or 1.0))
    k = int(top_k if top_k is not None else (gc.top_k or 0))
    p_top = float(top_p if top_p is not None else (gc.top_p or 1.0))
    if sampling and temp <= 0:
        raise ValueError(f"temperature={temp}: sampling needs a temperature > 0")
    if k < 0:
        raise ValueError(f"top_k={k}: give a count >= 0 (0: no top-k filtering)")
    if not 0.0 < p_top <= 1.0:
        raise ValueError(f"top_p={p_top}: give a probability in (0, 1] (1: no nucleus filtering)")
    use_paged_attention(model)
    if pool is None:
        need = sum(_blocks(len(p) + b, block_size) for p, b in zip(prompts, budgets, strict=True))
        # A hybrid model's sequences each hold a state slot: one per request.
        slots = {"state_slots": n} if is_hybrid(model.config) else {}
        pool = block_pool_from_config(model, num_blocks=need, block_size=block_size, **slots)
    states = [
        RequestState(i, p, b, a) for i, (p, b, a) in enumerate(zip(prompts, budgets, steps_in, strict=True))
    ]
    for r in states:
        if _blocks(len(r.prompt) + r.max_new_tokens, pool.block_size) > pool.num_blocks:
            raise ValueError(
                f"inputs[{r.index}]: {len(r.prompt)} prompt + {r.max_new_tokens} new tokens need more "
                f"than the pool's {pool.num_blocks} blocks of {pool.block_size}"
            )
    for r in states:
        if sampling:
            # One generator per request, from (seed, its index): its draws do not depend on
            # the batches it shares with others (or on what the pool had cached).
            r.generator = torch.Generator(device=model.device)
            if seed is None:
                r.generator.seed()
            else:
                r.generator.manual_seed(hash((seed, r.index)) & (2**63 - 1))
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]

        bar = tqdm(total=n, desc="generating", unit="req")
    try:
        _run(model, pool, states, stops, sampling, temp, k, p_top, bar, on_step)
    finally:
        if bar is not None:
            bar.close()
    return [r.generated for r in states]


def _run(
    model: Any,
    pool: kvrs.BlockPool,
    states: list[RequestState],
    stops: set[int],
    sampling: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    bar: Any,
    on_step: Any,
) -> None:
    """The scheduler: admits, runs one forward pass per step, samples, finishes."""
    bs = pool.block_size
    waiting = sorted((r for r in states if r.max_new_tokens > 0), key=lambda r: r.arrival)
    running: list[tuple[RequestState, kvrs.Sequence]] = []
    # A hybrid model's pool restores a recurrent state only at a checkpoint: prefill
    # chunks end where prompts branch off each other (and where the pool asks), so the
    # state there is checkpointed once and hit by every later request sharing it.
    hybrid = bool(pool.state_layers) and pool.stats().get("state_checkpoints", 0) > 0
    branches = _branch_points([r.prompt for r in states]) if hybrid else [[] for _ in states]

    def growth(rs: list[tuple[RequestState, kvrs.Sequence]]) -> int:
        return sum(_blocks(len(r.prompt) + r.max_new_tokens, bs) - s.num_blocks for r, s in rs)

    step = 0
    try:
        while waiting or running:
            if not running:
                step = max(step, waiting[0].arrival)
            computing: set[tuple[int, ...]] = set()
            while waiting and waiting[0].arrival <= step:
                r = waiting[0]
                head = tuple(r.prompt[:bs])
                if head in computing and pool.match_prefix(r.prompt) < bs:
                    break  # next step it attaches the block the other request computes now
                if hybrid:
                    # Another request still prefilling a prefix it shares checkpoints the
                    # state there: it waits to hit all of it instead of computing it again.
                    hit = pool.match_prefix(r.prompt)
                    busy = (q.prompt for q, s in running if s.seq_len < len(q.prompt))
                    if any(_common(r.prompt, q) > hit for q in busy):
                        break
                try:
                    seq = pool.new_sequence(tokens=r.prompt)
                except kvrs.CacheFullError:
                    break
                if pool.free_blocks < growth([*running, (r, seq)]):
                    seq.free()
                    break
                waiting.pop(0)
                computing.add(head)
                r.cached, r.admitted = seq.num_cached_tokens, step
                running.append((r, seq))
            if not running:
                r = waiting[0]
                if pool.state_layers and pool.free_state_slots == 0:
                    raise kvrs.CacheFullError(
                        f"cache full: inputs[{r.index}] needs 1 more state slots but 0 of "
                        f"{pool.state_slots} state slots are free (other sequences hold them)"
                    )
                raise kvrs.CacheFullError(
                    f"cache full: inputs[{r.index}] needs "
                    f"{_blocks(len(r.prompt) + r.max_new_tokens, bs)} more blocks but {pool.free_blocks} "
                    f"of {pool.num_blocks} blocks are free (other sequences hold the rest)"
                )
            seqs: list[kvrs.Sequence] = []
            ids: list[int] = []
            prefilling: list[bool] = []
            for r, seq in running:
                done = seq.seq_len
                todo = (r.prompt + r.generated)[done:]
                if hybrid:
                    due = seq.checkpoint_due
                    ends = [p for p in branches[r.index] if p > done] + ([due] if due else [])
                    if ends:
                        todo = todo[: min(ends) - done]
                seqs += [seq] * len(todo)
                ids += todo
                # A chunk that stops short of the prompt's end samples nothing.
                prefilling.append(done + len(todo) < len(r.prompt))
            with torch.no_grad(), pool.start_forward(seqs, tokens=ids) as batch:
                logits = forward_batch(model, batch, logits_to_keep="last")
            sampled = [(r, s) for (r, s), p in zip(running, prefilling, strict=True) if not p]
            rows = [i for i, p in enumerate(prefilling) if not p]
            if sampling:
                gens = [r.generator for r, _ in sampled]
                chosen = _sample(logits[rows], temperature, top_k, top_p, gens)
            else:
                chosen = logits[rows].argmax(-1).tolist()
            for (r, _), token in zip(sampled, chosen, strict=True):
                r.generated.append(int(token))
                r.stopped = int(token) in stops
            for r, seq in [(r, s) for r, s in running if r.done]:
                seq.free()  # its blocks stay cached for the next requests
                running.remove((r, seq))
                r.finished = step
                if bar is not None:
                    bar.update(1)
            if on_step is not None:
                on_step(step, pool, states)
            step += 1
    finally:
        for _, seq in running:
            seq.free()
