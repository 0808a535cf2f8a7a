"""Hand-built DLPack producers (ctypes), for inputs no installed library exports:
bfloat16 tensors, and tensors that claim to live on a CUDA device."""

from __future__ import annotations

import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

KDL_CPU, KDL_CUDA = 1, 2
KDL_FLOAT, KDL_BFLOAT = 2, 4


class Producer:
    """Exports `array`'s memory as a legacy DLPack capsule with the given type and device.

    It keeps the array, shape, strides and managed tensor alive itself (the deleter does
    nothing), so it must outlive every consumer of its capsules.
    """

    def __init__(self, array: np.ndarray, code: int, bits: int, device_type: int = KDL_CPU):
        self.array = array
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self.strides = (ctypes.c_int64 * array.ndim)(*(s // array.itemsize for s in array.strides))
        self.deleter = DELETER(lambda _: None)
        self.managed = DLManagedTensor(
            DLTensor(
                array.ctypes.data,
                DLDevice(device_type, 0),
                array.ndim,
                DLDataType(code, bits, 1),
                self.shape,
                self.strides,
                0,
            ),
            None,
            self.deleter,
        )
        self.device_type = device_type

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if max_version is not None:  # a pre-1.0 producer: only the legacy capsule
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (self.device_type, 0)
