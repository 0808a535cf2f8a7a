"""Shared helpers for the kvrs test suite."""

from __future__ import annotations

import numpy as np
import pytest

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


FP8 = {"fp8_e4m3": ("float8_e4m3fn", 448.0), "fp8_e5m2": ("float8_e5m2", 57344.0)}


def fp8_codes(x, dtype: str, scale=1.0):
    """The reference fp8 codes of `x / scale` (float32 arithmetic): ml_dtypes' cast, which
    rounds to nearest even, after saturating at the format's largest finite value."""
    import ml_dtypes

    name, top = FP8[dtype]
    y = np.asarray(x, np.float32) / np.float32(scale)
    return np.clip(y, -top, top).astype(getattr(ml_dtypes, name))


def int8_codes(x):
    """The reference symmetric int8 codes and scales of `x`, one scale per row of the last
    axis: scale = max|row| / 127, code = clip(rint(x / scale), -127, 127), in float32.
    Saturating: infinities count as float32's max, and a scale whose 127 multiple would
    overflow is stepped down to the next float below."""
    x = np.asarray(x, np.float32)
    top = np.finfo(np.float32).max
    amax = np.minimum(np.abs(x).max(axis=-1, keepdims=True), top)
    scale = amax / np.float32(127)
    with np.errstate(over="ignore"):
        scale = np.where(np.isinf(scale * np.float32(127)), np.nextafter(scale, np.float32(0)), scale)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return codes, scale[..., 0].astype(np.float32)


def quantized(x, dtype: str, scale=1.0):
    """What a cache of `dtype` returns (dequantized, float32) after storing `x` ([..., D])."""
    x = np.asarray(x, np.float32)
    if dtype in FP8:
        return fp8_codes(x, dtype, scale).astype(np.float32) * np.float32(scale)
    if dtype == "int8":
        codes, scales = int8_codes(x)
        return codes.astype(np.float32) * scales[..., None]
    return x


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis server for the session (started here, stopped at the end)."""
    from redis_server import RedisServer, server_binary

    binary = server_binary()
    if binary is None:
        pytest.fail("no redis-server: run `make redis` (the tier tests need a real server)")
    server = RedisServer(binary)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session's server, running and empty."""
    if not redis_server.running():
        redis_server.start()
    redis_server.client().flushall()
    return redis_server.url
