//! DLPack capsules over kvrs memory: CUDA tensors ([`super::device_tensor`]) and host
//! arrays of the dtypes NumPy cannot export (bfloat16, fp8), so that `torch.from_dlpack`
//! takes every view kvrs hands out.

use std::sync::Arc;

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::CopiedSlice;
use dlpark::{Builder, DlpackFlags};
use numpy::npyffi::PyArrayObject;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;

use super::views::{descr, NPY_ARRAY_WRITEABLE};
use kvrs::unstable::cuda::CudaStorage;
use kvrs::DType;

/// What keeps an exported tensor's memory alive; held until the consumer's deleter
/// runs, never read.
#[allow(dead_code)]
#[derive(Clone)]
pub enum Keep {
    /// The Python object that owns the memory (a cache, a pool, an array).
    Object(Arc<Py<PyAny>>),
    /// Device memory allocated for one tensor.
    Owned(Arc<CudaStorage>),
}

/// One tensor to export: memory, element type, device, shape and element strides.
pub struct Export {
    /// Holds the memory alive.
    pub keep: Keep,
    /// Address of element 0.
    pub ptr: u64,
    /// Element type.
    pub dtype: DType,
    /// DLPack device.
    pub device: DLDevice,
    /// Shape.
    pub shape: Vec<i64>,
    /// Element strides.
    pub strides: Vec<i64>,
    /// Consumers must not write (signalled in versioned capsules only).
    pub read_only: bool,
}

/// DLPack's code for `dtype`.
pub fn dl_dtype(dtype: DType) -> DLDataType {
    match dtype {
        DType::F32 => DLDataType::scalar(DLDataTypeCode::FLOAT, 32),
        DType::F16 => DLDataType::scalar(DLDataTypeCode::FLOAT, 16),
        DType::BF16 => DLDataType::scalar(DLDataTypeCode::BFLOAT, 16),
        DType::F8E4M3 => DLDataType::scalar(DLDataTypeCode::FLOAT8_E4M3FN, 8),
        DType::F8E5M2 => DLDataType::scalar(DLDataTypeCode::FLOAT8_E5M2, 8),
        DType::I8 => DLDataType::scalar(DLDataTypeCode::INT, 8),
    }
}

impl Export {
    /// A `dltensor_versioned` capsule when the consumer asked for DLPack >= 1.0
    /// (`max_version`), else a legacy `dltensor` one (refused for read-only memory,
    /// which only versioned capsules can signal, as NumPy does).
    pub fn capsule<'py>(
        self,
        py: Python<'py>,
        max_version: Option<(u32, u32)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        if self.read_only && !versioned {
            return Err(PyBufferError::new_err(
                "a read-only view is exported only as a versioned DLPack capsule \
                 (max_version >= (1, 0)); torch.from_dlpack asks for one",
            ));
        }
        let flags = if self.read_only {
            DlpackFlags::READ_ONLY
        } else {
            DlpackFlags::empty()
        };
        let b = Builder::new(
            Box::new(self.keep),
            CopiedSlice::new(self.shape, self.strides),
        )
        .device(self.device)
        .dtype(dl_dtype(self.dtype))
        .flags(flags)
        .map_err(|e| PyBufferError::new_err(e.to_string()))?;
        // SAFETY: `Keep` holds the memory alive until the capsule's deleter drops it.
        let b = unsafe { b.data(self.ptr as *mut std::ffi::c_void) };
        let capsule = if versioned {
            let m = b
                .try_build::<DLManagedTensorVersioned>()
                .map_err(|e| PyBufferError::new_err(e.to_string()))?;
            m.into_pyobject(py)?.into_any()
        } else {
            let m = b
                .try_build::<DLManagedTensor>()
                .map_err(|e| PyBufferError::new_err(e.to_string()))?;
            m.into_pyobject(py)?.into_any()
        };
        Ok(capsule)
    }
}

/// `__dlpack__` of `kvrs.HostArray`: a capsule over a NumPy array of any kvrs storage
/// dtype (bfloat16 and fp8 included, which NumPy refuses to export), keeping the array
/// alive. Read-only arrays are signalled as such.
#[pyfunction]
#[pyo3(name = "_host_array_capsule", signature = (array, *, max_version = None, dl_device = None, copy = None))]
pub fn host_array_capsule<'py>(
    py: Python<'py>,
    array: &Bound<'py, PyAny>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    let arr = array
        .cast::<PyUntypedArray>()
        .map_err(|_| PyTypeError::new_err("host_array_capsule takes a NumPy array"))?;
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "kvrs views are exported without copying (copy=True is not supported)",
        ));
    }
    if let Some(d) = dl_device {
        if d != (1, 0) {
            return Err(PyBufferError::new_err(format!(
                "dl_device={d:?}: this array lives on the host (1, 0)"
            )));
        }
    }
    let d = arr.dtype();
    let dtype = DType::ALL
        .into_iter()
        .find(|&t| descr(py, t).is_ok_and(|x| x.is_equiv_to(&d)))
        .ok_or_else(|| PyBufferError::new_err(format!("dtype {d} is not a kvrs storage dtype")))?;
    let size = dtype.size() as isize;
    let empty = arr.shape().contains(&0);
    let mut strides = Vec::with_capacity(arr.ndim());
    for (&s, &n) in arr.strides().iter().zip(arr.shape()) {
        if n <= 1 || empty {
            strides.push(0); // never stepped along: any stride addresses the same elements
            continue;
        }
        if s % size != 0 {
            return Err(PyBufferError::new_err(format!(
                "byte strides {:?} are not multiples of the element size {size}",
                arr.strides()
            )));
        }
        strides.push((s / size) as i64);
    }
    // SAFETY: `arr` is a live ndarray; its fields are read while we hold a reference.
    let (data, flags) = unsafe {
        let raw = &*(arr.as_ptr() as *const PyArrayObject);
        (raw.data as u64, raw.flags)
    };
    Export {
        keep: Keep::Object(Arc::new(array.clone().unbind())),
        ptr: data,
        dtype,
        device: DLDevice::CPU,
        shape: arr.shape().iter().map(|&n| n as i64).collect(),
        strides,
        read_only: flags & NPY_ARRAY_WRITEABLE == 0,
    }
    .capsule(py, max_version)
}
