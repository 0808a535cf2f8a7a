"""Every bad input raises a clear exception naming the argument, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

import kvrs
from conftest import random_kv, snapshot

H, D, MAX = 2, 4, 8
# What device="cuda" says on a machine without a CUDA driver or device.
NO_CUDA = r"device=cuda:0: no CUDA driver found"
# Without a GPU, device="cuda" is an error; with one, it is a cache (test_cuda.py).
needs_no_gpu = pytest.mark.skipif(kvrs.cuda_available(), reason="device='cuda' works on this machine")


@pytest.fixture
def cache():
    c = kvrs.KVCache(2, H, D, MAX, dtype="float16")
    k, v = random_kv(np.random.default_rng(0), 3, H, D)
    c.append(0, k, v)
    c.append(1, k, v)
    c.advance(2)
    return c


def ok(n=1):
    return np.ones((n, H, D), np.float32)


CASES = [
    # (call, exception, message fragment)
    (lambda c: c.append(2, ok(), ok()), IndexError, r"layer=2 is out of range: must be in \[0, 2\)"),
    (lambda c: c.append(-1, ok(), ok()), IndexError, "layer=-1"),
    (lambda c: c.append(0, np.ones((1, H + 1, D), np.float32), ok()), ValueError, r"k has shape \[1, 3, 4\]"),
    (lambda c: c.append(0, ok(), np.ones((2, H, D), np.float32)), ValueError, r"v has shape \[2, 2, 4\]"),
    (lambda c: c.append(0, np.ones((H, D), np.float32), ok()), ValueError, "k has shape"),
    (
        lambda c: c.append(0, np.ones((1, 1, H, D), np.float32), ok()),
        ValueError,
        r"at most 3 dimensions; a 4-D \[batch, num_heads, seq_len, head_dim\].*k\[b\]\.transpose\(0, 1\)",
    ),
    (lambda c: c.append(0, ok().astype(np.float64), ok()), TypeError, "k has dtype float64"),
    (lambda c: c.append(0, ok(), ok().astype(np.int32)), TypeError, "v has dtype int32"),
    (lambda c: c.append(0, "abc", ok()), TypeError, "k"),
    (
        lambda c: c.append(0, ok(6), ok(6)),
        kvrs.CacheFullError,
        "needs 6 more positions but 5 of 8 positions are free",
    ),
    (lambda c: c.advance(2), ValueError, "layer 0 holds 3"),
    (lambda c: c.advance(-1), ValueError, "n=-1: must be >= 0"),
    (lambda c: c.truncate(-1), ValueError, "n=-1"),
    (lambda c: c.set_seq_len(-5), ValueError, "n=-5"),
    (lambda c: c.store_key(0, 2, 0, np.ones(D, np.float32)), IndexError, "head=2"),
    (
        lambda c: c.store_key(0, 0, MAX, np.ones(D, np.float32)),
        IndexError,
        r"pos=8 is out of range: must be in \[0, 8\)",
    ),
    (lambda c: c.store_value(0, 0, -1, np.ones(D, np.float32)), IndexError, "pos=-1"),
    (lambda c: c.store_value(0, 0, 0, np.ones(D + 1, np.float32)), ValueError, r"value has shape \[5\]"),
    (lambda c: c.get(5), IndexError, "layer=5"),
    (lambda c: c.keys_for(0, 3), IndexError, "head=3"),
    (lambda c: c.values_for(0, 0, seq_len=MAX + 1), ValueError, "seq_len=9"),
    (lambda c: c.extract_block(0, MAX, 2), IndexError, "start_pos=8"),
    (lambda c: c.extract_block(0, 0, 0), ValueError, "block_size=0"),
    (
        lambda c: c.inject_block(0, 0, 2, np.ones((H, 3, D), np.float32), np.ones((H, 2, D), np.float32)),
        ValueError,
        "keys has shape",
    ),
    (lambda c: c.inject_block(0, 0, 2, np.ones((H, 2, D)), np.ones((H, 2, D))), TypeError, "keys has dtype"),
    (
        lambda c: c.inject_block(3, 0, 2, np.ones((H, 2, D), np.float16), np.ones((H, 2, D), np.float16)),
        IndexError,
        "layer=3",
    ),
    (lambda c: c.layer_len(2), IndexError, "layer=2"),
]


@pytest.mark.parametrize(("call", "exc", "match"), CASES)
def test_bad_input_raises_and_leaves_cache_unchanged(cache, call, exc, match):
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        call(cache)
    assert snapshot(cache) == before


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"dtype": "int4"}, ValueError, "dtype='int4' is not supported"),
        ({"dtype": np.float64}, ValueError, "float64"),
        ({"device": "tpu"}, ValueError, "device="),
        pytest.param({"device": "cuda"}, kvrs.DeviceError, NO_CUDA, marks=needs_no_gpu),
        ({"device": "cuda:99"}, kvrs.DeviceError, "device=cuda:99"),
    ],
)
def test_bad_constructor_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvrs.KVCache(1, 1, 4, 4, **kwargs)


@pytest.mark.parametrize("field", range(4))
def test_sizes_must_be_positive(field):
    sizes = [1, 1, 4, 4]
    sizes[field] = 0
    names = ["num_layers", "num_kv_heads", "head_dim", "max_seq_len"]
    with pytest.raises(ValueError, match=f"{names[field]}=0: must be >= 1"):
        kvrs.KVCache(*sizes)


def test_absurd_size_is_an_error_not_a_crash():
    with pytest.raises((ValueError, MemoryError)):
        kvrs.KVCache(1 << 20, 1 << 10, 1 << 10, 1 << 30)


def test_cuda_availability_matches_what_device_cuda_says():
    if kvrs.cuda_available():
        assert kvrs.KVCache(1, 1, 4, 4, device="cuda").device == "cuda:0"
        return
    with pytest.raises(kvrs.DeviceError) as e:
        kvrs.KVCache(1, 1, 4, 4, device="cuda")
    assert "no CUDA driver found" in str(e.value) or "no CUDA support" in str(e.value)


def test_exception_hierarchy():
    for e in (kvrs.CacheFullError, kvrs.NotSupportedError, kvrs.DeviceError):
        assert issubclass(e, kvrs.KvrsError)
    assert issubclass(kvrs.KvrsError, Exception)
