"""Tree attention (speculative decoding's verification pass) against a float64 NumPy
softmax reference.

Each sequence of a batch holds a committed prefix and a draft tree placed after it: a
chain, a Medusa-style list of choices or an EAGLE-style top-k tree. The tree's tokens
attend to the prefix, their ancestors and themselves, through `custom_mask` (FlashInfer's
flattened [q_len x kv_len] booleans per sequence) or `packed_custom_mask` (its
`segment_packbits(..., bitorder="little")` form, checked against `np.packbits`), combined
with sliding windows, soft-capping and sinks, on every storage dtype, with query tiles
that take the streamed (few rows) and the tiled (many rows) kernels.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvrs

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def chain(n: int) -> list[int]:
    """Parents of a chain of n nodes (node 0 is the root; -1: no parent)."""
    return [-1] + list(range(n - 1))


def medusa(choices: list[tuple[int, ...]]) -> list[int]:
    """Parents of a Medusa tree: the root, then one node per choice (a path of top-i
    indices per head), sorted by depth as Medusa's `generate_medusa_buffers` sorts them."""
    nodes = [()] + sorted(set(choices), key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(nodes)}
    return [-1] + [index[c[:-1]] for c in nodes[1:]]


def eagle(depth: int, k: int, rng: np.random.Generator) -> list[int]:
    """Parents of an EAGLE-style tree: at each depth, the k best of the last level's
    children (here: random ones) are expanded into k children each."""
    parents, frontier = [-1], [0]
    for _ in range(depth):
        children = []
        for p in frontier:
            for _ in range(k):
                parents.append(p)
                children.append(len(parents) - 1)
        frontier = sorted(rng.choice(children, size=min(k, len(children)), replace=False).tolist())
    return parents


def ancestors(parents: list[int], j: int) -> set[int]:
    """Node j and its ancestors."""
    out = set()
    while j >= 0:
        out.add(j)
        j = parents[j]
    return out


def tree_mask(parents: list[int], prefix: int) -> np.ndarray:
    """The [n, prefix + n] mask of a tree placed after `prefix` committed positions."""
    n = len(parents)
    m = np.zeros((n, prefix + n), dtype=bool)
    m[:, :prefix] = True
    for j in range(n):
        for a in ancestors(parents, j):
            m[j, prefix + a] = True
    return m


def packed(masks: list[np.ndarray]) -> np.ndarray:
    """FlashInfer's segment_packbits(flat, indptr, bitorder="little"): each sequence's
    flattened mask packed alone, padded to whole bytes."""
    return np.concatenate([np.packbits(m.reshape(-1), bitorder="little") for m in masks])


def reference(q, k, v, visible, scale, softcap, sinks):
    """Attention of one token (q [Hq, D]) over positions `visible` of k, v [n, H, D]."""
    hq = q.shape[0]
    g = hq // k.shape[1]
    out = np.zeros((hq, v.shape[2]))
    for h in range(hq):
        s = k[visible, h // g] @ q[h] * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        m = s.max(initial=-np.inf)
        if sinks is not None:
            m = max(m, sinks[h])
        if m == -np.inf:
            continue
        w = np.exp(s - m)
        denom = w.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
        out[h] = w @ v[visible, h // g] / denom
    return out


@st.composite
def trees(draw):
    kind = draw(st.sampled_from(["chain", "medusa", "eagle"]))
    if kind == "chain":
        return chain(draw(st.integers(1, 12)))
    if kind == "medusa":
        heads = draw(st.integers(1, 3))
        top = draw(st.integers(1, 3))
        paths = draw(
            st.lists(st.lists(st.integers(0, top - 1), min_size=1, max_size=heads), min_size=1, max_size=10)
        )
        # Every prefix of a choice is a choice too, as in Medusa's choice lists.
        choices = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
        return medusa(list(choices))
    seed = draw(st.integers(0, 2**32 - 1))
    return eagle(draw(st.integers(1, 3)), draw(st.integers(1, 3)), np.random.default_rng(seed))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tree_masks_match_the_reference(data):
    dtype = data.draw(st.sampled_from(list(DTYPES)), label="dtype")
    form = data.draw(st.sampled_from(["bool", "packed"]), label="form")
    kind = data.draw(st.sampled_from(["full", "sliding"]), label="kind")
    window = data.draw(st.integers(2, 12), label="window")
    h, ratio = data.draw(st.sampled_from([(1, 1), (2, 1), (2, 4), (1, 8)]), label="heads")
    d = data.draw(st.sampled_from([8, 64]), label="head_dim")
    block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    hq = h * ratio
    pool = kvrs.BlockPool(
        1,
        h,
        d,
        block_size=block_size,
        num_blocks=256,
        dtype=dtype,
        layer_types=[kind],
        sliding_window=window if kind == "sliding" else None,
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    nseq = data.draw(st.integers(1, 3), label="sequences")
    seqs, prefixes, parents_of, ks, vs = [], [], [], [], []
    for _ in range(nseq):
        prefix = data.draw(st.integers(0, 20), label="prefix")
        seq = pool.new_sequence()
        k = rng.standard_normal((prefix, h, d)).astype(np.float32)
        v = rng.standard_normal((prefix, h, d)).astype(np.float32)
        if prefix:
            seq.append(0, k, v)
            seq.advance(prefix)
        seqs.append(seq)
        prefixes.append(prefix)
        parents_of.append(data.draw(trees(), label="tree"))
        ks.append(k)
        vs.append(v)
    batch_seqs = [s for s, p in zip(seqs, parents_of, strict=True) for _ in p]
    n = len(batch_seqs)
    k_new = rng.standard_normal((n, h, d)).astype(np.float32)
    v_new = rng.standard_normal((n, h, d)).astype(np.float32)
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    opts = {
        "scale": data.draw(st.sampled_from([None, 0.3]), label="scale"),
        "softcap": data.draw(st.sampled_from([None, 2.0]), label="softcap"),
        "sinks": rng.standard_normal(hq).astype(np.float32)
        if data.draw(st.booleans(), label="sinks")
        else None,
    }
    masks = [tree_mask(p, pre) for p, pre in zip(parents_of, prefixes, strict=True)]
    flat = np.concatenate([m.reshape(-1) for m in masks])
    bits = packed(masks)
    batch = pool.start_forward(batch_seqs)
    batch.put(0, k_new, v_new)
    arg = {"custom_mask": flat} if form == "bool" else {"packed_custom_mask": bits}
    out = batch.attention(0, q, **opts, **arg)
    # Both forms give the same result.
    other = {"packed_custom_mask": bits} if form == "bool" else {"custom_mask": flat}
    np.testing.assert_array_equal(batch.attention(0, q, **opts, **other), out)
    # get() returns the same mask, dense, over the history it returns.
    _, _, dense = batch.get(0, **arg)
    hist_off = 0
    row = 0
    scale = opts["scale"] if opts["scale"] is not None else 1 / math.sqrt(d)
    for s, pre, m, k, v in zip(seqs, prefixes, masks, ks, vs, strict=True):
        t = m.shape[0]
        kk = np.concatenate([k, k_new[row : row + t]]).astype(DTYPES[dtype]).astype(np.float64)
        vv = np.concatenate([v, v_new[row : row + t]]).astype(DTYPES[dtype]).astype(np.float64)
        first = s.layer_start(0)
        for j in range(t):
            pos = pre + j
            lo = max(0, pos - window + 1) if kind == "sliding" else 0
            visible = [p for p in range(max(lo, first), pos + 1) if m[j, p]]
            want = reference(
                q[row + j].astype(np.float64), kk, vv, visible, scale, opts["softcap"], opts["sinks"]
            )
            np.testing.assert_allclose(out[row + j], want, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)
            allowed = np.zeros(dense.shape[1], dtype=bool)
            allowed[[hist_off + p - first for p in visible]] = True
            assert np.array_equal(dense[row + j] == 0, allowed), (row + j, dense[row + j])
            assert np.all((dense[row + j] == 0) | (dense[row + j] == -np.inf))
        hist_off += pre + t - first
        row += t
    batch.cancel()
    pool.check_invariants()


def test_packed_form_is_flashinfer_segment_packbits_in_little_bit_order():
    # FlashInfer's docstring example (segment_packbits), in the order its prefill wrappers use.
    x = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=bool)
    segs = [x[0:4], x[4:7], x[7:11]]
    got = packed(segs)
    assert got.tolist() == [0b1101, 0b100, 0b1011]
    # A batch of a 2-token and a 3-token sequence: both forms mean the same thing.
    pool = kvrs.BlockPool(1, 1, 8, block_size=4, num_blocks=16, dtype="float32")
    a, b = pool.new_sequence(), pool.new_sequence()
    rng = np.random.default_rng(0)
    batch = pool.start_forward([a, a, b, b, b])
    batch.put(0, *rng.standard_normal((2, 5, 1, 8)).astype(np.float32))
    masks = [tree_mask(chain(2), 0), tree_mask([-1, 0, 0], 0)]
    flat = np.concatenate([m.reshape(-1) for m in masks])
    q = rng.standard_normal((5, 1, 8)).astype(np.float32)
    want = batch.attention(0, q, custom_mask=flat)
    np.testing.assert_array_equal(batch.attention(0, q, packed_custom_mask=packed(masks)), want)
    # Token 4 (node 2 of b) does not see node 1 of b: not a causal result.
    causal = batch.attention(0, q)
    assert not np.allclose(causal[4], want[4]) and np.allclose(causal[:4], want[:4])
    batch.cancel()


def test_bad_masks_raise_naming_the_expected_size():
    pool = kvrs.BlockPool(1, 1, 8, block_size=4, num_blocks=16, dtype="float32")
    a, b = pool.new_sequence(), pool.new_sequence()
    a.append(0, np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32))
    a.advance(3)
    batch = pool.start_forward([a, a, b])
    batch.put(0, np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32))
    q = np.ones((3, 1, 8), dtype=np.float32)
    # a: 2 query tokens x 5 positions; b: 1 x 1.
    with pytest.raises(ValueError, match=r"\[11\].*2\*5 \+ 1\*1"):
        batch.attention(0, q, custom_mask=np.ones(10, dtype=bool))
    with pytest.raises(ValueError, match=r"\[3\] uint8"):
        batch.attention(0, q, packed_custom_mask=np.ones(2, dtype=np.uint8))
    with pytest.raises(ValueError, match="not both"):
        batch.attention(
            0, q, custom_mask=np.ones(11, dtype=bool), packed_custom_mask=np.ones(3, dtype=np.uint8)
        )
    with pytest.raises(TypeError, match="bool"):
        batch.attention(0, q, custom_mask=np.zeros(11, dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[11\]"):
        batch.get(0, custom_mask=np.ones(12, dtype=bool))
    # A row the mask hides everything from gets zeros, as FlashInfer leaves it undefined.
    m = np.ones(11, dtype=bool)
    m[5:10] = False
    out = batch.attention(0, q, custom_mask=m)
    assert np.all(out[1] == 0) and np.all(out[0] == 1)
    batch.cancel()
    pool.check_invariants()
