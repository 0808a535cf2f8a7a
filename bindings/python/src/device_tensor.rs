//! `kvrs.DeviceTensor`: a tensor in CUDA device memory, handed to torch, CuPy, JAX and
//! FlashInfer through DLPack (`__dlpack__`, `__dlpack_device__`) without a copy. It is
//! either a view of a cache's storage (kept alive by the cache object) or memory kvrs
//! allocated for a fresh output (kept alive by the tensor and every capsule made of it).

use std::sync::Arc;

use dlpark::ffi::DLDevice;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;

use super::dlpack_export::{Export, Keep};
use super::errors::ToPython;
use kvrs::unstable::cuda::{gpu_for, CudaStorage};
use kvrs::unstable::{Storage, TensorMut};
use kvrs::{DType, Device};

/// A tensor in CUDA device memory, exported through DLPack without a copy
/// (`torch.from_dlpack(t)`, `cupy.from_dlpack(t)`, `jax.dlpack.from_dlpack(t)`).
#[pyclass(frozen, name = "DeviceTensor", module = "kvrs")]
pub struct PyDeviceTensor {
    keep: Keep,
    ptr: u64,
    dtype: DType,
    ordinal: usize,
    shape: Vec<i64>,
    /// Element strides.
    strides: Vec<i64>,
}

impl PyDeviceTensor {
    /// A view of `owner`'s device memory at `ptr` with `shape` and element `strides`.
    ///
    /// # Safety
    /// The memory stays valid for as long as `owner` lives.
    pub unsafe fn view<'py>(
        owner: &Bound<'py, PyAny>,
        ptr: u64,
        dtype: DType,
        ordinal: usize,
        shape: &[usize],
        strides: &[isize],
    ) -> PyResult<Bound<'py, PyAny>> {
        let t = PyDeviceTensor {
            keep: Keep::Object(Arc::new(owner.clone().unbind())),
            ptr,
            dtype,
            ordinal,
            shape: shape.iter().map(|&d| d as i64).collect(),
            strides: strides.iter().map(|&s| s as i64).collect(),
        };
        Ok(Bound::new(owner.py(), t)?.into_any())
    }

    /// A fresh zeroed C-contiguous tensor on CUDA device `ordinal`, and a [`TensorMut`]
    /// through which the core writes it (valid while the tensor lives).
    pub fn fresh<'py>(
        py: Python<'py>,
        ordinal: usize,
        dtype: DType,
        shape: &[usize],
    ) -> PyResult<(Bound<'py, PyAny>, TensorMut<'static>)> {
        let numel: usize = shape.iter().product();
        let storage = Arc::new(CudaStorage::zeroed(ordinal, dtype, numel, 1).py()?);
        let ptr = storage.data_ptr();
        // SAFETY: the storage holds `numel` elements and lives in the Python tensor, which
        // the caller holds beside this one.
        let tensor =
            unsafe { TensorMut::contiguous(ptr, dtype, shape).py()? }.on(Device::Cuda(ordinal));
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1] as i64;
        }
        let t = PyDeviceTensor {
            keep: Keep::Owned(storage),
            ptr: ptr as u64,
            dtype,
            ordinal,
            shape: shape.iter().map(|&d| d as i64).collect(),
            strides,
        };
        Ok((Bound::new(py, t)?.into_any(), tensor))
    }

    fn export(&self) -> Export {
        Export {
            keep: self.keep.clone(),
            ptr: self.ptr,
            dtype: self.dtype,
            device: DLDevice::cuda(self.ordinal as i32),
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            read_only: false,
        }
    }
}

#[pymethods]
impl PyDeviceTensor {
    /// DLPack export. kvrs's work on the tensor is finished before the consumer's
    /// `stream` may read it; `max_version` >= (1, 0) gets a versioned capsule.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "kvrs device tensors are exported without copying (copy=True is not supported)",
            ));
        }
        if let Some(d) = dl_device {
            if d != (2, self.ordinal as i32) {
                return Err(PyBufferError::new_err(format!(
                    "dl_device={d:?}: this tensor lives on cuda:{} (2, {})",
                    self.ordinal, self.ordinal
                )));
            }
        }
        if stream != Some(-1) {
            // The consumer's stream may read once kvrs's queued work is done.
            let gpu = gpu_for(self.ordinal).py()?;
            py.detach(|| gpu.synchronize(gpu.default_stream())).py()?;
        }
        self.export().capsule(py, max_version)
    }

    /// `(2, ordinal)`: DLPack's CUDA device type and the device ordinal.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (2, self.ordinal as i32)
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    /// Element strides.
    #[getter]
    fn strides(&self) -> Vec<i64> {
        self.strides.clone()
    }

    /// Element type: 'float32', 'float16' or 'bfloat16'.
    #[getter]
    fn dtype(&self) -> String {
        self.dtype.to_string()
    }

    /// Device name, 'cuda:N'.
    #[getter]
    fn device(&self) -> String {
        Device::Cuda(self.ordinal).to_string()
    }

    /// Device address of element 0.
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.ptr
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceTensor(shape={:?}, dtype={}, device=cuda:{})",
            self.shape, self.dtype, self.ordinal
        )
    }
}
