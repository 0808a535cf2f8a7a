"""Inputs from DLPack and buffer-protocol producers; views consumed through DLPack."""

from __future__ import annotations

import array

import numpy as np
import pytest

import kvrs


class DlpackOnly:
    """A producer that offers nothing but the DLPack protocol (as torch or JAX do)."""

    def __init__(self, a: np.ndarray, legacy: bool = False):
        self._a = a
        self._legacy = legacy
        self.calls = 0

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls += 1
        if self._legacy and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        kwargs = {} if self._legacy else {"max_version": max_version}
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_views_are_consumable_through_dlpack():
    c = kvrs.KVCache(1, 2, 4, 8, dtype="float32")
    x = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    c.append(0, x, -x)
    K, _ = c.get(0)
    k2 = np.from_dlpack(K)
    assert np.shares_memory(k2, K)
    np.testing.assert_array_equal(k2, x.transpose(1, 0, 2))


def test_dlpack_input_is_read_in_place():
    c = kvrs.KVCache(1, 2, 4, 8, dtype="float16")
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 2, 4)
    src = DlpackOnly(x)
    c.append(0, src, DlpackOnly(x[:, :, ::-1].copy()))
    assert src.calls == 1
    np.testing.assert_array_equal(c.get(0)[0], x.astype(np.float16).transpose(1, 0, 2))


def test_legacy_dlpack_producers_still_work():
    c = kvrs.KVCache(1, 2, 4, 8, dtype="float32")
    x = np.ones((1, 2, 4), np.float16) * 3
    c.append(0, DlpackOnly(x, legacy=True), DlpackOnly(x, legacy=True))
    assert c.get(0)[1].sum() == 24


def test_strided_dlpack_input():
    c = kvrs.KVCache(1, 2, 4, 8, dtype="float32")
    big = np.arange(48, dtype=np.float32).reshape(3, 2, 8)
    c.append(0, DlpackOnly(big[:, :, ::2]), DlpackOnly(big[:, :, 1::2]))
    np.testing.assert_array_equal(c.get(0)[0], big[:, :, ::2].transpose(1, 0, 2))


def test_buffer_protocol_input():
    c = kvrs.KVCache(1, 1, 4, 8, dtype="float16")
    key = array.array("f", [1.0, 2.0, 3.0, 4.0])
    c.store_key(0, 0, 0, key)
    c.store_value(0, 0, 0, memoryview(np.full(4, 0.5, np.float16)))
    c.set_seq_len(1)
    np.testing.assert_array_equal(c.keys_for(0, 0)[0], [1, 2, 3, 4])
    np.testing.assert_array_equal(c.values_for(0, 0)[0], [0.5] * 4)


def test_bytes_of_wrong_dtype_are_rejected():
    c = kvrs.KVCache(1, 1, 4, 8)
    try:
        c.store_key(0, 0, 0, array.array("d", [1.0] * 4))
    except TypeError as e:
        assert "key has dtype float64" in str(e)
    else:
        raise AssertionError("float64 input was accepted")


def test_bfloat16_through_dlpack():
    import ml_dtypes
    from dlpack_capsules import KDL_BFLOAT, Producer

    x = (np.arange(16, dtype=np.float32).reshape(2, 2, 4) / 4).astype(ml_dtypes.bfloat16)
    bits = x.view(np.uint16)
    for store in ("float32", "float16", "bfloat16"):
        c = kvrs.KVCache(1, 2, 4, 8, dtype=store)
        producer = Producer(bits, KDL_BFLOAT, 16)
        c.append(0, producer, Producer(bits, KDL_BFLOAT, 16))
        np.testing.assert_array_equal(c.get(0)[0].astype(np.float32), x.astype(np.float32).transpose(1, 0, 2))


def test_device_tensors_are_refused_not_copied():
    from dlpack_capsules import KDL_CUDA, KDL_FLOAT, Producer

    c = kvrs.KVCache(1, 2, 4, 8, dtype="float32")
    on_gpu = Producer(np.ones((1, 2, 4), np.float32), KDL_FLOAT, 32, device_type=KDL_CUDA)
    with pytest.raises(kvrs.DeviceError, match="k lives on cuda:0; this cache lives on cpu"):
        c.append(0, on_gpu, np.ones((1, 2, 4), np.float32))
    assert c.layer_len(0) == 0


def test_unsupported_dlpack_dtype_is_a_type_error():
    from dlpack_capsules import Producer

    c = kvrs.KVCache(1, 2, 4, 8, dtype="float32")
    ints = Producer(np.ones((1, 2, 4), np.int32), 0, 32)  # kDLInt
    with pytest.raises(TypeError, match="k has dtype int32"):
        c.append(0, ints, ints)


def test_the_generic_classes_subscript_at_run_time_as_in_annotations():
    """The stubs make the caches generic in what their reads return
    (`KVCache[np.ndarray]`); the subscript must also work at run time."""
    import types
    import typing

    for cls in (kvrs.KVCache, kvrs.BlockPool, kvrs.Sequence, kvrs.ForwardBatch, kvrs.EncoderCache):
        alias = cls[np.ndarray]
        assert isinstance(alias, types.GenericAlias)
        assert typing.get_origin(alias) is cls and typing.get_args(alias) == (np.ndarray,)

    def reads(cache: kvrs.KVCache[np.ndarray]) -> np.ndarray:
        return cache.get(0)[0]

    assert typing.get_type_hints(reads)["cache"] == kvrs.KVCache[np.ndarray]
    cache = kvrs.KVCache(1, 1, 4, 8)
    assert isinstance(cache, kvrs.KVCache) and reads(cache).shape == (1, 0, 4)
