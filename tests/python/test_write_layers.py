"""BlockPool.write_layers and ForwardBatch.put_layers: every layer in one call (one
launch on a CUDA pool), equal to write / put per layer, with the same checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrs

L, H, D, BS = 3, 2, 4, 4


def pool(groups: bool, dtype: str = "float32", layout: str = "NHD") -> kvrs.BlockPool:
    kinds = ["full", "sliding", "full"] if groups else None
    return kvrs.BlockPool(
        L,
        H,
        D,
        block_size=BS,
        num_blocks=32,
        dtype=dtype,
        layout=layout,
        layer_types=kinds,
        sliding_window=8 if groups else None,
    )


def stacked(n: int, seed: int, pad: int) -> np.ndarray:
    """[L, n, H, D] float32 with `pad` unused tokens between layers (a layer stride)."""
    rng = np.random.default_rng(seed)
    full = rng.standard_normal((L, n + pad, H, D)).astype(np.float32)
    return full[:, :n]


def caches(p: kvrs.BlockPool) -> list[np.ndarray]:
    return [np.array(p.kv_cache(layer)) for layer in range(L)]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 9),
    pad=st.integers(0, 2),
    groups=st.booleans(),
    dtype=st.sampled_from(["float32", "float16", "float8_e4m3fn", "int8"]),
    layout=st.sampled_from(["NHD", "HND"]),
    skip=st.lists(st.booleans(), min_size=9, max_size=9),
)
def test_write_layers_equals_a_write_per_layer(n, pad, groups, dtype, layout, skip):
    k, v = stacked(n, 1, pad), stacked(n, 2, pad)
    one, per_layer = pool(groups, dtype, layout), pool(groups, dtype, layout)
    slots, held, rows = [], [], []
    for p in (one, per_layer):
        s = p.new_sequence()
        held.append(s)
        m = np.array(p.reserve([s], [n]), dtype=np.int64).reshape(-1, n)
        rows = [row[0] // BS for row in m]
        m[:, np.array(skip[:n])] = -1
        slots.append(m)
    one.write_layers(k, v, slots[0] if groups else slots[0][0])
    for layer in range(L):
        # The row of the layer's group: the one in the layer's block table.
        first = per_layer.block_tables([held[1]], layer=layer)[0, 0] if groups else 0
        g = rows.index(first) if groups else 0
        per_layer.write(layer, k[layer], v[layer], slots[1][g])
    for a, b in zip(caches(one), caches(per_layer), strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_put_layers_equals_put_and_counts_every_layer():
    k, v = stacked(5, 3, 1), stacked(5, 4, 0)
    pools = [pool(True), pool(True)]
    for p, layers in zip(pools, (True, False), strict=True):
        seqs = [p.new_sequence(), p.new_sequence()]
        batch = p.start_forward([seqs[0], seqs[1], seqs[0], seqs[1], seqs[0]])
        if layers:
            batch.put_layers(k, v)
        else:
            for layer in range(L):
                batch.put(layer, k[layer], v[layer])
        batch.finish()
        assert [s.seq_len for s in seqs] == [3, 2]
    for a, b in zip(caches(pools[0]), caches(pools[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_put_layers_respects_stale_batches():
    p = pool(False)
    s = p.new_sequence()
    batch = p.start_forward([s, s])
    t = s.fork()
    with pytest.raises(ValueError, match="stale"):
        batch.put_layers(stacked(2, 5, 0), stacked(2, 6, 0))
    del t


@pytest.mark.parametrize(
    ("k_shape", "slots", "name"),
    [
        ((L, 2, H), [0, 1], "k"),  # 3 dimensions
        ((L - 1, 2, H, D), [0, 1], "k"),  # a layer short
        ((L, 2, H, D + 1), [0, 1], "k"),  # head_dim
        ((L, 2, H, D), [0], "slot_mapping"),  # one slot short
        ((L, 2, H, D), [0, 10_000], "slot_mapping"),  # outside the pool
    ],
)
def test_bad_inputs_name_the_argument_and_change_nothing(k_shape, slots, name):
    # A slot outside the pool is an IndexError, as for write(); the others ValueError.
    p = pool(False)
    s = p.new_sequence()
    reserved = p.reserve([s], [2])
    assert list(reserved) == [0, 1]
    before = caches(p)
    k = np.ones(k_shape, np.float32)
    with pytest.raises((ValueError, IndexError), match=name):
        p.write_layers(k, np.ones((L, 2, H, D), np.float32), slots)
    for a, b in zip(before, caches(p), strict=True):
        np.testing.assert_array_equal(a, b)


def test_write_layers_refuses_blocks_it_may_not_write():
    p = pool(False)
    s = p.new_sequence()
    p.reserve([s], [2])
    t = s.fork()
    before = caches(p)
    with pytest.raises(ValueError, match="shared"):
        p.write_layers(stacked(2, 7, 0), stacked(2, 8, 0), [0, 1])
    for a, b in zip(before, caches(p), strict=True):
        np.testing.assert_array_equal(a, b)
    del t
