"""Per-request sampling options of [`generate_batch`][kvrs.integrations.transformers.generate_batch]:
vLLM's ``SamplingParams`` options (penalties, ``min_p``, minimum lengths, stop token ids
and stop sequences, log-probabilities), resolved per request (`plan`) and applied
to a step's batched logits at once (`Sampler`).

The logits processors follow transformers' (``RepetitionPenaltyLogitsProcessor``,
``MinNewTokensLengthLogitsProcessor``, then the warpers ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``, in that order), with
vLLM's presence and frequency penalties after the repetition penalty; each is a few
tensor operations over the ``[rows, vocab]`` logits of a step, with per-row parameters.
A row is a request's position: with a draft model, a request verifies several positions
in one step, each row seeing the drafts before it (its penalties count them, its
minimum length includes them), so the processed distributions are exactly those of
decoding one token at a time and speculative decoding stays exact.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrs.integrations._torch import torch

__all__ = ["Options", "Plan", "Sampler", "SamplingParams", "plan", "stop_sequence_list", "token_id_list"]


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling options for [`generate_batch`][kvrs.integrations.transformers.generate_batch]
    (``sampling_params=``:
    one for every input, or one per input), with vLLM's names, defaults and meanings:
    ``SamplingParams()`` samples at temperature 1 as vLLM does, ``temperature=0`` is
    greedy.

    - `temperature`, `top_k` (0 or -1: off), `top_p`, `min_p` (0: off): the warpers,
      applied in that order (transformers' order) when sampling.
    - `repetition_penalty` (1: off): transformers' and vLLM's, over the prompt and the
      output: a seen token's positive logit is divided by it, a negative one multiplied.
    - `presence_penalty`, `frequency_penalty` (0: off; in [-2, 2]): vLLM's, over the
      output: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
    - `max_tokens` (None: generate_batch's `max_new_tokens`), `min_tokens` (stop tokens
      are masked until that many were generated, and stop sequences not matched).
    - `stop_token_ids`: more stop tokens beside the model's eos (included in the output,
      as the eos is); `ignore_eos`: the eos does not stop the request.
    - `stop_sequences`: token-id sequences (``[[13, 13]]``) ending the request when its
      output ends with one; the matched tokens are left out of the output (vLLM's
      ``include_stop_str_in_output=False``) and reported as its ``stop_reason``.
    - `logprobs`: report the log-probability of each generated token and of the
      `logprobs` most likely ones (0: the generated token's only), from the model's raw
      logits (vLLM's default ``raw_logprobs``: before penalties and temperature).
    - `seed`: this request's own seed (else generate_batch's `seed` and its index).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: Sequence[int] | None = None
    stop_sequences: Sequence[Sequence[int]] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Options:
    """One request's resolved options (what `Sampler` applies)."""

    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_new_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None
    seed: int | None = None

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """Whether generate_batch's scalar path (temperature, top_k, top_p and the
        model's stop tokens) serves it exactly."""
        return (
            not self.penalized
            and self.min_p == 0.0
            and self.min_new_tokens == 0
            and not self.stop_sequences
            and self.logprobs is None
            and self.seed is None
        )

    def warping(self) -> tuple[bool, float, int, float]:
        return (
            (self.sample, self.temperature, self.top_k, self.top_p) if self.sample else (False, 1.0, 0, 1.0)
        )


def _warn(msg: str) -> None:
    # generate_batch -> plan -> _check -> _warn: the caller's line.
    warnings.warn(msg, UserWarning, stacklevel=5)


def token_id_list(value: Any, name: str) -> list[int]:
    """`value` (one token id or several) as a list of ints; a string is a TypeError
    saying that `name` takes token ids and how to get them."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or (
        isinstance(value, Sequence) and any(isinstance(v, (str, bytes)) for v in value)
    ):
        token = (
            value
            if isinstance(value, (str, bytes))
            else next(v for v in value if isinstance(v, (str, bytes)))
        )
        raise TypeError(
            f"{name}={value!r}: {name} takes token ids (ints), not token strings; convert with "
            f"tokenizer.convert_tokens_to_ids({token!r}) (for the end of sequence: tokenizer.eos_token_id)"
        )
    items = [value] if not isinstance(value, Sequence) and hasattr(value, "__index__") else value
    if hasattr(items, "tolist"):  # a tensor or an array of ids
        items = items.tolist()
        items = items if isinstance(items, list) else [items]
    out = []
    for v in items:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{name}={value!r}: give a token id (int) or a list of them")
        out.append(int(v))
    return out


def stop_sequence_list(value: Any, name: str, vocab: int) -> tuple[tuple[int, ...], ...]:
    """`value` as token-id sequences: a list of non-empty lists of ints."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or (
        isinstance(value, Sequence) and any(isinstance(v, (str, bytes)) for v in value)
    ):
        raise TypeError(
            f"{name}={value!r}: {name} takes token-id sequences, not text; tokenize each: "
            "[tokenizer(s, add_special_tokens=False).input_ids for s in stops]"
        )
    if not isinstance(value, Sequence) or any(not isinstance(s, Sequence) for s in value):
        raise TypeError(
            f"{name}={value!r}: give a list of token-id lists, e.g. {name}=[[13, 13]] (one list of "
            f"ints is ambiguous: [[13, 13]] is one sequence, [[13], [13]] two)"
        )
    out = []
    for s in value:
        ids = token_id_list(list(s), name)
        if not ids:
            raise ValueError(f"{name}: an empty stop sequence would stop every request at once")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"{name}={value!r}: token ids must lie in [0, {vocab}) (the model's vocab_size)")
        out.append(tuple(ids))
    return tuple(out)


def _number(value: Any, name: str, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name}={value!r}: give a number")
    v = float(value)
    if v < low or v > high or (low_open and v == low):
        lo = "(" if low_open else "["
        raise ValueError(f"{name}={value!r}: give a value in {lo}{low}, {high}]")
    return v


def _count(value: Any, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}={value!r}: give an int >= {low}")
    if int(value) < low:
        raise ValueError(f"{name}={value!r}: give an int >= {low}")
    return int(value)


def _gc(gc: Any, name: str) -> Any:
    return getattr(gc, name, None) if gc is not None else None


@dataclass
class Plan:
    """Every request's options, and their budgets (max_tokens included)."""

    options: list[Options]
    budgets: list[int]

    @property
    def scalar(self) -> tuple[bool, float, int, float] | None:
        """The (sampling, temperature, top_k, top_p) every request shares when they are
        all plain, with the same stop tokens: generate_batch's scalar path; else None."""
        first = self.options[0]
        if all(o.plain for o in self.options) and all(
            o.warping() == first.warping() and o.stop_ids == first.stop_ids for o in self.options
        ):
            return first.warping()
        return None


def plan(
    n: int,
    vocab: int,
    gc: Any,
    stops: set[int],
    budgets: list[int],
    given: dict[str, Any],
    sampling_params: Any,
) -> Plan:
    """Each request's options: from `sampling_params` (one SamplingParams or dict for
    every input, or one per input) or from generate_batch's keyword arguments (`given`:
    those passed, by name; the others come from the generation config `gc`). Warns about
    options that are ignored; raises for values out of range, naming the argument."""
    if sampling_params is None:
        return Plan([_from_kwargs(vocab, gc, stops, given, budgets)] * n, budgets)
    passed = [k for k, v in given.items() if v is not None]
    if passed:
        raise ValueError(
            f"sampling_params and {', '.join(f'{k}=' for k in passed)} were both given: give the "
            "sampling options in one place (sampling_params, or the keyword arguments)"
        )
    if isinstance(sampling_params, (SamplingParams, Mapping)):
        params = [sampling_params] * n
    elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(
                f"sampling_params: {len(params)} values for {n} inputs (give one, or one per input)"
            )
    else:
        raise TypeError(
            f"sampling_params={sampling_params!r}: give a kvrs.integrations.transformers.SamplingParams "
            "(or a dict of its fields), or a list of them, one per input"
        )
    options = []
    out_budgets = list(budgets)
    for i, p in enumerate(params):
        name = (
            f"sampling_params[{i}]"
            if not isinstance(sampling_params, (SamplingParams, Mapping))
            else "sampling_params"
        )
        if isinstance(p, Mapping):
            fields = {f.name for f in dataclasses.fields(SamplingParams)}
            unknown = sorted(set(p) - fields)
            if unknown:
                raise TypeError(
                    f"{name}: unknown option {unknown[0]!r}; SamplingParams takes {', '.join(sorted(fields))}"
                )
            p = SamplingParams(**p)
        elif not isinstance(p, SamplingParams):
            raise TypeError(
                f"{name}={p!r}: give a kvrs.integrations.transformers.SamplingParams or a dict of its fields"
            )
        if p.max_tokens is not None:  # its own budget, over max_new_tokens'
            out_budgets[i] = _count(p.max_tokens, f"{name}.max_tokens")
        options.append(_from_params(p, name, vocab, stops, out_budgets[i]))
    return Plan(options, out_budgets)


def _from_params(p: SamplingParams, name: str, vocab: int, stops: set[int], budget: int) -> Options:
    temperature = _number(p.temperature, f"{name}.temperature", 0.0, math.inf)
    top_k = int(p.top_k) if not isinstance(p.top_k, bool) and hasattr(p.top_k, "__index__") else None
    if top_k is None or top_k < -1:
        raise ValueError(f"{name}.top_k={p.top_k!r}: give a count >= 1, or 0 / -1 for no top-k filtering")
    min_new = _count(p.min_tokens, f"{name}.min_tokens")
    if min_new > budget:
        raise ValueError(f"{name}.min_tokens={min_new} is more than its max_tokens={budget}")
    ids = set() if p.ignore_eos else set(stops)
    ids |= set(token_id_list(p.stop_token_ids, f"{name}.stop_token_ids"))
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(
            f"{name}.stop_token_ids: token ids must lie in [0, {vocab}) (the model's vocab_size)"
        )
    return Options(
        sample=temperature >= 1e-5,  # vLLM's: below that, greedy
        temperature=temperature if temperature >= 1e-5 else 1.0,
        top_k=max(top_k, 0),
        top_p=_number(p.top_p, f"{name}.top_p", 0.0, 1.0, low_open=True),
        min_p=_number(p.min_p, f"{name}.min_p", 0.0, 1.0),
        repetition_penalty=_number(
            p.repetition_penalty, f"{name}.repetition_penalty", 0.0, math.inf, low_open=True
        ),
        presence_penalty=_number(p.presence_penalty, f"{name}.presence_penalty", -2.0, 2.0),
        frequency_penalty=_number(p.frequency_penalty, f"{name}.frequency_penalty", -2.0, 2.0),
        min_new_tokens=min_new,
        stop_ids=frozenset(ids),
        stop_sequences=stop_sequence_list(p.stop_sequences, f"{name}.stop_sequences", vocab),
        logprobs=None if p.logprobs is None else _count(p.logprobs, f"{name}.logprobs"),
        seed=None if p.seed is None else _count(p.seed, f"{name}.seed"),
    )


def _from_kwargs(vocab: int, gc: Any, stops: set[int], given: dict[str, Any], budgets: list[int]) -> Options:
    """generate_batch's keyword arguments (transformers' meanings: greedy unless
    do_sample), the generation config for those not given."""

    def get(name: str, default: Any) -> Any:
        v = given.get(name)
        if v is None:
            v = _gc(gc, name)
        return default if v is None else v

    sample = bool(get("do_sample", False))
    temperature = float(get("temperature", 1.0))
    top_k = int(get("top_k", 0))
    top_p = float(get("top_p", 1.0))
    min_p = float(get("min_p", 0.0))
    if sample and temperature <= 0:
        raise ValueError(f"temperature={temperature}: sampling needs a temperature > 0")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: give a count >= 0 (0: no top-k filtering)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: give a probability in (0, 1] (1: no nucleus filtering)")
    _number(min_p, "min_p", 0.0, 1.0)
    rep = _number(float(get("repetition_penalty", 1.0)), "repetition_penalty", 0.0, math.inf, low_open=True)
    presence = _number(get("presence_penalty", 0.0), "presence_penalty", -2.0, 2.0)
    frequency = _number(get("frequency_penalty", 0.0), "frequency_penalty", -2.0, 2.0)
    min_new = _count(get("min_new_tokens", 0), "min_new_tokens")
    if min_new and given.get("min_new_tokens") is not None and min_new > max(budgets, default=0):
        raise ValueError(
            f"min_new_tokens={min_new} is more than max_new_tokens={max(budgets)}: give at most "
            "max_new_tokens"
        )
    sequences = stop_sequence_list(given.get("stop_sequences"), "stop_sequences", vocab)
    logprobs = given.get("logprobs")
    if logprobs is not None:
        logprobs = _count(logprobs, "logprobs")
    if not sample:
        ignored = [
            (name, given[name])
            for name, neutral in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
            if given.get(name) is not None and given[name] != neutral
        ]
        for name, value in ignored:
            # transformers' wording, and how to sample (vLLM samples whenever temperature > 0).
            _warn(
                f"`do_sample` is not set to `True`. However, `{name}` is set to `{value}` -- this flag is "
                f"only used in sample-based generation modes. You should set `do_sample=True` or unset "
                f"`{name}`. (generate_batch decodes greedily unless do_sample=True, as transformers does; "
                "to sample as vLLM does, pass do_sample=True, or "
                f"sampling_params=SamplingParams({name}=...).)"
            )
    if given.get("min_new_tokens") and not stops and not sequences:
        _warn(
            f"min_new_tokens={min_new} is ignored: there are no stop tokens to hold back (eos_token_id is "
            "empty, and no stop_sequences); set eos_token_id, or unset min_new_tokens"
        )
    return Options(
        sample=sample,
        temperature=temperature if sample else 1.0,
        top_k=top_k if sample else 0,
        top_p=top_p if sample else 1.0,
        min_p=min_p if sample else 0.0,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
        min_new_tokens=min_new,
        stop_ids=frozenset(stops),
        stop_sequences=sequences,
        logprobs=logprobs,
    )


class Sampler:
    """Applies every request's options to a step's logits (`target` for the
    model's rows, `draft` for a draft model's) and follows what each request
    generates (`accepted`): its penalty counts, stop tokens and sequences,
    log-probabilities. `options[i]` is request i's; a row's owner is any object with
    ``index``, ``prompt`` and ``generated`` (generate_batch's
    [`RequestState`][kvrs.integrations.transformers.RequestState]), so
    a server of its own on ``forward_batch`` can sample with it too."""

    def __init__(self, options: list[Options], vocab: int):
        self.options = options
        self.vocab = vocab
        self.sampling = any(o.sample for o in options)
        self.counts: dict[int, torch.Tensor] = {}
        """Per penalized request: its output tokens' counts and which tokens its prompt
        and output hold ([vocab] each, on the logits' device), made at its first row."""
        self.seen: dict[int, torch.Tensor] = {}
        self.pending: dict[int, list[torch.Tensor]] = {}
        """Per request asking for logprobs: the raw log-softmax rows of this step's
        positions, in order; and what it generated."""
        self.logprobs: dict[int, list[dict[int, float]]] = {
            i: [] for i, o in enumerate(options) if o.logprobs is not None
        }
        self.stop_reason: dict[int, int | list[int]] = {}
        """Why each stopped request stopped (a stop token, or a stop sequence), and how
        many tokens at its end the output leaves out (a matched stop sequence)."""
        self.trim: dict[int, int] = {}
        self._device: Any = None

    def target(self, logits: torch.Tensor, owners: list[Any], extras: list[list[int]]) -> torch.Tensor:
        """The model's rows: row i is a position of request `owners[i]` after its tokens
        and `extras[i]` (drafts not accepted yet). Records raw log-probabilities."""
        self.pending = {}
        if any(self.options[r.index].logprobs is not None for r in owners):
            lp = torch.log_softmax(logits.float(), dim=-1)
            for i, r in enumerate(owners):
                if self.options[r.index].logprobs is not None:
                    self.pending.setdefault(r.index, []).append(lp[i])
        return self.process(logits, owners, extras)

    def follow(self, index: int, rows: list[int]) -> None:
        """Request `index`'s step verified a token tree: its `j`-th token came from its
        row ``rows[j]`` of `target` (the root's, then the accepted nodes'), not row `j`."""
        pending = self.pending.get(index)
        if pending is not None:
            self.pending[index] = [pending[i] for i in rows]

    def draft(self, logits: torch.Tensor, owners: list[Any], extras: list[list[int]]) -> torch.Tensor:
        """A draft model's rows, processed the same way (its proposals then follow the
        request's options; its probabilities are those speculative sampling divides by)."""
        return self.process(logits, owners, extras)

    def _state(self, r: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if r.index not in self.counts:
            device = self._device
            counts = torch.zeros(self.vocab, device=device)
            if r.generated:
                counts.index_add_(
                    0,
                    torch.tensor(r.generated, device=device),
                    torch.ones(len(r.generated), device=device),
                )
            seen = torch.zeros(self.vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(r.prompt + r.generated, device=device)] = True
            self.counts[r.index], self.seen[r.index] = counts, seen
        return self.counts[r.index], self.seen[r.index]

    def process(self, logits: torch.Tensor, owners: list[Any], extras: list[list[int]]) -> torch.Tensor:
        """The processed logits (float32) of `logits` [len(owners), vocab]: processors
        (penalties, minimum lengths) for every row; when any request samples, the
        warpers for sampling rows, and greedy rows reduced to their argmax (so that a
        draw from them is the greedy token)."""
        if not owners:
            return logits
        x = logits.float()
        self._device = x.device
        dev = x.device
        opts = [self.options[r.index] for r in owners]
        neg = float("-inf")
        if any(o.penalized for o in opts):
            zeros = torch.zeros(self.vocab, device=dev)
            none = torch.zeros(self.vocab, dtype=torch.bool, device=dev)
            states = [
                self._state(r) if o.penalized else (zeros, none) for r, o in zip(owners, opts, strict=True)
            ]
            counts = torch.stack([c for c, _ in states])
            seen = torch.stack([s for _, s in states])
            rows = [i for i, e in enumerate(extras) for _ in e]
            if rows:
                ri = torch.tensor(rows, device=dev)
                ti = torch.tensor([t for e in extras for t in e], device=dev)
                counts.index_put_((ri, ti), torch.ones(len(rows), device=dev), accumulate=True)
                seen[ri, ti] = True
            rep = torch.tensor([o.repetition_penalty for o in opts], device=dev)[:, None]
            if bool((rep != 1.0).any()):
                x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
            freq = torch.tensor([o.frequency_penalty for o in opts], device=dev)[:, None]
            pres = torch.tensor([o.presence_penalty for o in opts], device=dev)[:, None]
            if bool((freq != 0).any() or (pres != 0).any()):
                x = x - freq * counts - pres * (counts > 0).float()
        held = [
            (i, t)
            for i, (r, o, e) in enumerate(zip(owners, opts, extras, strict=True))
            if len(r.generated) + len(e) < o.min_new_tokens
            for t in o.stop_ids
        ]
        if held:
            x = x.clone() if x is logits else x
            x[
                torch.tensor([i for i, _ in held], device=dev), torch.tensor([t for _, t in held], device=dev)
            ] = neg
        if not self.sampling:
            return x
        sample = torch.tensor([o.sample for o in opts], device=dev)[:, None]
        temps = torch.tensor([o.temperature if o.sample else 1.0 for o in opts], device=dev)[:, None]
        if bool((temps != 1.0).any()):
            x = x / temps
        ks = [o.top_k if o.sample else 0 for o in opts]
        if max(ks) > 0:
            kmax = min(max(ks), self.vocab)
            k = torch.tensor(ks, device=dev)[:, None]
            kth = torch.topk(x, kmax, dim=-1).values.gather(1, (k.clamp(1, kmax) - 1))
            kth = torch.where(k > 0, kth, torch.full_like(kth, neg))
            x = x.masked_fill(x < kth, neg)
        ps = torch.tensor([o.top_p if o.sample else 1.0 for o in opts], device=dev)[:, None]
        if bool((ps < 1.0).any()):
            ordered, order = torch.sort(x, descending=False, dim=-1)
            cum = ordered.softmax(-1).cumsum(-1)
            drop = (cum <= 1 - ps) & (ps < 1.0)
            drop[..., -1:] = False
            x = x.masked_fill(drop.scatter(1, order, drop), neg)
        mps = torch.tensor([o.min_p if o.sample else 0.0 for o in opts], device=dev)[:, None]
        if bool((mps > 0).any()):
            probs = x.softmax(-1)
            drop = probs < mps * probs.amax(-1, keepdim=True)
            drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
            x = x.masked_fill(drop, neg)
        if not bool(sample.all()):
            best = x.argmax(-1, keepdim=True)
            onehot = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, best, True)
            x = torch.where(sample | onehot, x, torch.full_like(x, neg))
        return x

    def accepted(self, r: Any, j: int) -> bool:
        """Request `r` generated ``r.generated[-1]``, the `j`-th token of its step: counts
        it, records its log-probabilities; returns whether it ends the request."""
        o = self.options[r.index]
        token = r.generated[-1]
        if r.index in self.counts:
            self.counts[r.index][token] += 1
            self.seen[r.index][token] = True
        if o.logprobs is not None:
            row = self.pending[r.index][j]
            top = torch.topk(row, min(o.logprobs, self.vocab)) if o.logprobs else None
            entry = (
                dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else {}
            )
            entry[token] = float(row[token])
            self.logprobs[r.index].append(entry)
        if token in o.stop_ids:
            self.stop_reason[r.index] = token
            return True
        if len(r.generated) >= o.min_new_tokens:
            for s in o.stop_sequences:
                if len(r.generated) >= len(s) and tuple(r.generated[-len(s) :]) == s:
                    self.stop_reason[r.index] = list(s)
                    self.trim[r.index] = len(s)
                    return True
        return False
