"""Hypothesis state machine over many sequences of one BlockPool, against NumPy references.

Random interleavings of new, append, advance, reserve + write, fork, copy_prefix,
truncate, remove, free and batched forwards under memory pressure (a small pool). After
every step: every live sequence's K/V equals its reference, block tables and reference
counts are consistent (check_invariants), free + used == total, and tokens_stored /
fragmentation_tokens equal the distinct (block, offset) slots the sequences hold.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvrs

L, H, D, BS, BLOCKS = 2, 2, 2, 4, 12
TOKEN = H * D


class Ref:
    """A sequence's reference: per layer, the list of [H, D] tokens it holds."""

    def __init__(self):
        self.k = [[] for _ in range(L)]
        self.v = [[] for _ in range(L)]
        self.seq_len = 0

    def copy(self):
        r = Ref()
        r.k = [list(x) for x in self.k]
        r.v = [list(x) for x in self.v]
        r.seq_len = self.seq_len
        return r

    def held(self):
        return max(len(x) for x in self.k)

    def cut(self, n):
        self.seq_len = min(self.seq_len, n)
        for layer in range(L):
            del self.k[layer][n:]
            del self.v[layer][n:]

    def uniform(self):
        return len({len(x) for x in self.k}) == 1


def tokens(seed, n):
    x = (np.random.default_rng(seed).integers(-32, 33, (n, H, D)) / 4).astype(np.float32)
    return x


class PoolMachine(RuleBasedStateMachine):
    layout = "NHD"
    dtype = "float16"

    def __init__(self):
        super().__init__()
        self.pool = kvrs.BlockPool(
            L, H, D, block_size=BS, num_blocks=BLOCKS, dtype=self.dtype, layout=self.layout
        )
        self.live: list[tuple[kvrs.Sequence, Ref]] = []

    def pick(self, i):
        return self.live[i % len(self.live)]

    def needed(self, seq, start, end):
        """Blocks a write of positions start..end takes: new ones plus copies of shared ones."""
        if start >= end:
            return 0
        table = list(seq.block_table)
        grow = max(0, -(-end // BS) - len(table))
        refs = {}
        for s, _ in self.live:
            for b in s.block_table:
                refs[b] = refs.get(b, 0) + 1
        shared = sum(1 for i in range(start // BS, min(-(-end // BS), len(table))) if refs[table[i]] > 1)
        return grow + shared

    @rule()
    def new(self):
        self.live.append((self.pool.new_sequence(), Ref()))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def free(self, i):
        seq, _ = self.live.pop(i % len(self.live))
        seq.free()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def fork(self, i):
        seq, ref = self.pick(i)
        self.live.append((seq.fork(), ref.copy()))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), j=st.integers(0, 20), n=st.integers(0, 10))
    def copy_prefix(self, i, j, n):
        (a, ra), (b, _) = self.pick(i), self.pick(j)
        if a is b or n > ra.seq_len:
            try:
                self.pool.copy_prefix(a, b, n)
            except ValueError:
                return
            raise AssertionError("copy_prefix should have failed")
        self.pool.copy_prefix(a, b, n)
        r = ra.copy()
        r.cut(n)
        r.seq_len = n
        self.live[[s for s, _ in self.live].index(b)] = (b, r)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), layer=st.integers(0, L - 1), n=st.integers(0, 6), seed=st.integers(0, 999))
    def append(self, i, layer, n, seed):
        seq, ref = self.pick(i)
        start = len(ref.k[layer])
        k, v = tokens(seed, n), tokens(seed + 1, n)
        if self.needed(seq, start, start + n) > self.pool.free_blocks:
            try:
                seq.append(layer, k, v)
            except kvrs.CacheFullError:
                return
            raise AssertionError("append should have been refused")
        assert seq.append(layer, k, v) == start
        ref.k[layer].extend(k)
        ref.v[layer].extend(v)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), n=st.integers(0, 4))
    def advance(self, i, n):
        seq, ref = self.pick(i)
        if all(len(x) >= ref.seq_len + n for x in ref.k):
            seq.advance(n)
            ref.seq_len += n
        else:
            try:
                seq.advance(n)
            except ValueError:
                return
            raise AssertionError("advance should have failed")

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), n=st.integers(0, 12))
    def truncate(self, i, n):
        seq, ref = self.pick(i)
        seq.truncate(n)
        if n < ref.seq_len:
            ref.cut(n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), begin=st.integers(0, 12))
    def remove_tail(self, i, begin):
        seq, ref = self.pick(i)
        seq.remove(begin)
        if begin < ref.held():
            ref.cut(begin)

    @precondition(lambda self: self.live)
    @rule(
        picks=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 4)), min_size=1, max_size=3),
        seed=st.integers(0, 999),
        forward=st.booleans(),
        commit=st.booleans(),
    )
    def batch(self, picks, seed, forward, commit):
        """reserve + write (forward=False) or start_forward + put + get (forward=True)."""
        chosen = []
        for i, c in picks:
            seq, ref = self.pick(i)
            if all(seq is not s for s, _, _ in chosen):
                chosen.append((seq, ref, c))
        needed = sum(self.needed(s, r.held(), r.held() + c) for s, r, c in chosen)
        ok = all(r.uniform() for _, r, _ in chosen) and needed <= self.pool.free_blocks
        order = [(s, r, r.held() + j) for s, r, c in chosen for j in range(c)]
        n = len(order)
        try:
            if forward:
                batch = self.pool.start_forward([s for s, _, _ in order], [p for _, _, p in order])
                slots = batch.slot_mapping
            else:
                slots = self.pool.reserve([s for s, _, _ in chosen], [c for _, _, c in chosen])
        except (ValueError, kvrs.CacheFullError):
            assert not ok
            return
        assert ok
        for layer in range(L):
            k, v = tokens(seed + layer, n), tokens(seed + 7 + layer, n)
            if forward:
                batch.put(layer, k, v)
            else:
                self.pool.write(layer, k, v, slots)
            for t, (_, r, _) in enumerate(order):
                r.k[layer].append(k[t])
                r.v[layer].append(v[t])
        if forward:
            K, _, mask = batch.get(L - 1)
            offsets, off = {}, 0
            for s, r, _ in chosen:
                offsets[id(s)] = off
                np.testing.assert_array_equal(
                    K[:, off : off + r.held()].astype(np.float32), np.array(r.k[L - 1]).transpose(1, 0, 2)
                )
                off += r.held()
            for t, (s, _, pos) in enumerate(order):
                visible = np.zeros(off, bool)
                visible[offsets[id(s)] : offsets[id(s)] + pos + 1] = True
                assert ((mask[t] == 0) == visible).all()
            if commit:
                batch.finish()
                for _, r, _ in chosen:
                    r.seq_len = r.held()
            else:
                batch.cancel()
                for _, r, c in chosen:
                    r.cut(r.held() - c)

    @invariant()
    def matches_reference(self):
        self.pool.check_invariants()
        slots = set()
        for seq, ref in self.live:
            assert seq.seq_len == ref.seq_len
            for layer in range(L):
                assert seq.layer_len(layer) == len(ref.k[layer])
                K, V = seq.get(layer)
                if ref.k[layer]:
                    np.testing.assert_array_equal(
                        K.astype(np.float32), np.array(ref.k[layer]).transpose(1, 0, 2)
                    )
                    np.testing.assert_array_equal(
                        V.astype(np.float32), np.array(ref.v[layer]).transpose(1, 0, 2)
                    )
            table = seq.block_table
            slots.update((int(table[p // BS]), p % BS) for p in range(ref.held()))
        s = self.pool.stats()
        assert s["free_blocks"] + s["used_blocks"] == BLOCKS
        assert s["tokens_stored"] == len(slots)
        assert s["fragmentation_tokens"] == s["used_blocks"] * BS - len(slots)


class HndFloat32Machine(PoolMachine):
    layout = "HND"
    dtype = "float32"


SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestNhdFloat16Pool = PoolMachine.TestCase
TestNhdFloat16Pool.settings = SETTINGS
TestHndFloat32Pool = HndFloat32Machine.TestCase
TestHndFloat32Pool.settings = SETTINGS
