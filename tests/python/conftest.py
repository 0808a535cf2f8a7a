"""Shared helpers for the kvrs test suite."""

from __future__ import annotations

import numpy as np

import kvrs


def snapshot(cache: kvrs.KVCache) -> tuple:
    """Everything observable about a cache: lengths and the full contents of every layer."""
    layers = []
    for layer in range(cache.num_layers):
        k, v = cache.extract_block(layer, 0, cache.max_seq_len)
        layers.append((cache.layer_len(layer), k.tobytes(), v.tobytes()))
    return (cache.seq_len, tuple(layers))


def random_kv(rng: np.random.Generator, n: int, heads: int, dim: int, dtype=np.float32):
    """A pair of random [n, heads, dim] arrays."""
    k = rng.standard_normal((n, heads, dim)).astype(dtype)
    v = rng.standard_normal((n, heads, dim)).astype(dtype)
    return k, v
