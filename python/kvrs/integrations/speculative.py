"""Speculative decoding for [`generate_batch`][kvrs.integrations.transformers.generate_batch]: a draft
model proposes tokens over its own [`BlockPool`][kvrs.BlockPool], the target verifies them in
one forward pass, and both pools keep only what was accepted.

Rollback is exact and leaves no trace: a verify or draft forward is never *finished*
(``ForwardBatch.finish``); each sequence commits only its accepted tokens
(``Sequence.advance(n, tokens=...)``, which caches the blocks they complete) and drops
the positions past them (``Sequence.set_seq_len``), so draft tokens never enter the
prefix cache. A hybrid model's recurrent state is restored from a copy taken before
the forward and advanced over the accepted tokens only, by replaying each linear
layer's recorded inputs (`kvrs.integrations.hybrid.MixerRecorder`).

`speculative_sample` is the standard speculative sampling rule (Leviathan et al.
2023; Chen et al. 2023): its output is distributed as the target's own sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import kvrs
from kvrs.integrations import hybrid
from kvrs.integrations._torch import as_torch, torch
from kvrs.integrations.draft_policy import DraftPolicy
from kvrs.integrations.paged_attention import forward_batch
from kvrs.integrations.token_tree import DraftTree, causal_mask, tree_accept, tree_mask

__all__ = ["filtered_probs", "greedy_accept", "lookup_sample", "speculative_sample"]

Process = Callable[[torch.Tensor, list[Any], list[list[int]]], torch.Tensor]
"""Per-request logits processing: (logits [rows, vocab], each row's request, the drafts
each row follows) -> the logits to choose from."""


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling probabilities of `logits` ([rows, vocab]) as transformers samples:
    temperature, then top-k, then top-p (nucleus) filtering, then the softmax."""
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
    return logits.softmax(-1)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gens: list[Any]) -> list[int]:
    """One token per row, as transformers' sampling does: temperature, then top-k, then
    top-p (nucleus) filtering, then a draw from the softmax with row `i`'s generator
    `gens[i]` (each request has its own, so what it draws does not depend on which
    other requests share its steps)."""
    probs = filtered_probs(logits, temperature, top_k, top_p)
    return [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, gens, strict=True)]


def greedy_accept(target_logits: torch.Tensor, drafts: Sequence[int]) -> list[int]:
    """Greedy verification: `target_logits` [k + 1, vocab] are the target's rows for the
    last committed token and the k `drafts`. Drafts are kept while each equals the
    target's argmax; the target's argmax after the last kept one follows. Returns the
    new tokens (kept drafts, then the target's token): what greedy decoding without a
    draft produces, one to k + 1 tokens at once."""
    best = target_logits.argmax(-1).tolist()
    out: list[int] = []
    for j, d in enumerate(drafts):
        if best[j] != d:
            break
        out.append(int(d))
    out.append(int(best[len(out)]))
    return out


def speculative_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None = None
) -> list[int]:
    """Speculative sampling of one request: `p` [k + 1, vocab] the target's sampling
    probabilities at the last committed token and after each of the k `drafts`, `q`
    [k, vocab] the draft's probabilities each draft was sampled from. Draft j is
    accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection a token
    is drawn from the residual normalize(max(0, p_j - q_j)) and drafting stops; when
    every draft is accepted a bonus token is drawn from p_k. Returns the new tokens
    (1 to k + 1); each is distributed exactly as a draw from the target's `p` would
    be. Draws use `generator` (uniforms on its device), so a seeded generator
    reproduces them."""
    k = len(drafts)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(
            f"speculative_sample: p has {p.shape[0]} rows and q {q.shape[0]} for {k} drafts "
            f"(give p {k + 1} rows, q {k})"
        )
    if k:
        u = torch.rand(k, generator=generator, device=p.device).tolist()
        idx = torch.as_tensor(list(drafts), device=p.device)
        rows = torch.arange(k, device=p.device)
        ratio = (p[:k][rows, idx] / q[rows, idx]).tolist()
    out: list[int] = []
    for j, d in enumerate(drafts):
        if u[j] < min(1.0, ratio[j]):
            out.append(int(d))
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        total = float(residual.sum())
        # A zero residual (p == q up to rounding) leaves p itself to draw from.
        dist = residual / total if total > 0 else p[j]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out


def lookup_sample(
    p: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None = None
) -> list[int]:
    """Verification of deterministic drafts (prompt lookup) under sampling, transformers'
    rule: `p` [k + 1, vocab] the target's sampling probabilities at the last committed
    token and after each of the k `drafts`. A token is drawn from each row in turn with
    `generator`; draft j is kept while the draw equals it, and the first draw that
    differs (or the draw from the last row when every draft is kept) ends the step. So
    draft x is accepted with probability p(x), and a rejection yields a token from p with
    x removed, renormalised: speculative sampling for a point-mass draft distribution.
    Each output token is the draw plain sampling makes with the same generator state
    (one ``torch.multinomial`` per output token, in order). Returns 1 to k + 1 tokens."""
    k = len(drafts)
    if p.shape[0] != k + 1:
        raise ValueError(f"lookup_sample: p has {p.shape[0]} rows for {k} drafts (give p {k + 1} rows)")
    out: list[int] = []
    for j, d in enumerate(drafts):
        token = int(torch.multinomial(p[j], 1, generator=generator))
        out.append(token)
        if token != d:
            return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out


def check_assistant(model: Any, assistant: Any, num_assistant_tokens: int) -> None:
    """The draft must share the target's vocabulary and device; at least one draft token
    a step."""
    if isinstance(num_assistant_tokens, bool) or not isinstance(num_assistant_tokens, int):
        raise TypeError(f"num_assistant_tokens={num_assistant_tokens!r}: give an int >= 1")
    if num_assistant_tokens < 1:
        raise ValueError(
            f"num_assistant_tokens={num_assistant_tokens}: the draft proposes at least 1 token a step "
            "(leave assistant_model=None to decode without a draft)"
        )
    if assistant.device != model.device:
        raise ValueError(
            f"assistant_model is on {assistant.device}, the model on {model.device}: put the draft on "
            "the model's device (its draws use each request's generator there)"
        )
    ours = model.config.get_text_config().vocab_size
    theirs = assistant.config.get_text_config().vocab_size
    if ours != theirs:
        raise ValueError(
            f"assistant_model has vocab_size={theirs}, the model {ours}: a draft must share the "
            "target's tokenizer and vocabulary"
        )


class StateSnapshot:
    """Copies of the recurrent states of some sequences of a hybrid pool, taken before
    a forward that may be rolled back; `rollback` puts a sequence's state back
    and replays the recorded inputs of its first `m` tokens (the accepted ones)."""

    def __init__(self, seqs: Sequence[kvrs.Sequence]):
        self.saved: dict[int, tuple[kvrs.Sequence, list[dict[str, torch.Tensor]]]] = {}
        for seq in seqs:
            layers = seq.pool.state_layers
            states = [{k: as_torch(v).clone() for k, v in seq.state(j).items()} for j in range(layers)]
            self.saved[_slot(seq)] = (seq, states)
        self.recorder = hybrid.MixerRecorder(set(self.saved))

    def rollback(self, seq: kvrs.Sequence, m: int) -> None:
        """`seq`'s state becomes the one after the first `m` tokens the recorded forwards
        gave it: the saved copy, advanced over those tokens' recorded mixer inputs."""
        slot = _slot(seq)
        _, states = self.saved[slot]
        for j, saved in enumerate(states):
            for name, view in seq.state(j).items():
                as_torch(view).copy_(saved[name])
        self.recorder.replay(seq, m)


def _slot(seq: kvrs.Sequence) -> int:
    slot = seq.state_slot
    if slot is None:  # a pool with state layers gives every sequence a slot
        raise RuntimeError("a sequence of a pool with state layers holds no state slot")
    return int(slot)


def commit(seq: kvrs.Sequence, tokens: Sequence[int], written: int) -> None:
    """Commits the first ``len(tokens)`` of the `written` positions the open forwards
    placed for `seq` (with their ids, so the blocks they complete are cached) and drops
    the rest: rejected drafts leave no position, token id or cached block behind."""
    start = seq.seq_len
    if tokens:
        seq.advance(len(tokens), tokens=list(tokens))
    if written > len(tokens):
        seq.set_seq_len(start + len(tokens))


@dataclass
class Proposal:
    """One step's drafts: per request index, the draft tokens, the draft's
    probabilities they were sampled from (sampling only), the positions the draft
    forwards placed in its sequence; the open batches and the state copies."""

    drafts: dict[int, list[int]]
    q: dict[int, list[torch.Tensor]]
    written: dict[int, int]
    batches: list[kvrs.ForwardBatch]
    snapshot: StateSnapshot | None
    trees: dict[int, DraftTree] = field(default_factory=dict)
    """Requests whose drafts are a token tree (their `drafts` are its nodes' tokens)."""
    shadows: dict[int, DraftTree] = field(default_factory=dict)
    """Requests that verify the first candidate of a tree they did not verify (scored
    for the draft policy only)."""


class Drafter(Protocol):
    """What `verify` needs of the draft side: a draft model's
    `Speculation` or prompt lookup's
    `kvrs.integrations.prompt_lookup.PromptLookup`."""

    k: int
    schedule: str
    seqs: Any
    policy: DraftPolicy

    def settle(self, proposal: Proposal, accepted: dict[int, int], tokens: dict[int, list[int]]) -> None: ...


class Speculation:
    """The draft side of speculative [`generate_batch`][kvrs.integrations.transformers.generate_batch]: the
    assistant model, its
    pool and one sequence per admitted request, which catches up with the request's
    tokens when it drafts and keeps only what the target accepted."""

    def __init__(
        self,
        assistant: Any,
        pool: kvrs.BlockPool,
        num_tokens: int,
        peaks: dict[int, int],
        schedule: str = "constant",
        policy: DraftPolicy | None = None,
    ):
        self.model, self.pool, self.k, self.schedule = assistant, pool, num_tokens, schedule
        self.peaks = peaks  # each request's most blocks in the draft pool
        self.seqs: dict[int, kvrs.Sequence] = {}
        self.hybrid = bool(pool.state_layers)
        self.policy = policy if policy is not None else DraftPolicy("schedule")

    def admit(self, index: int, prompt: list[int]) -> bool:
        """Starts request `index`'s draft sequence (attaching the draft pool's cached
        prefix); False when the draft pool cannot hold it to its end now."""
        try:
            seq = self.pool.new_sequence(tokens=prompt)
        except kvrs.CacheFullError:
            return False
        growth = sum(self.peaks[i] - s.num_blocks for i, s in self.seqs.items())
        if self.pool.free_blocks < growth + self.peaks[index] - seq.num_blocks:
            seq.free()
            return False
        self.seqs[index] = seq
        return True

    def free(self, index: int) -> None:
        seq = self.seqs.pop(index, None)
        if seq is not None:
            seq.free()
        self.policy.forget(index)

    def plan(self, items: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
        """The requests that draft this step and how many tokens each, from (request,
        most drafts) `items`, as the policy says."""
        out = []
        for r, cap in items:
            k = self.policy.length(r.index, cap)
            if k > 0:
                out.append((r, k))
        return out

    def close(self) -> None:
        for index in list(self.seqs):
            self.free(index)

    def propose(
        self,
        items: list[tuple[Any, int]],
        sampling: bool,
        temperature: float,
        top_k: int,
        top_p: float,
        process: Process | None = None,
    ) -> Proposal:
        """Drafts `kr` tokens for each (request, kr) of `items`: kr draft forwards, the
        first catching the draft sequence up with the request's tokens (its last
        generated token included), each later one the previous draft. Nothing is
        committed: `settle` keeps what the target accepts. `process` (per-request
        options) transforms each round's logits before they are sampled from."""
        seqs = [self.seqs[r.index] for r, _ in items]
        snapshot = StateSnapshot(seqs) if self.hybrid else None
        out = Proposal({r.index: [] for r, _ in items}, {r.index: [] for r, _ in items}, {}, [], snapshot)
        rounds = max(kr for _, kr in items)
        recording = snapshot.recorder.recording() if snapshot is not None else nullcontext()
        with recording, torch.no_grad():
            for j in range(rounds):
                active = [(r, seq) for (r, kr), seq in zip(items, seqs, strict=True) if kr > j]
                placed: list[kvrs.Sequence] = []
                ids: list[int] = []
                for r, seq in active:
                    todo = (r.prompt + r.generated)[seq.seq_len :] if j == 0 else out.drafts[r.index][-1:]
                    placed += [seq] * len(todo)
                    ids += todo
                    out.written[r.index] = out.written.get(r.index, 0) + len(todo)
                # Later rounds build on uncommitted positions, whose ids the pool does not
                # know (and never records): the ids go to the forward only.
                batch = self.pool.start_forward(placed, tokens=ids if j == 0 else None)
                out.batches.append(batch)
                logits = forward_batch(self.model, batch, ids, logits_to_keep="last")
                if process is not None:
                    logits = process(logits, [r for r, _ in active], [out.drafts[r.index] for r, _ in active])
                if sampling:
                    probs = filtered_probs(logits, temperature, top_k, top_p)
                    for (r, _), row in zip(active, probs, strict=True):
                        out.drafts[r.index].append(int(torch.multinomial(row, 1, generator=r.generator)))
                        out.q[r.index].append(row)
                else:
                    for (r, _), token in zip(active, logits.argmax(-1).tolist(), strict=True):
                        out.drafts[r.index].append(int(token))
        return out

    def settle(self, proposal: Proposal, accepted: dict[int, int], tokens: dict[int, list[int]]) -> None:
        """After verification: each draft sequence keeps its caught-up tokens and the
        drafts it computed that were accepted (`accepted[i]` of them; `tokens[i]` the
        request's tokens from the draft sequence's committed length on), its state
        rolled back to there; the rest is dropped."""
        for index, written in proposal.written.items():
            seq = self.seqs[index]
            catch_up = written - (len(proposal.drafts[index]) - 1)
            keep = catch_up + min(accepted[index], len(proposal.drafts[index]) - 1)
            if proposal.snapshot is not None and keep < written:
                proposal.snapshot.rollback(seq, keep)
            commit(seq, tokens[index][:keep], written)
        for batch in proposal.batches:
            batch.cancel()  # stale now: closes without cutting anything


def choose(
    logits: torch.Tensor,
    sampled: list[Any],
    sampling: bool,
    temperature: float,
    top_k: int,
    top_p: float,
) -> list[tuple[Any, list[int]]]:
    """One token for each request of `sampled` from its logits row."""
    if sampling:
        tokens = sample(logits, temperature, top_k, top_p, [r.generator for r in sampled])
    else:
        tokens = logits.argmax(-1).tolist()
    return [(r, [int(t)]) for r, t in zip(sampled, tokens, strict=True)]


def verify(
    model: Any,
    batch: kvrs.ForwardBatch,
    rows: list[int],
    running: list[tuple[Any, kvrs.Sequence]],
    todos: list[list[int]],
    prefilling: list[bool],
    proposal: Proposal,
    spec: Drafter,
    sampling: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    process: Process | None = None,
    follow: Callable[[int, list[int]], None] | None = None,
) -> list[tuple[Any, list[int]]]:
    """The speculative step's target forward: every request's tokens, a drafting
    request's drafts after its last token, with logits for all of those rows. Each
    drafting request keeps the drafts the target accepts and one token of the
    target's; then every sequence commits only what it keeps (both pools), its
    recurrent state rolled back to there. `process` (per-request options) transforms
    the logits first, each row seeing the drafts before it; `follow` (request index, the
    rows its tokens came from) is told the path a token tree's request accepted."""
    drafting = [seq for (r, seq) in running if r.index in proposal.drafts]
    snapshot = StateSnapshot(drafting) if running and running[0][1].pool.state_layers else None
    recording = snapshot.recorder.recording() if snapshot is not None else nullcontext()
    branching = {i: t for i, t in proposal.trees.items() if not t.is_chain}
    position_ids, custom_mask = (
        _tree_layout(batch, running, todos, proposal, branching) if branching else (None, None)
    )
    try:
        with torch.no_grad(), recording:
            logits = forward_batch(
                model, batch, logits_to_keep=rows, position_ids=position_ids, custom_mask=custom_mask
            )
    except BaseException:
        batch.cancel()
        for b in proposal.batches:
            b.cancel()
        raise
    if process is not None:
        owners: list[Any] = []
        extras: list[list[int]] = []
        for (r, _), pre in zip(running, prefilling, strict=True):
            d = proposal.drafts.get(r.index)
            tree = branching.get(r.index)
            if tree is not None:
                owners += [r] * (len(d) + 1)  # type: ignore[arg-type]
                extras += [tree.path_tokens(j) for j in range(-1, len(tree))]
            elif d is not None:
                owners += [r] * (len(d) + 1)
                extras += [d[:j] for j in range(len(d) + 1)]
            elif not pre:
                owners.append(r)
                extras.append([])
        logits = process(logits, owners, extras)
    chosen: list[tuple[Any, list[int]]] = []
    keep: dict[int, list[int]] = {}
    accepted: dict[int, int] = {}
    paths: dict[int, list[int]] = {}  # tree requests: the accepted nodes
    at = 0
    with torch.no_grad():
        for (r, seq), todo, pre in zip(running, todos, prefilling, strict=True):
            d = proposal.drafts.get(r.index)
            if d is None:
                if not pre:
                    chosen += choose(logits[at : at + 1], [r], sampling, temperature, top_k, top_p)
                    at += 1
                keep[r.index] = todo
                continue
            rows_r = logits[at : at + len(d) + 1]
            at += len(d) + 1
            tree = branching.get(r.index)
            if tree is not None:
                p = filtered_probs(rows_r, temperature, top_k, top_p) if sampling else rows_r
                new, paths[r.index] = tree_accept(p, tree, sampling, r.generator)
                if follow is not None:
                    follow(r.index, [0, *(j + 1 for j in paths[r.index])])
            elif sampling:
                p = filtered_probs(rows_r, temperature, top_k, top_p)
                q = proposal.q.get(r.index)
                if q:
                    new = speculative_sample(p, torch.stack(q), d, r.generator)
                else:  # deterministic drafts (prompt lookup): q is a point mass
                    new = lookup_sample(p, d, r.generator)
            else:
                new = greedy_accept(rows_r, d)
            r.proposed += max(tree.depths()) if tree is not None else len(d)
            r.accepted += len(new) - 1
            if spec.schedule == "heuristic":
                grown = r.draft_len + 2 if len(new) - 1 == len(d) else r.draft_len - 1
                r.draft_len = max(1, min(spec.k, grown))
            accepted[r.index] = len(new) - 1
            chosen.append((r, new))
            # The last token and the accepted drafts: the positions whose K/V are right.
            keep[r.index] = todo + new[:-1]
            if snapshot is not None and len(new) - 1 < len(d):
                snapshot.rollback(seq, len(keep[r.index]))
        for (r, seq), todo in zip(running, todos, strict=True):
            written = len(todo) + len(proposal.drafts.get(r.index, []))
            path = paths.get(r.index)
            if path is not None and path != list(range(len(path))):
                # The accepted nodes to the front of the drafts' slots, the rest cut.
                seq.accept(seq.seq_len, [*range(len(todo)), *(len(todo) + j for j in path)])
                written = len(keep[r.index])
            commit(seq, keep[r.index], written)
        batch.cancel()  # stale now: closes without cutting anything
        news = {r.index: new for r, new in chosen}
        tokens = {
            r.index: (r.prompt + r.generated + news[r.index])[spec.seqs[r.index].seq_len :]
            for r, _ in running
            if r.index in proposal.written
        }
        spec.settle(proposal, accepted, tokens)
    return chosen


def _tree_layout(
    batch: kvrs.ForwardBatch,
    running: list[tuple[Any, kvrs.Sequence]],
    todos: list[list[int]],
    proposal: Proposal,
    trees: dict[int, DraftTree],
) -> tuple[torch.Tensor, Any]:
    """A verify batch holding token trees: each token's rotary position (a node's is its
    depth after the last committed token; every other token's is its slot) and the
    batch's attention mask (trees as `tree_mask` says, everything else causal)."""
    positions = torch.from_numpy(batch.positions.astype("int64"))
    masks = []
    at = 0
    for (r, seq), todo in zip(running, todos, strict=True):
        d = proposal.drafts.get(r.index, [])
        tree = trees.get(r.index)
        start = seq.seq_len
        if tree is not None:
            last = start + len(todo) - 1
            depths = torch.tensor(tree.depths(), dtype=torch.long)
            positions[at + len(todo) : at + len(todo) + len(tree)] = last + depths
            masks.append(tree_mask(start, len(todo), tree).reshape(-1))
        else:
            masks.append(causal_mask(start, len(todo) + len(d)).reshape(-1))
        at += len(todo) + len(d)
    return positions, np.concatenate(masks)
