"""Hypothesis state machine over many sequences of one BlockPool, against NumPy references.

Random interleavings of new, append, advance, reserve + write, fork, copy_prefix,
truncate, remove, free and batched forwards under memory pressure (a small pool). After
every step: every live sequence's K/V equals its reference, block tables and reference
counts are consistent (check_invariants), free + used == total, and tokens_stored /
fragmentation_tokens equal the distinct (block, offset) slots the sequences hold.

The mixed machines rerun all of it on pools whose layers are full, sliding-window or
chunked: the reference also tracks the first position each layer must still hold, so
each layer's contents, the released blocks, the window masks, which batches may continue
(can_resume) and the bounded memory of windowed layers are checked after every step.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvrs
from conftest import quantized

H, D, BS = 2, 2, 4


class Ref:
    """A sequence's reference: per layer, the list of [H, D] tokens of every position it
    wrote, and the first position the layer still holds."""

    def __init__(self, num_layers):
        self.k = [[] for _ in range(num_layers)]
        self.v = [[] for _ in range(num_layers)]
        self.start = [0] * num_layers
        self.seq_len = 0

    def copy(self):
        r = Ref(len(self.k))
        r.k = [list(x) for x in self.k]
        r.v = [list(x) for x in self.v]
        r.start = list(self.start)
        r.seq_len = self.seq_len
        return r

    def held(self):
        return max(len(x) for x in self.k)

    def cut(self, n):
        self.seq_len = min(self.seq_len, n)
        for layer in range(len(self.k)):
            del self.k[layer][n:]
            del self.v[layer][n:]
            self.start[layer] = min(self.start[layer], len(self.k[layer]))

    def uniform(self):
        return len({len(x) for x in self.k}) == 1


def tokens(seed, n):
    x = (np.random.default_rng(seed).integers(-32, 33, (n, H, D)) / 4).astype(np.float32)
    return x


class PoolMachine(RuleBasedStateMachine):
    layout = "NHD"
    dtype = "float16"
    layer_types = ("full", "full")
    window, chunk, swa_memory = None, None, 0
    blocks = 12
    k_scale = v_scale = None

    def __init__(self):
        super().__init__()
        self.pool = kvrs.BlockPool(
            len(self.layer_types),
            H,
            D,
            block_size=BS,
            num_blocks=self.blocks,
            dtype=self.dtype,
            layout=self.layout,
            layer_types=list(self.layer_types),
            sliding_window=self.window,
            chunk_size=self.chunk,
            swa_memory=self.swa_memory,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        self.L = len(self.layer_types)
        self.eight_bit = self.dtype in ("int8", "fp8_e4m3", "fp8_e5m2")
        # One layer per block table.
        self.group_layers = {self.pool.layer_group(i): i for i in reversed(range(self.L))}
        self.live: list[tuple[kvrs.Sequence, Ref]] = []

    def pick(self, i):
        return self.live[i % len(self.live)]

    def stored(self, x, scale):
        """What the pool holds after a write of `x`: `x` itself, or its 8-bit round trip."""
        return quantized(x, self.dtype, 1.0 if scale is None else scale)

    def first_visible(self, layer, pos):
        kind = self.layer_types[layer]
        if kind == "sliding":
            return max(0, pos + 1 - self.window)
        if kind == "chunked":
            return pos // self.chunk * self.chunk
        return 0

    def committed(self, ref):
        """Windowed layers release the whole blocks no future token sees."""
        for layer, kind in enumerate(self.layer_types):
            if kind != "full":
                keep = self.first_visible(layer, ref.seq_len)
                if kind == "sliding":
                    keep = max(0, keep - self.swa_memory)
                ref.start[layer] = min(max(ref.start[layer], keep // BS * BS), len(ref.k[layer]))

    def resumable(self, ref, pos):
        return all(
            self.first_visible(layer, pos) >= pos or ref.start[layer] <= self.first_visible(layer, pos)
            for layer in range(self.L)
        )

    def needed(self, seq, start, end, layers=None):
        """Blocks a write of positions start..end of `layers` (default: all) takes: new ones
        (past a table or where a block was released) plus copies of shared ones."""
        if start >= end:
            return 0
        refs = {}
        for s, _ in self.live:
            for rep in self.group_layers.values():
                for b in s.layer_blocks(rep):
                    refs[int(b)] = refs.get(int(b), 0) + 1
        groups = {self.pool.layer_group(i) for i in (range(self.L) if layers is None else layers)}
        total = 0
        for g in groups:
            table = list(seq.layer_blocks(self.group_layers[g]))
            total += max(0, -(-end // BS) - len(table))
            total += sum(
                1
                for i in range(start // BS, min(-(-end // BS), len(table)))
                if table[i] == -1 or refs[table[i]] > 1
            )
        return total

    @rule()
    def new(self):
        self.live.append((self.pool.new_sequence(), Ref(self.L)))

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
        self.committed(r)
        self.live[[s for s, _ in self.live].index(b)] = (b, r)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), layer=st.integers(0, 7), n=st.integers(0, 6), seed=st.integers(0, 999))
    def append(self, i, layer, n, seed):
        seq, ref = self.pick(i)
        layer %= self.L
        start = len(ref.k[layer])
        k, v = tokens(seed, n), tokens(seed + 1, n)
        if self.needed(seq, start, start + n, [layer]) > self.pool.free_blocks:
            try:
                seq.append(layer, k, v)
            except kvrs.CacheFullError:
                return
            raise AssertionError("append should have been refused")
        assert seq.append(layer, k, v) == start
        ref.k[layer].extend(self.stored(k, self.k_scale))
        ref.v[layer].extend(self.stored(v, self.v_scale))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), n=st.integers(0, 4))
    def advance(self, i, n):
        seq, ref = self.pick(i)
        if all(len(x) >= ref.seq_len + n for x in ref.k):
            seq.advance(n)
            ref.seq_len += n
            self.committed(ref)
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
        if forward:
            ok = ok and all(self.resumable(r, r.held()) for _, r, _ in chosen)
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
        for layer in range(self.L):
            k, v = tokens(seed + layer, n), tokens(seed + 7 + layer, n)
            if forward:
                batch.put(layer, k, v)
            else:
                row = slots if slots.ndim == 1 else slots[self.pool.layer_group(layer)]
                self.pool.write(layer, k, v, row)
            k, v = self.stored(k, self.k_scale), self.stored(v, self.v_scale)
            for t, (_, r, _) in enumerate(order):
                r.k[layer].append(k[t])
                r.v[layer].append(v[t])
        if forward:
            for layer in range(self.L):
                self.check_batch_get(batch, layer, chosen, order)
            if commit:
                batch.finish()
                for _, r, _ in chosen:
                    r.seq_len = r.held()
                    self.committed(r)
            else:
                batch.cancel()
                for _, r, c in chosen:
                    r.cut(r.held() - c)

    def check_batch_get(self, batch, layer, chosen, order):
        """batch.get(layer): each sequence's held positions, and the layer's mask rule."""
        K, _, mask = batch.get(layer)
        offsets, off = {}, 0
        for s, r, _ in chosen:
            first = r.start[layer]
            offsets[id(s)] = (off, first)
            np.testing.assert_array_equal(
                K[:, off : off + r.held() - first].astype(np.float32),
                np.array(r.k[layer][first:]).transpose(1, 0, 2),
            )
            off += r.held() - first
        assert batch.history_len(layer) == off
        for t, (s, _, pos) in enumerate(order):
            o, first = offsets[id(s)]
            lo = max(self.first_visible(layer, pos), first)
            visible = np.zeros(off, bool)
            visible[o + lo - first : o + pos - first + 1] = True
            assert ((mask[t] == 0) == visible).all()

    @invariant()
    def matches_reference(self):
        self.pool.check_invariants()
        slots = set()
        for seq, ref in self.live:
            assert seq.seq_len == ref.seq_len
            for layer in range(self.L):
                first, length = ref.start[layer], len(ref.k[layer])
                assert seq.layer_len(layer) == length
                assert seq.layer_start(layer) == first
                K, V = seq.get(layer, dequantize=self.eight_bit)
                assert K.shape[1] == length - first
                if length > first:
                    np.testing.assert_array_equal(
                        K.astype(np.float32), np.array(ref.k[layer][first:]).transpose(1, 0, 2)
                    )
                    np.testing.assert_array_equal(
                        V.astype(np.float32), np.array(ref.v[layer][first:]).transpose(1, 0, 2)
                    )
                table = seq.layer_blocks(layer)
                slots.update((int(table[p // BS]), p % BS) for p in range(first, length))
                kind = self.layer_types[layer]
                if kind != "full" and ref.seq_len == seq.seq_len and first > 0:
                    # Windowed layers stay bounded: window (or chunk), memory, a block, and
                    # what is not committed yet.
                    span = max(self.window or 0, self.chunk or 0) + self.swa_memory + BS
                    assert length - first <= span + (length - ref.seq_len)
            assert seq.can_resume(ref.seq_len) == self.resumable(ref, ref.seq_len)
        s = self.pool.stats()
        assert s["free_blocks"] + s["used_blocks"] == self.blocks
        assert s["tokens_stored"] == len(slots)
        assert s["fragmentation_tokens"] == s["used_blocks"] * BS - len(slots)


class HndFloat32Machine(PoolMachine):
    layout = "HND"
    dtype = "float32"


class SlidingMachine(PoolMachine):
    """Two block tables, each block id holding one block of two layers."""

    layer_types = ("sliding", "full", "sliding", "full")
    window, swa_memory = 3, 1
    blocks = 16


class ChunkedMachine(PoolMachine):
    """Three block tables (two chunked layers, one full), HND."""

    layout = "HND"
    dtype = "float32"
    layer_types = ("chunked", "full", "chunked")
    chunk = 4
    blocks = 18


class Int8Machine(PoolMachine):
    """int8 with a scale per token and head: copies, forks and copy-on-write carry them."""

    dtype = "int8"


class Fp8SlidingMachine(SlidingMachine):
    """fp8 E4M3 with different K and V scales, HND, sliding and full layers."""

    layout = "HND"
    dtype = "fp8_e4m3"
    k_scale, v_scale = 0.25, 2.0


SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestNhdFloat16Pool = PoolMachine.TestCase
TestNhdFloat16Pool.settings = SETTINGS
TestHndFloat32Pool = HndFloat32Machine.TestCase
TestHndFloat32Pool.settings = SETTINGS
TestSlidingPool = SlidingMachine.TestCase
TestSlidingPool.settings = SETTINGS
TestChunkedPool = ChunkedMachine.TestCase
TestChunkedPool.settings = SETTINGS
TestInt8Pool = Int8Machine.TestCase
TestInt8Pool.settings = SETTINGS
TestFp8SlidingPool = Fp8SlidingMachine.TestCase
TestFp8SlidingPool.settings = SETTINGS
