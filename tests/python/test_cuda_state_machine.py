"""The paged state machine on a real GPU: every operation on a CUDA pool and on a host
pool side by side (skipped without a CUDA driver and device).

Hypothesis drives random interleavings of new (with prefix-cache hits), append,
advance with tokens, batched forwards, fork, copy_prefix, truncate, free and eviction
under memory pressure. Both pools must agree on every outcome (the same result or the
same exception type), on every block table and on stats(); after every step each live
sequence's K/V must be bitwise equal on the two devices. The host pool is checked
against NumPy references by test_pool_state_machine.py, so equality here carries those
checks to the device: copy-on-write, block copies, gathers and scatters as the kernels
run them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvrs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not kvrs.cuda_available(), reason="needs a CUDA driver and device"),
]

torch = pytest.importorskip("torch")

H, D, BS, LAYERS = 2, 6, 4, 2
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def bits(x: Any) -> np.ndarray:
    """The raw bits of a host or device array, as a NumPy integer array."""
    if isinstance(x, np.ndarray):  # a host array (bfloat16 is ml_dtypes', not DLPack's)
        return np.ascontiguousarray(x).view(f"u{x.itemsize}")
    tensor = torch.from_dlpack(x).cpu().contiguous()
    width = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[tensor.element_size()]
    return tensor.view(width).numpy()


def floats(x: Any) -> torch.Tensor:
    """A host or device array as a float32 host tensor."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.astype(np.float32))
    return torch.from_dlpack(x).float().cpu()


class TwinPools(RuleBasedStateMachine):
    """One pool per device, the same operations on both."""

    dtype = "float16"
    layout = "NHD"

    def __init__(self) -> None:
        super().__init__()
        kw = dict(block_size=BS, num_blocks=14, dtype=self.dtype, layout=self.layout, seed=7)
        self.gpu = kvrs.BlockPool(LAYERS, H, D, device="cuda", **kw)
        self.cpu = kvrs.BlockPool(LAYERS, H, D, **kw)
        self.live: list[tuple[kvrs.Sequence, kvrs.Sequence]] = []
        self.written: list[list[int]] = []  # positions each layer of a pair holds, for append

    def data(self, seed: int, n: int, given: str) -> tuple[Any, Any]:
        """The same K/V for both devices: a CUDA tensor and its host copy."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, H, D, generator=g).to(TORCH_DTYPES[given])
        return x.cuda(), x

    def both(self, fn: Any) -> tuple[Any, Any] | None:
        """fn(side) on both pools; they must agree on success or on the exception type."""
        out = []
        for side in (0, 1):
            try:
                out.append(("ok", fn(side)))
            except (ValueError, IndexError, kvrs.CacheFullError, kvrs.KvrsError) as e:
                out.append(("err", type(e)))
        assert out[0][0] == out[1][0] and (out[0][0] == "ok" or out[0][1] is out[1][1]), out
        return (out[0][1], out[1][1]) if out[0][0] == "ok" else None

    def pick(self, i: int) -> int:
        return i % len(self.live)

    @rule(prompt=st.lists(st.integers(0, 3), max_size=12))
    def new(self, prompt: list[int]) -> None:
        pools = (self.gpu, self.cpu)
        pair = self.both(lambda s: pools[s].new_sequence(prompt or None))
        if pair is not None:
            assert pair[0].num_cached_tokens == pair[1].num_cached_tokens
            assert pair[0].seq_len == pair[1].seq_len
            self.live.append(pair)
            self.written.append([pair[1].seq_len] * LAYERS)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def free(self, i: int) -> None:
        i = self.pick(i)
        pair = self.live.pop(i)
        self.written.pop(i)
        for s in pair:
            s.free()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20))
    def fork(self, i: int) -> None:
        i = self.pick(i)
        pair = self.live[i]
        forks = self.both(lambda s: pair[s].fork())
        assert forks is not None
        self.live.append(forks)
        self.written.append(list(self.written[i]))

    @precondition(lambda self: self.live)
    @rule(
        i=st.integers(0, 20),
        layer=st.integers(0, LAYERS - 1),
        n=st.integers(0, 6),
        seed=st.integers(0, 999),
        given=st.sampled_from(list(TORCH_DTYPES)),
    )
    def append(self, i: int, layer: int, n: int, seed: int, given: str) -> None:
        i = self.pick(i)
        pair = self.live[i]
        k, v = self.data(seed, n, given), self.data(seed + 1, n, given)
        starts = self.both(lambda s: pair[s].append(layer, k[s], v[s]))
        if starts is not None:
            assert starts[0] == starts[1]
            self.written[i][layer] += n

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), n=st.integers(0, 4), token=st.integers(0, 3))
    def advance(self, i: int, n: int, token: int) -> None:
        pair = self.live[self.pick(i)]
        self.both(lambda s: pair[s].advance(n, [token] * n))

    @precondition(lambda self: self.live)
    @rule(
        picks=st.lists(st.integers(0, 20), min_size=1, max_size=4),
        seed=st.integers(0, 999),
        attend=st.booleans(),
    )
    def forward(self, picks: list[int], seed: int, attend: bool) -> None:
        """One token for each picked sequence (distinct ones) through start_forward."""
        idx = sorted({self.pick(p) for p in picks})
        if any(len(set(self.written[j])) != 1 or self.written[j][0] != self.live[j][0].seq_len for j in idx):
            return  # a forward continues sequences whose layers are all committed
        pools = (self.gpu, self.cpu)
        batches = self.both(lambda s: pools[s].start_forward([self.live[j][s] for j in idx]))
        if batches is None:
            return
        n = len(idx)
        results = []
        for s, batch in enumerate(batches):
            with batch:
                for layer in range(LAYERS):
                    k = self.data(seed + layer, n, self.dtype)[s]
                    v = self.data(seed + 100 + layer, n, self.dtype)[s]
                    batch.put(layer, k, v)
                    if attend:
                        q = self.data(seed + 200 + layer, n, self.dtype)[s]
                        q = torch.cat([q, q], dim=1)  # 4 query heads over 2 KV heads
                        results.append(floats(batch.attention(layer, q)))
        for j in idx:
            for layer in range(LAYERS):
                self.written[j][layer] += 1
        if attend:
            half = len(results) // 2
            tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[self.dtype]
            for a, b in zip(results[:half], results[half:], strict=True):
                torch.testing.assert_close(a, b, atol=tol, rtol=tol)

    @precondition(lambda self: len(self.live) >= 2)
    @rule(i=st.integers(0, 20), j=st.integers(0, 20), n=st.integers(0, 12))
    def copy_prefix(self, i: int, j: int, n: int) -> None:
        i, j = self.pick(i), self.pick(j)
        a, b = self.live[i], self.live[j]
        pools = (self.gpu, self.cpu)
        if self.both(lambda s: pools[s].copy_prefix(a[s], b[s], n)) is not None:
            self.written[j] = [b[1].layer_len(layer) for layer in range(LAYERS)]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 20), n=st.integers(0, 12))
    def truncate(self, i: int, n: int) -> None:
        i = self.pick(i)
        pair = self.live[i]
        if self.both(lambda s: pair[s].truncate(n)) is not None:
            self.written[i] = [pair[1].layer_len(layer) for layer in range(LAYERS)]

    @rule()
    def evict_all(self) -> None:
        pools = (self.gpu, self.cpu)
        got = self.both(lambda s: pools[s].evict_all())
        assert got is not None and got[0] == got[1]

    @invariant()
    def devices_agree(self) -> None:
        a, b = self.gpu.stats(), self.cpu.stats()
        for key in ("used_blocks", "free_blocks", "cached_blocks", "tokens_stored", "evictions"):
            assert a[key] == b[key], (key, a[key], b[key])
        for g, c in self.live:
            assert g.seq_len == c.seq_len
            assert np.array_equal(g.block_table, c.block_table)
            for layer in range(LAYERS):
                assert g.layer_len(layer) == c.layer_len(layer)
                kg, vg = g.get(layer)
                kc, vc = c.get(layer)
                assert np.array_equal(bits(kg), bits(kc)), f"K of layer {layer} differs"
                assert np.array_equal(bits(vg), bits(vc)), f"V of layer {layer} differs"
        self.gpu.check_invariants()


class TwinPoolsHND(TwinPools):
    layout = "HND"
    dtype = "bfloat16"


class TwinPoolsF32(TwinPools):
    dtype = "float32"


SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestTwinPools = TwinPools.TestCase
TestTwinPools.settings = SETTINGS
TestTwinPoolsHND = TwinPoolsHND.TestCase
TestTwinPoolsHND.settings = SETTINGS
TestTwinPoolsF32 = TwinPoolsF32.TestCase
TestTwinPoolsF32.settings = SETTINGS
