"""Hypothesis state machine: random KVCache operations from Python against a NumPy model.

Values are multiples of 1/4 in [-8, 8], exact in every float storage dtype, so the
comparison is exact; the 8-bit machines compare with the NumPy reference quantizers'
round trip of each written vector. Invalid operations (bad layer, head, position,
overfull appends, uncommitted advances) are generated too: the cache must raise and the
model stays as it was.
"""

from __future__ import annotations

from typing import ClassVar

import ml_dtypes
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvrs
from conftest import quantized

L, H, D, MAX = 3, 2, 4, 12
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

layers = st.integers(-1, L)
exact = st.integers(-32, 32).map(lambda x: x / 4)


def arrays(shape):
    n = int(np.prod(shape))
    return st.lists(exact, min_size=n, max_size=n).map(lambda xs: np.array(xs, np.float32).reshape(shape))


class KVCacheMachine(RuleBasedStateMachine):
    dtype = "float32"
    scales: ClassVar[dict[str, float]] = {"key": 1.0, "value": 1.0}

    def __init__(self):
        super().__init__()
        self.eight_bit = self.dtype not in NP
        kw = {"k_scale": self.scales["key"], "v_scale": self.scales["value"]} if "fp8" in self.dtype else {}
        self.cache = kvrs.KVCache(L, H, D, MAX, dtype=self.dtype, **kw)
        self.k = np.zeros((L, H, MAX, D), np.float32)
        self.v = np.zeros((L, H, MAX, D), np.float32)
        self.seq_len = 0
        self.layer_len = [0] * L

    def input(self, x):
        """Hands the cache the exact values in the storage dtype (float32 for 8-bit)."""
        return x.astype(NP[self.dtype]) if self.dtype in NP and self.dtype != "float32" else x

    def stored(self, x, kv):
        """What the cache holds after a write of `x`: `x`, or its 8-bit round trip."""
        return quantized(x, self.dtype, self.scales[kv])

    @rule(data=st.data(), layer=layers, n=st.integers(0, 5))
    def append(self, data, layer, n):
        k = data.draw(arrays((n, H, D)))
        v = data.draw(arrays((n, H, D)))
        valid = 0 <= layer < L
        if valid and self.layer_len[layer] + n <= MAX:
            start = self.layer_len[layer]
            assert self.cache.append(layer, self.input(k), self.input(v)) == start
            self.k[layer, :, start : start + n] = self.stored(k, "key").transpose(1, 0, 2)
            self.v[layer, :, start : start + n] = self.stored(v, "value").transpose(1, 0, 2)
            self.layer_len[layer] += n
        else:
            exc = kvrs.CacheFullError if valid else IndexError
            try:
                self.cache.append(layer, k, v)
            except exc:
                pass
            else:
                raise AssertionError("append should have failed")

    @rule(n=st.integers(-1, 4))
    def advance(self, n):
        if n >= 0 and all(ll >= self.seq_len + n for ll in self.layer_len):
            self.cache.advance(n)
            self.seq_len += n
        else:
            try:
                self.cache.advance(n)
            except ValueError:
                pass
            else:
                raise AssertionError("advance should have failed")

    @rule(
        data=st.data(),
        kv=st.sampled_from(["key", "value"]),
        layer=layers,
        head=st.integers(-1, H),
        pos=st.integers(-1, MAX),
    )
    def store(self, data, kv, layer, head, pos):
        x = data.draw(arrays((D,)))
        call = self.cache.store_key if kv == "key" else self.cache.store_value
        if 0 <= layer < L and 0 <= head < H and 0 <= pos < MAX:
            call(layer, head, pos, x)
            # The layer now holds pos; positions it brings in start as zeros.
            held = self.layer_len[layer]
            self.k[layer, :, held : pos + 1] = 0
            self.v[layer, :, held : pos + 1] = 0
            self.layer_len[layer] = max(held, pos + 1)
            (self.k if kv == "key" else self.v)[layer, head, pos] = self.stored(x, kv)
        else:
            try:
                call(layer, head, pos, x)
            except IndexError:  # a layer, head or position out of range, pos == MAX included
                pass
            else:
                raise AssertionError("store should have failed")

    @rule(n=st.integers(0, MAX + 2))
    def truncate(self, n):
        self.cache.truncate(n)
        if n < self.seq_len:
            self.seq_len = n
            self.layer_len = [min(ll, n) for ll in self.layer_len]

    @rule()
    def clear(self):
        self.cache.clear()
        self.seq_len = 0
        self.layer_len = [0] * L

    @rule(n=st.integers(0, MAX + 2))
    def set_seq_len(self, n):
        self.cache.set_seq_len(n)
        self.seq_len = min(n, MAX)
        self.layer_len = [self.seq_len] * L

    @rule(data=st.data(), layer=st.integers(0, L - 1), start=st.integers(0, MAX - 1), bs=st.integers(1, 5))
    def inject(self, data, layer, start, bs):
        keys = data.draw(arrays((H, bs, D)))
        values = data.draw(arrays((H, bs, D)))
        self.cache.inject_block(layer, start, bs, self.input(keys), values)
        inside = min(bs, MAX - start)
        self.k[layer, :, start : start + inside] = self.stored(keys, "key")[:, :inside]
        self.v[layer, :, start : start + inside] = self.stored(values, "value")[:, :inside]

    @rule(layer=st.integers(0, L - 1), start=st.integers(0, MAX - 1), bs=st.integers(1, 5))
    def extract(self, layer, start, bs):
        ek, ev = self.cache.extract_block(layer, start, bs)
        inside = min(bs, MAX - start)
        np.testing.assert_array_equal(
            ek[:, :inside].astype(np.float32), self.k[layer, :, start : start + inside]
        )
        np.testing.assert_array_equal(
            ev[:, :inside].astype(np.float32), self.v[layer, :, start : start + inside]
        )
        assert not ek[:, inside:].astype(np.float32).any()

    @invariant()
    def lengths_and_contents_match(self):
        assert self.cache.seq_len == self.seq_len
        for layer in range(L):
            n = self.layer_len[layer]
            assert self.cache.layer_len(layer) == n
            K, V = self.cache.get(layer, dequantize=self.eight_bit)
            np.testing.assert_array_equal(K.astype(np.float32), self.k[layer, :, :n])
            np.testing.assert_array_equal(V.astype(np.float32), self.v[layer, :, :n])
            ks, _ = self.cache.scales(layer)
            for head in range(H):
                # Codes times their scales (one per position for int8, one per head else).
                scale = ks[head][: self.seq_len] if self.dtype == "int8" else ks[head]
                np.testing.assert_array_equal(
                    self.cache.keys_for(layer, head).astype(np.float32) * scale[:, None],
                    self.k[layer, head, : self.seq_len],
                )


class Float16Machine(KVCacheMachine):
    dtype = "float16"


class BFloat16Machine(KVCacheMachine):
    dtype = "bfloat16"


class Int8Machine(KVCacheMachine):
    dtype = "int8"


class Fp8Machine(KVCacheMachine):
    dtype = "fp8_e4m3"
    scales: ClassVar[dict[str, float]] = {"key": 0.5, "value": 2.0}


SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestFloat32Cache = KVCacheMachine.TestCase
TestFloat32Cache.settings = SETTINGS
TestFloat16Cache = Float16Machine.TestCase
TestFloat16Cache.settings = SETTINGS
TestBFloat16Cache = BFloat16Machine.TestCase
TestBFloat16Cache.settings = SETTINGS
TestInt8Cache = Int8Machine.TestCase
TestInt8Cache.settings = SETTINGS
TestFp8Cache = Fp8Machine.TestCase
TestFp8Cache.settings = SETTINGS
