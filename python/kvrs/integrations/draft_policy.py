"""How many tokens each request drafts at a step of speculative
[`generate_batch`][kvrs.integrations.transformers.generate_batch] (a draft model or prompt lookup):
`DraftPolicy`.

``draft_policy="schedule"`` drafts what ``num_assistant_tokens_schedule`` says (its cap,
"constant" or "heuristic"), every step. ``"adaptive"`` drafts at most that, and fewer or
none when the drafts would cost more time than the tokens they are expected to save:

- **Acceptance.** Each request keeps a per-token acceptance rate ``a`` (accepted drafts
  over drafts up to and including the first rejected one, a decayed count), so its j-th
  draft is accepted with probability about ``a**j``. Its prior is the rate of all
  requests so far (one pseudo-observation; 0.3 before any), so a new request starts
  where the workload stands. Prompt lookup keeps one rate per n-gram size matched (a
  1-gram match predicts less than a 2-gram one).
- **Cost.** Every decode step's wall time ``t`` is fitted as ``t = c0 + c1 * rows``
  (least squares over recent steps, older ones weighing less; ``rows`` the query rows
  of the target's forward). A plain step of ``n`` decode requests costs ``c0 + c1 * n``,
  i.e. ``v = (c0 + c1 * n) / n`` per token; one more draft row costs ``c1``, plus the
  draft model's measured time per drafted token (``d``, about 0 for prompt lookup).
- **Token trees.** A tree's nodes off its first candidate keep one acceptance rate of
  their own (accepted over verified, decayed); the tree merges its other candidates only
  while that rate reaches the threshold a draft must reach, else it verifies the first
  candidate alone, and the tree it did not verify is still scored for free (whether the
  model's token where the chain stopped was on another candidate).
- **Rule.** A request drafts ``j`` tokens while ``a**j * v >= c1 + d``: the j-th draft
  is expected to save more than it costs. When even the first does not pay, it drafts
  nothing, and the step costs what a plain step costs. Prompt lookup keeps learning
  for free: a request that does not draft compares its n-gram match's first token with
  the token the step generates. A draft model's request that does not draft probes one
  draft now and then instead: after 1 step, then 2, 4, ... (at most 32) while probes find
  nothing accepted, the wait shared by all requests (a new request of a workload where
  the draft has not been paying waits as long before its first probe).

Until a decode step has been timed nobody drafts. Greedy outputs never depend on the
policy; sampled ones do with a draft model (speculative sampling's draws depend on the
draft lengths), which is why ``generate_batch`` uses "schedule" there when given a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["POLICIES", "DraftPolicy"]

POLICIES = ("adaptive", "schedule")

_ACCEPT_DECAY = 0.8
"""Weight of a request's older acceptance observations after each new one."""
_TIME_DECAY = 0.95
"""Weight of older step timings after each new decode step."""
_MAX_BACKOFF = 32
"""A draft model's longest wait between probes of a request that stopped drafting."""


_PRIOR = 0.3
"""The acceptance rate assumed before anything was observed."""


@dataclass
class _Rate:
    """A decayed count of accepted and rejected drafts."""

    hits: float = 0.0
    misses: float = 0.0

    def rate(self, prior: float, weight: float = 1.0) -> float:
        return (self.hits + weight * prior) / (self.hits + self.misses + weight)

    def observe(self, hits: int, misses: int, decay: float = _ACCEPT_DECAY) -> None:
        self.hits = self.hits * decay + hits
        self.misses = self.misses * decay + misses


@dataclass
class _Request:
    rates: dict[int, _Rate] = field(default_factory=dict)  # per n-gram size (0: a draft model)
    kind: int = 0  # the n-gram size of its last draft (or watched one)
    watched: int | None = None  # prompt lookup: the first draft token it did not verify
    wait: int | None = None  # draft model: steps before its next probe
    probing: bool = False


class DraftPolicy:
    """Per-request draft lengths (see the module's docs). `mode` is "adaptive" or
    "schedule"; `probes`: whether a request that stopped drafting probes (a draft model)
    rather than being watched for free (prompt lookup)."""

    def __init__(self, mode: str = "adaptive", probes: bool = False):
        if mode not in POLICIES:
            raise ValueError(f"draft_policy={mode!r}: give 'adaptive' or 'schedule'")
        self.mode, self.probes = mode, probes
        self.requests: dict[int, _Request] = {}
        self.overall: dict[int, _Rate] = {}  # every request's drafts, per n-gram size
        # Decayed least-squares sums over decode steps: weight, rows, rows², time, rows·time.
        self.w = self.sx = self.sxx = self.sy = self.sxy = 0.0
        self.slope: float | None = None  # the last identifiable seconds per row
        self.per_row_prefill: float | None = None  # a prefill step's seconds per row
        self.prefill_rows = 0
        self.draft_per_token = 0.0  # a draft model's seconds per drafted token
        self.threshold = math.inf  # acceptance probability a draft must reach, this step
        self.backoff = 1  # a draft model: steps between probes
        self.branches = _Rate()  # token trees: their nodes off the first candidate

    # --- the cost model ---------------------------------------------------------------

    def timed(self, rows: int, seconds: float, decode: bool, draft_seconds: float, drafted: int) -> None:
        """One step's target forward: its query `rows`, its `seconds` (forward and
        verification), whether it was a decode step (no prompt rows); and the draft
        model's `draft_seconds` for its `drafted` tokens."""
        if self.mode != "adaptive" or rows < 1:
            return
        if drafted:
            per = draft_seconds / drafted
            self.draft_per_token = (
                per if self.draft_per_token == 0 else 0.7 * self.draft_per_token + 0.3 * per
            )
        if not decode:
            if rows >= self.prefill_rows:
                self.prefill_rows, self.per_row_prefill = rows, seconds / rows
            return
        fit = self.costs()
        if fit is not None and self.slope is not None:
            # A step the host stalled (other work on its cores) says nothing about rows:
            # at most twice what the fit (once it has seen different row counts) expects.
            seconds = min(seconds, 2.0 * (fit[0] + fit[1] * rows))
        g = _TIME_DECAY
        self.w = self.w * g + 1.0
        self.sx = self.sx * g + rows
        self.sxx = self.sxx * g + rows * rows
        self.sy = self.sy * g + seconds
        self.sxy = self.sxy * g + rows * seconds

    def costs(self) -> tuple[float, float] | None:
        """(seconds a step, seconds a row) of the fitted decode-step time, or None
        before a decode step was timed."""
        if self.w == 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > 0.25:
            slope = (self.sxy / self.w - mx * my) / var
            self.slope = min(max(slope, 0.0), my / max(mx, 1.0))
        slope = self.slope if self.slope is not None else (self.per_row_prefill or 0.0)
        slope = min(slope, my / max(mx, 1.0))
        return max(my - slope * mx, 0.0), slope

    def begin(self, decoding: int) -> None:
        """Sets this step's threshold for `decoding` requests in decode."""
        if self.mode != "adaptive":
            return
        fit = self.costs()
        if fit is None or decoding < 1:
            self.threshold = math.inf
            return
        fixed, per_row = fit
        value = (fixed + per_row * decoding) / decoding  # seconds a plain step spends per token
        self.threshold = (per_row + self.draft_per_token) / value if value > 0 else math.inf

    # --- per request ------------------------------------------------------------------

    def rate(self, index: int, kind: int = 0) -> float:
        """Request `index`'s acceptance rate for drafts of `kind` (an n-gram size)."""
        overall = self.overall.get(kind)
        prior = overall.rate(_PRIOR, 1.0) if overall is not None else _PRIOR
        st = self.requests.get(index)
        own = st.rates.get(kind) if st is not None else None
        return own.rate(prior) if own is not None else prior

    def length(self, index: int, cap: int, kind: int = 0) -> int:
        """How many of its up to `cap` drafts request `index` proposes this step
        (`kind`: the n-gram size its prompt-lookup match has)."""
        if self.mode != "adaptive" or cap < 1:
            return max(cap, 0)
        st = self.requests.setdefault(index, _Request())
        st.kind = kind
        k = _worth(self.rate(index, kind), self.threshold, cap)
        if k > 0:
            st.wait = None
            return k
        if not self.probes or self.threshold == math.inf:
            return 0
        if st.wait is None:
            st.wait = self.backoff
        if st.wait > 0:
            st.wait -= 1
            return 0
        st.wait, st.probing = self.backoff, True
        return 1

    def watch(self, index: int, token: int) -> None:
        """Request `index` does not draft this step (after `length` said 0); its
        first draft would be `token`."""
        if self.mode == "adaptive":
            self.requests.setdefault(index, _Request()).watched = token

    def verified(self, index: int, proposed: int, accepted: int) -> None:
        """Request `index`'s `proposed` drafts were verified, `accepted` of them kept."""
        st = self.requests.setdefault(index, _Request())
        self._observe(st, accepted, 1 if accepted < proposed else 0)
        if st.probing:
            st.probing = False
            self.backoff = max(1, self.backoff // 2) if accepted else min(2 * self.backoff, _MAX_BACKOFF)

    def generated(self, index: int, token: int) -> None:
        """Request `index` generated `token` at a step it only watched."""
        st = self.requests.get(index)
        if st is not None and st.watched is not None:
            self._observe(st, int(token == st.watched), int(token != st.watched))
            st.watched = None

    def tree_width(self, width: int) -> int:
        """How many candidates a token tree merges this step, of at most `width`: all of
        them while a node off the first candidate is accepted often enough to pay for
        its row (the rule a draft follows), else 1 (the chain)."""
        if self.mode != "adaptive" or width <= 1:
            return width
        return width if self.branches.rate(_PRIOR) >= self.threshold else 1

    def branched(self, off: int, accepted: int) -> None:
        """A token tree's `off` nodes off its first candidate were verified (or, for a
        tree verified as its chain, would have been), `accepted` of them kept."""
        if self.mode == "adaptive" and off > 0:
            self.branches.observe(accepted, off - accepted)

    def _observe(self, st: _Request, hits: int, misses: int) -> None:
        st.rates.setdefault(st.kind, _Rate()).observe(hits, misses)
        self.overall.setdefault(st.kind, _Rate()).observe(hits, misses, 0.95)

    def forget(self, index: int) -> None:
        self.requests.pop(index, None)


def _worth(rate: float, threshold: float, cap: int) -> int:
    """The largest j <= cap with rate**j >= threshold (0 when none)."""
    if threshold <= 0:
        return cap
    if rate <= 0 or threshold == math.inf or rate < threshold:
        return 0
    if rate >= 1:
        return cap
    return min(cap, int(math.log(threshold) / math.log(rate) + 1e-9))
