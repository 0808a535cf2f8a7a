//! What a pool, its sequences and its forward batches share: the locked core pool with
//! its fixed description, and the arrays they hand out. The bindings of all three hold
//! an `Arc` of it, so none of them needs another's class.

use numpy::{PyArray1, PyArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;

use super::views::borrowed_view;
use crate::dtype::DType;
use crate::paged::{PagedShape, PoolCore};
use crate::storage::Device;

/// A pool's state behind `kvrs.BlockPool`, its `Sequence`s and its `ForwardBatch`es.
pub struct SharedPool {
    /// The core pool; every operation locks it.
    pub(crate) inner: Mutex<PoolCore>,
    /// Its sizes and layout (fixed).
    pub(crate) shape: PagedShape,
    /// Its storage dtype.
    pub(crate) dtype: DType,
    /// Where its storage lives.
    pub(crate) device: Device,
    /// Address of its storage (never reallocated).
    pub(crate) data: usize,
}

impl SharedPool {
    /// A read-only (or writable) view over `[...]` elements of the storage, owned by the
    /// `base` (the Python pool object): a NumPy array, or a `DeviceTensor` for a CUDA pool.
    pub(crate) fn view<'py>(
        &self,
        base: &Bound<'py, PyAny>,
        offset: usize,
        shape: &[usize],
        strides: &[usize],
        writeable: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = self;
        let es = me.dtype.size();
        let byte_strides: Vec<isize> = strides.iter().map(|&s| (s * es) as isize).collect();
        // SAFETY: the pool's storage is never reallocated and lives as long as `slf`, the base.
        unsafe {
            borrowed_view(
                base,
                me.device,
                (me.data + offset * es) as *mut u8,
                me.dtype,
                shape,
                &byte_strides,
                writeable,
            )
        }
    }
}

/// An int32 NumPy array owning `v`.
pub(crate) fn i32_array<'py>(py: Python<'py>, v: Vec<i32>) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_vec(py, v)
}

/// Slots as an int64 array: `[n]` for one layer group, `[groups, n]` for several.
pub(crate) fn slot_array(
    py: Python<'_>,
    slots: Vec<i64>,
    groups: usize,
) -> PyResult<Bound<'_, PyAny>> {
    let n = slots.len() / groups;
    let arr = PyArray1::from_vec(py, slots);
    if groups == 1 {
        Ok(arr.into_any())
    } else {
        Ok(arr.reshape([groups, n])?.into_any())
    }
}
