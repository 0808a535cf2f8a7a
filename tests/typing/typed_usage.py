"""Typed code as a kvrs user writes it, checked by `mypy --strict` in `make test`.

Never run, only type-checked: `assert_type` pins what the stubs promise. A host cache's
reads are NumPy arrays, a CUDA cache's are `kvrs.DeviceTensor`s, and a device known only
at run time gives their union; handles (sequences, batches) carry their pool's type.
"""

from typing import Any, assert_type

import numpy as np
import numpy.typing as npt

import kvrs

Host = npt.NDArray[Any]
Either = npt.NDArray[Any] | kvrs.DeviceTensor


def host_cache() -> None:
    cache = kvrs.KVCache(2, 4, 64, 128, dtype="float32")
    assert_type(cache, kvrs.KVCache[Host])
    k = np.zeros((1, 4, 64), dtype=np.float32)
    cache.append(0, k, k)
    keys, values = cache.get(0)
    assert_type(keys, Host)
    assert_type(cache.keys_for(0, 1), Host)
    assert_type(cache.extract_block(0, 0, 16)[1], Host)
    out = cache.attention(0, np.zeros((1, 8, 64), dtype=np.float32))
    assert_type(out, Host)
    total: float = float(keys.sum() + values.sum() + out.sum())
    print(total)


def cuda_cache() -> None:
    cache = kvrs.KVCache(2, 4, 64, 128, device="cuda")
    assert_type(cache, kvrs.KVCache[kvrs.DeviceTensor])
    keys, _ = cache.get(0)
    assert_type(keys, kvrs.DeviceTensor)
    print(keys.shape, keys.data_ptr, keys.__dlpack_device__())
    on_gpu_1 = kvrs.EncoderCache(1, 2, 64, 32, device="cuda:1")
    assert_type(on_gpu_1.get(0)[0], kvrs.DeviceTensor)


def device_from_config(device: str) -> None:
    cache = kvrs.KVCache(2, 4, 64, 128, device=device)
    assert_type(cache, kvrs.KVCache[Either])
    keys, _ = cache.get(0)
    if isinstance(keys, kvrs.DeviceTensor):
        assert_type(keys, kvrs.DeviceTensor)
    else:
        assert_type(keys, Host)


def host_pool() -> None:
    pool = kvrs.BlockPool(2, 4, 64, num_blocks=64)
    assert_type(pool, kvrs.BlockPool[Host])
    assert_type(pool.kv_cache(0), Host)
    seq = pool.new_sequence([1, 2, 3])
    assert_type(seq, kvrs.Sequence[Host])
    assert_type(seq.fork(), kvrs.Sequence[Host])
    assert_type(seq.pool, kvrs.BlockPool[Host])
    assert_type(seq.get(0)[0], Host)
    for start, length, k, v in seq.views(0):
        assert_type(k, Host)
        print(start, length, v.shape)
    with pool.start_forward([seq]) as batch:
        assert_type(batch, kvrs.ForwardBatch[Host])
        k_hist, _, mask = batch.get(0)
        assert_type(k_hist, Host)
        assert_type(mask, npt.NDArray[np.float32])
        assert_type(batch.attention(0, np.zeros((1, 8, 64), dtype=np.float16)), Host)
    with seq:
        pass


def cuda_pool() -> None:
    pool = kvrs.BlockPool(2, 4, 64, num_blocks=64, device="cuda")
    seq = pool.new_sequence()
    assert_type(seq.get(0), tuple[kvrs.DeviceTensor, kvrs.DeviceTensor])
    assert_type(pool.start_forward([seq]).get(0)[0], kvrs.DeviceTensor)


def annotated(cache: kvrs.KVCache[Host], seq: kvrs.Sequence[kvrs.DeviceTensor]) -> Host:
    """Generic classes in annotations: the subscript works at run time too."""
    print(seq.get(0)[0].device)
    return cache.get(0)[0]


def generic_code(cache: kvrs.KVCache[Any]) -> int:
    """Code that takes any cache: `KVCache[Any]` (or bare `KVCache`) still type-checks."""
    return cache.seq_len + len(cache)


def tiered_pool(tmp: str) -> None:
    """Offload tiers: the tier classes, background prefetch and the per-tier counts."""
    tiers: list[kvrs.Tier] = [kvrs.HostTier("1GiB"), kvrs.DiskTier(tmp, max_bytes="20GiB")]
    pool = kvrs.BlockPool(2, 4, 64, num_blocks=64, seed=7, tiers=tiers, tier_write="all", model_id="typed")
    prompt = list(range(40))
    assert_type(pool.prefetch(prompt, wait=False), int)
    seq = pool.new_sequence(tokens=prompt)
    assert_type(seq.cached_tokens_by_tier, dict[str, int])
    assert_type(pool.store_to_tiers([seq]), int)
    pool.flush_tiers()


def page_store(tmp: str) -> None:
    """An engine's own pages in kvrs tiers: a fingerprint of facts, per-page results."""
    store = kvrs.PageStore(
        [kvrs.DiskTier(tmp, "1GiB")],
        fingerprint={"model": "m", "kv_dtype": "bfloat16", "page_bytes": 64, "tp_rank": 0, "mla": False},
        tier_key=b"0123456789abcdef",
    )
    page = np.zeros(64, np.uint8)
    assert_type(store.put_many(["a"], [page], namespace="tenant"), list[bool])
    assert_type(store.get_into(["a"], [page]), list[bool])
    assert_type(store.exists_prefix(["a"]), int)
    assert_type(store.exists_many(["a"]), list[bool])
    assert_type(store.drop_namespace("tenant"), int)
    assert_type(store.page_bytes, int | None)
    assert_type(store.stats(), dict[str, Any])
