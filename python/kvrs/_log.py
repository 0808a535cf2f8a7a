"""The ``kvrs`` logger, and what kvrs reports through it.

kvrs logs as libraries do: to ``logging.getLogger("kvrs")``, which has a
``NullHandler`` and nothing else, so nothing is printed unless the application
configures logging (``logging.basicConfig(level=logging.WARNING)`` shows kvrs's
warnings; ``logging.getLogger("kvrs").setLevel(logging.DEBUG)`` narrows it to kvrs).

An offload tier never fails generation: a server that is down, a full disk or a payload
that fails its checks is a miss or a dropped write, counted in ``BlockPool.stats()``.
`TierWatch` turns new counts into log records: each cause (a tier's failed
requests, its rejected payloads, the write-back queue's dropped payloads, payloads no
tier stored) at most once a minute, with the tier's name, the error when the tier
reports one, and how many happened since the cause was last reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import Any

logger = logging.getLogger("kvrs")
logger.addHandler(logging.NullHandler())

#: Seconds between two records of the same cause.
INTERVAL = 60.0

#: When each cause was last logged (time.monotonic()).
_last: dict[Hashable, float] = {}


def log_limited(cause: Hashable, level: int, msg: str, *args: Any) -> bool:
    """Logs `msg` % `args` at `level` unless `cause` was logged less than
    `INTERVAL` seconds ago; returns whether it logged."""
    now = time.monotonic()
    last = _last.get(cause)
    if last is not None and now - last < INTERVAL:
        return False
    _last[cause] = now
    logger.log(level, msg, *args)
    return True


#: What a tier's counters mean, for the records (counter, cause, what happened).
_TIER_CAUSES = (
    (
        "errors",
        "failed requests (lookups missed, stores went to the next tier or were dropped)",
    ),
    (
        "rejected",
        "payloads failed their checks and were discarded (another pool's secret or model, or corrupted data)",
    ),
)

#: The reason a tier's errors happen, when the tier does not report its last error.
_TIER_REASONS = {
    "redis": "the server is down, unreachable or slower than the tier's timeout; the tier is "
    "retried after its retry_after",
    "disk": "an I/O error or a full disk",
}

#: The write-back queue's counters: (counter, what happened, what to do).
_QUEUE_CAUSES = (
    (
        "dropped",
        "evicted blocks were dropped, not offloaded: the write-back queue was full",
        "give the pool a larger tier_queue / tier_queue_bytes, or a faster tier",
    ),
    (
        "unstored",
        "blocks written to the tiers were stored by no tier (each refused or failed them)",
        "see the tiers' errors, or give a disk tier more room",
    ),
)


class TierWatch:
    """Logs what a pool's tiers counted since it last looked: `check` compares
    ``pool.stats()`` with the counts it saw before (zero when made: nothing the pool's
    tiers counted is lost) and logs every cause that grew, each at most once a minute
    (counts of a suppressed record are carried into the next one)."""

    def __init__(self, pool: Any, every: float = 1.0):
        self.pool = pool
        self.every = every
        self.seen: dict[tuple[str, ...], int] = {}
        self.unreported: dict[tuple[str, ...], int] = {}
        self.checked = float("-inf")

    def check(self, force: bool = False) -> None:
        """Reads the pool's stats (at most once per `every` seconds unless `force`) and
        logs what grew; a pool without tiers costs one stats() call."""
        now = time.monotonic()
        if not force and now - self.checked < self.every:
            return
        self.checked = now
        stats = self.pool.stats()
        tiers = stats.get("tiers")
        if not tiers:
            return
        for tier in tiers:
            name = str(tier.get("name", "?"))
            for counter, what in _TIER_CAUSES:
                new = self._grown(("tier", name, counter), int(tier.get(counter, 0)))
                if not new:
                    continue
                why = tier.get("last_error") or next(
                    (text for kind, text in _TIER_REASONS.items() if name.startswith(kind)), None
                )
                self._log(
                    ("tier", name, counter),
                    new,
                    "kvrs tier %s: %d %s%s",
                    name,
                    new,
                    what,
                    f": {why}" if why and counter == "errors" else "",
                )
        queue = stats.get("tier_queue") or {}
        for counter, what, todo in _QUEUE_CAUSES:
            key = ("tier_queue", counter)
            new = self._grown(key, int(queue.get(counter, 0)))
            if new:
                self._log(key, new, "kvrs tiers: %d %s; %s", new, what, todo)

    def _grown(self, key: tuple[str, ...], count: int) -> int:
        """How much `key`'s counter grew since the last look, plus what earlier records
        left unreported."""
        grown = count - self.seen.get(key, 0)
        self.seen[key] = count
        return max(grown, 0) + self.unreported.get(key, 0)

    def _log(self, key: tuple[str, ...], new: int, msg: str, *args: Any) -> None:
        if log_limited(key, logging.WARNING, msg, *args):
            self.unreported.pop(key, None)
        else:
            self.unreported[key] = new
