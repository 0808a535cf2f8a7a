"""Smoke test of an installed kvrs wheel: every public class used once, from a virtual
environment that has the wheel, NumPy and ml_dtypes and nothing else (no Rust, no
source tree). Run by tests/wheel/check_wheel.py; exits non-zero on any failure."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

import kvrs

source_tree = Path(__file__).resolve().parents[2] / "python"
assert not Path(kvrs.__file__).is_relative_to(source_tree), f"imported from the source tree: {kvrs.__file__}"
assert shutil.which("cargo") is None and shutil.which("rustc") is None, "Rust is on the PATH"
assert Path(kvrs._kvrs.__file__).name.endswith(".abi3.so"), kvrs._kvrs.__file__
rng = np.random.default_rng(0)

# KVCache: the seed's surface and attention.
cache = kvrs.KVCache(2, 2, 8, 32, dtype="bfloat16")
k = rng.standard_normal((5, 2, 8), dtype=np.float32)
for layer in range(2):
    cache.append(layer, k, k)
cache.advance(5)
kk, _ = cache.get(0)
assert kk.dtype == ml_dtypes.bfloat16 and kk.shape == (2, 5, 8)
assert cache.attention(0, rng.standard_normal((1, 4, 8), dtype=np.float32)).shape == (1, 4, 8)

# BlockPool, Sequence, ForwardBatch, prefix caching and forks.
pool = kvrs.BlockPool(1, 2, 8, block_size=4, num_blocks=16, rope=kvrs.RoPE(theta=10000.0))
seq = pool.new_sequence()
seq.append(0, k, k)
seq.advance(5, tokens=[1, 2, 3, 4, 5])
fork = seq.fork()
with pool.start_forward([seq, fork], tokens=[6, 7]) as batch:
    x = rng.standard_normal((2, 2, 8), dtype=np.float32)
    batch.put(0, x, x)
    out = batch.attention(0, rng.standard_normal((2, 4, 8), dtype=np.float32))
assert isinstance(batch, kvrs.ForwardBatch) and out.shape == (2, 4, 8)
assert seq.seq_len == fork.seq_len == 6
seq.free()
assert pool.new_sequence(tokens=[1, 2, 3, 4, 5, 6, 7]).num_cached_tokens == 4
pool.check_invariants()

# An offload tier: evicted blocks go to disk and come back to a new pool.
with tempfile.TemporaryDirectory() as tier_dir:
    tiered = kvrs.BlockPool(
        1, 2, 8, block_size=4, num_blocks=8, seed=3, model_id="smoke", tiers=[kvrs.DiskTier(tier_dir, "1MiB")]
    )
    s = tiered.new_sequence(tokens=list(range(9)))
    s.append(0, np.ones((9, 2, 8), np.float32), np.ones((9, 2, 8), np.float32))
    s.advance(9)
    s.free()
    tiered.evict_all()
    tiered.flush_tiers()
    again = kvrs.BlockPool(
        1, 2, 8, block_size=4, num_blocks=8, seed=3, model_id="smoke", tiers=[kvrs.DiskTier(tier_dir, "1MiB")]
    )
    assert again.new_sequence(tokens=list(range(9))).num_cached_tokens == 8
    assert callable(kvrs.RedisTier)
    # An engine's own pages, sealed and verified, in the same tiers.
    pages = kvrs.PageStore(
        [kvrs.DiskTier(tier_dir, "1MiB")], fingerprint={"model": "m", "page_bytes": 64}, tier_key=b"k" * 32
    )
    assert pages.put_many(["p"], [np.arange(64, dtype=np.uint8)]) == [True]
    back = np.zeros(64, np.uint8)
    assert pages.get_into(["p"], [back]) == [True] and (back == np.arange(64)).all()

# EncoderCache, RoPE, the errors and the device probe.
enc = kvrs.EncoderCache(1, 2, 8, 16, dtype="float16")
enc.set(0, k, k)
assert enc.attention(0, rng.standard_normal((3, 2, 8), dtype=np.float32)).shape == (3, 2, 8)
assert kvrs.RoPE().apply(rng.standard_normal((3, 2, 8), dtype=np.float32), [0, 1, 2]).shape == (3, 2, 8)
try:
    kvrs.BlockPool(1, 2, 8, block_size=4, num_blocks=1).new_sequence().append(0, k, k)
except kvrs.CacheFullError:
    pass
else:
    raise AssertionError("CacheFullError expected")
assert isinstance(kvrs.cuda_available(), bool) and isinstance(kvrs.DeviceTensor, type)
assert issubclass(kvrs.DeviceError, kvrs.KvrsError) and issubclass(kvrs.NotSupportedError, kvrs.KvrsError)
print(f"kvrs {kvrs.__version__} wheel OK on Python {sys.version.split()[0]} ({kvrs.attention_simd()})")
