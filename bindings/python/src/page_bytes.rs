//! The bytes of one page handed in from Python, read in place: a NumPy array (any
//! dtype) directly, anything with `__dlpack__` (a torch CPU tensor) through DLPack, and
//! anything else with the buffer protocol (`bytes`, `bytearray`, `memoryview`) through
//! `numpy.frombuffer`. The memory must be one C-contiguous run on the host; a
//! destination must be writable. Nothing is copied here.

use dlpark::ffi::{DLDeviceType, DLManagedTensor, DLManagedTensorVersioned, DLTensor};
use dlpark::{DlpackFlags, ManagedBox};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;

/// `NPY_ARRAY_C_CONTIGUOUS`.
const C_CONTIGUOUS: i32 = 0x0001;
/// `NPY_ARRAY_WRITEABLE`.
const WRITEABLE: i32 = 0x0400;

/// What keeps the memory alive; held, never read.
#[allow(dead_code)]
enum Owner<'py> {
    Array(Bound<'py, PyAny>),
    Versioned(ManagedBox<DLManagedTensorVersioned>),
    Legacy(ManagedBox<DLManagedTensor>),
}

/// One page's memory, borrowed from a Python object held for as long as this lives.
pub struct PageBytes<'py> {
    ptr: *mut u8,
    len: usize,
    _owner: Owner<'py>,
}

impl PageBytes<'_> {
    /// The bytes, to read.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes at `ptr` belong to the held owner (checked contiguous);
        // a zero-length page is never handed to the store.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, to write (only for a destination read with `writable`).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and the memory was checked writable.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The addresses `start..end` of its bytes.
    pub fn span(&self) -> std::ops::Range<usize> {
        self.ptr as usize..self.ptr as usize + self.len
    }
}

fn bad(name: &str, index: usize, reason: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{name}[{index}]: {reason}"))
}

/// Reads item `index` of argument `name` as one page's bytes (`writable`: a
/// destination).
pub fn read_page<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    index: usize,
    writable: bool,
) -> PyResult<PageBytes<'py>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return from_array(arr, name, index, writable);
    }
    if obj.hasattr(intern!(py, "__dlpack__"))? {
        return from_dlpack(obj, name, index, writable);
    }
    let arr = py
        .import(intern!(py, "numpy"))?
        .call_method1(intern!(py, "frombuffer"), (obj, intern!(py, "uint8")))
        .map_err(|e| {
            PyTypeError::new_err(format!(
                "{name}[{index}] must be a NumPy array, a CPU tensor (DLPack) or a bytes-like \
                 object, not {}: {e}",
                obj.get_type().name().map_or("?".into(), |n| n.to_string())
            ))
        })?;
    from_array(&arr.cast_into::<PyUntypedArray>()?, name, index, writable)
}

fn from_array<'py>(
    arr: &Bound<'py, PyUntypedArray>,
    name: &str,
    index: usize,
    writable: bool,
) -> PyResult<PageBytes<'py>> {
    // SAFETY: `arr` is an ndarray; its flags and data pointer are plain data.
    let (flags, data) = unsafe {
        let raw = &*arr.as_array_ptr();
        (raw.flags, raw.data as *mut u8)
    };
    if flags & C_CONTIGUOUS == 0 {
        return Err(bad(
            name,
            index,
            "must be C-contiguous (np.ascontiguousarray)",
        ));
    }
    if writable && flags & WRITEABLE == 0 {
        return Err(bad(
            name,
            index,
            "is read-only; a destination must be writable",
        ));
    }
    let itemsize = arr.dtype().itemsize();
    let len = arr.shape().iter().product::<usize>() * itemsize;
    Ok(PageBytes {
        ptr: data,
        len,
        _owner: Owner::Array(arr.clone().into_any()),
    })
}

fn from_dlpack<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    index: usize,
    writable: bool,
) -> PyResult<PageBytes<'py>> {
    let owner = match obj.extract::<ManagedBox<DLManagedTensorVersioned>>() {
        Ok(m) => Owner::Versioned(m),
        // Producers that predate DLPack 1.0 reject `max_version`: take the legacy capsule.
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => {
            Owner::Legacy(obj.extract().map_err(|e| bad(name, index, e))?)
        }
        Err(e) => return Err(bad(name, index, e)),
    };
    let (t, read_only): (&DLTensor, bool) = match &owner {
        Owner::Versioned(m) => (m.tensor(), m.flags().contains(DlpackFlags::READ_ONLY)),
        Owner::Legacy(m) => (m.tensor(), false),
        Owner::Array(_) => unreachable!("built from DLPack above"),
    };
    if !matches!(
        t.device.device_type,
        DLDeviceType::CPU | DLDeviceType::CUDAHOST
    ) {
        return Err(bad(
            name,
            index,
            format!(
                "lives on DLPack device type {}; pages are read from host memory (a CPU tensor)",
                t.device.device_type.0
            ),
        ));
    }
    if writable && read_only {
        return Err(bad(
            name,
            index,
            "is read-only; a destination must be writable",
        ));
    }
    let ndim = t.ndim.max(0) as usize;
    // SAFETY: the managed tensor (held in the owner) owns its shape and strides.
    let shape: &[i64] = match ndim {
        0 => &[],
        _ => unsafe { std::slice::from_raw_parts(t.shape, ndim) },
    };
    if !t.strides.is_null() {
        // SAFETY: as the shape.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut want = 1i64;
        for (&n, &s) in shape.iter().zip(strides).rev() {
            if n > 1 && s != want {
                return Err(bad(name, index, "must be contiguous (x.contiguous())"));
            }
            want *= n;
        }
    }
    let elems: usize = shape.iter().map(|&n| n.max(0) as usize).product();
    let bits = t.dtype.bits as usize * t.dtype.lanes as usize;
    if !bits.is_multiple_of(8) {
        return Err(bad(name, index, "has elements of a fractional byte size"));
    }
    // SAFETY: `data + byte_offset` is the tensor's first element (DLPack's contract).
    let ptr = unsafe { (t.data as *mut u8).add(t.byte_offset as usize) };
    Ok(PageBytes {
        ptr,
        len: elems * bits / 8,
        _owner: owner,
    })
}
