"""Hypothesis state machine: prefix caching from Python, under memory pressure.

Sequences start from prompts sharing a preamble, are prefilled, decoded (tiny
vocabularies, so chains collide), batched, forked, truncated and freed while a small pool
evicts; the same machines run with offload tiers below the pool (a small DiskTier that
evicts too, and a real Redis server whose payloads a rule corrupts), so blocks leave and
come back. K/V at position p is a function of the token ids up to p, as a model's would be,
so every live sequence's K/V must equal that function of its ids whatever was shared,
copied for a partial hit or evicted. Invariants are checked after every step.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvrs
from conftest import quantized

L, H, D, BS, BLOCKS = 2, 2, 2, 4, 14


def kv_of(tokens, start, n):
    out = np.empty((n, H, D), np.float32)
    for i, p in enumerate(range(start, start + n)):
        out[i] = np.random.default_rng(hash(tuple(tokens[: p + 1])) % 2**32).integers(-32, 33, (H, D)) / 4
    return out


class PrefixMachine(RuleBasedStateMachine):
    dtype = "float32"

    def __init__(self):
        super().__init__()
        self.pool = kvrs.BlockPool(
            L,
            H,
            D,
            block_size=BS,
            num_blocks=BLOCKS,
            dtype=self.dtype,
            seed=5,
            tiers=self.tiers(),
            model_id="m",
        )
        self.live: list[tuple[kvrs.Sequence, list[int]]] = []

    def tiers(self) -> list | None:
        """The offload tiers below the pool (none here)."""
        return None

    def extend(self, seq, tokens, n):
        """Computes positions seq_len..seq_len+n of `tokens` and commits them; False if full."""
        start = seq.seq_len
        k = kv_of(tokens, start, n)
        try:
            seq.append(0, k, -k)
        except kvrs.CacheFullError:
            return False
        seq.append(1, k, -k)  # the blocks exist now: no other layer allocates
        seq.advance(n, tokens=tokens[start : start + n])
        return True

    @rule(shared=st.integers(0, 16), suffix=st.lists(st.integers(100, 102), max_size=5))
    def new(self, shared, suffix):
        tokens = list(range(1, shared + 1)) + suffix
        expect = self.pool.match_prefix(tokens)
        seq = self.pool.new_sequence(tokens=tokens)
        got = seq.num_cached_tokens
        assert got < max(len(tokens), 1)
        by_tier = seq.cached_tokens_by_tier
        assert sum(by_tier.values()) == got and by_tier["pool"] <= got
        if self.tiers():
            # Tiers add whole blocks past the pool's hit (whose partial block a load may evict).
            assert got > expect - BS
        else:
            assert got == expect or (got % BS == 0 and expect - BS < got <= expect)
        self.live.append((seq, tokens))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def prefill(self, i):
        seq, tokens = self.live[i % len(self.live)]
        if seq.seq_len < len(tokens):
            self.extend(seq, tokens, len(tokens) - seq.seq_len)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), new=st.lists(st.integers(200, 201), min_size=1, max_size=4))
    def decode(self, i, new):
        j = i % len(self.live)
        seq, tokens = self.live[j]
        if seq.seq_len == len(tokens) and self.extend(seq, tokens + new, len(new)):
            self.live[j] = (seq, tokens + new)

    @precondition(lambda self: self.live)
    @rule(
        picks=st.lists(st.integers(0, 20), min_size=1, max_size=3),
        ids=st.lists(st.integers(300, 301), min_size=3, max_size=3),
        commit=st.booleans(),
    )
    def batch(self, picks, ids, commit):
        chosen = []
        for i in picks:
            j = i % len(self.live)
            seq, tokens = self.live[j]
            if j not in chosen and seq.seq_len == len(tokens):
                chosen.append(j)
        if not chosen:
            return
        seqs = [self.live[j][0] for j in chosen]
        new = ids[: len(chosen)]
        try:
            batch = self.pool.start_forward(seqs, [s.seq_len for s in seqs], tokens=new)
        except kvrs.CacheFullError:
            return
        extended = [self.live[j][1] + [t] for j, t in zip(chosen, new, strict=True)]
        for layer in range(L):
            k = np.concatenate([kv_of(t, len(t) - 1, 1) for t in extended])
            batch.put(layer, k, -k)
        if commit:
            batch.finish()
            for j, t in zip(chosen, extended, strict=True):
                self.live[j] = (self.live[j][0], t)
        else:
            batch.cancel()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def fork(self, i):
        seq, tokens = self.live[i % len(self.live)]
        self.live.append((seq.fork(), list(tokens)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def free(self, i):
        seq, _ = self.live.pop(i % len(self.live))
        seq.free()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), n=st.integers(0, 20))
    def truncate(self, i, n):
        j = i % len(self.live)
        seq, tokens = self.live[j]
        if n < seq.seq_len:
            seq.truncate(n)
            self.live[j] = (seq, tokens[:n])

    @rule(shared=st.integers(0, 16), unpin=st.booleans())
    def pin(self, shared, unpin):
        tokens = list(range(1, shared + 1))
        (self.pool.unpin if unpin else self.pool.pin)(tokens)

    @precondition(lambda self: self.tiers())
    @rule(shared=st.integers(0, 16), wait=st.booleans())
    def prefetch(self, shared, wait):
        """Loads a prefix from the tiers now, or fetches it in the background for a later
        lookup (which checks what was fetched like any payload)."""
        tokens = list(range(1, shared + 1))
        got = self.pool.prefetch(tokens, wait=wait)
        assert 0 <= got <= shared
        if not wait:
            assert got % BS == 0

    @rule()
    def evict_all(self):
        before = self.pool.stats()
        assert self.pool.evict_all() == before["evictable_blocks"]
        self.pool.flush_tiers()

    @invariant()
    def contents_follow_the_tokens(self):
        self.pool.check_invariants()
        for seq, tokens in self.live:
            n = seq.seq_len
            assert list(seq.token_ids[:n]) == tokens[:n]
            for layer in range(L):
                held = seq.layer_len(layer)
                if held:
                    K, V = seq.get(layer, dequantize=True)
                    k = kv_of(tokens, 0, held)
                    want_k, want_v = quantized(k, self.dtype), quantized(-k, self.dtype)
                    np.testing.assert_array_equal(K, want_k.transpose(1, 0, 2))
                    np.testing.assert_array_equal(V, want_v.transpose(1, 0, 2))
        st_ = self.pool.stats()
        assert st_["free_blocks"] + st_["used_blocks"] == BLOCKS


TestPrefixCaching = PrefixMachine.TestCase
TestPrefixCaching.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


class Int8PrefixMachine(PrefixMachine):
    """The same with int8 blocks: each block's scales go wherever its codes go."""

    dtype = "int8"


TestInt8PrefixCaching = Int8PrefixMachine.TestCase
TestInt8PrefixCaching.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class DiskTierPrefixMachine(PrefixMachine):
    """The same with a DiskTier of a few blocks below the pool: evicted blocks go to disk
    (which evicts its own least recently used) and come back to later prompts."""

    def tiers(self):
        if not hasattr(self, "dir"):
            self.dir = tempfile.mkdtemp(prefix="kvrs-machine-")
            self.disk = kvrs.DiskTier(self.dir, 3000)  # about 7 blocks
        return [self.disk]

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)


TestDiskTierPrefixCaching = DiskTierPrefixMachine.TestCase
TestDiskTierPrefixCaching.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


REDIS: dict[str, object] = {}


@pytest.fixture(autouse=True)
def _redis_for_the_machines(redis_url, redis_server):
    REDIS["url"], REDIS["client"] = redis_url, redis_server.client()


class RedisTierPrefixMachine(PrefixMachine):
    """The same with a real Redis server below the pool, whose stored payloads a rule
    corrupts (bit flips, truncation): a corrupted block is refused, never loaded."""

    def tiers(self):
        if not hasattr(self, "redis"):
            self.redis = kvrs.RedisTier(str(REDIS["url"]))
        return [self.redis]

    @rule(pick=st.integers(0, 1000), at=st.integers(0, 1000), truncate=st.booleans())
    def corrupt(self, pick, at, truncate):
        client = REDIS["client"]
        keys = sorted(client.keys("kvrs:*"))
        if keys:
            key = keys[pick % len(keys)]
            raw = bytearray(client.get(key) or b"")
            if raw:
                raw = raw[: at % len(raw)] if truncate else raw
                if not truncate:
                    raw[at % len(raw)] ^= 0x40
                client.set(key, bytes(raw))


TestRedisTierPrefixCaching = RedisTierPrefixMachine.TestCase
TestRedisTierPrefixCaching.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
