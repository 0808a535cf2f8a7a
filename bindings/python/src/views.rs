//! NumPy arrays over kvrs memory (zero-copy, kept alive by their owner) and freshly
//! allocated NumPy arrays of a storage dtype.

use std::ffi::c_void;
use std::ptr;

use numpy::npyffi::{self, npy_intp, NPY_TYPES, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use super::device_tensor::PyDeviceTensor;
use kvrs::{DType, Device};

const NPY_ARRAY_ALIGNED: i32 = 0x0100;
/// NumPy's flag of a writeable array.
pub const NPY_ARRAY_WRITEABLE: i32 = 0x0400;

static BFLOAT16: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();
static FLOAT8_E4M3FN: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();
static FLOAT8_E5M2: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();
static HOST_ARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The NumPy dtype of `dtype`: NumPy's own for float32, float16 and int8; ml_dtypes'
/// `bfloat16`, `float8_e4m3fn` and `float8_e5m2` for the others.
pub fn descr<'py>(py: Python<'py>, dtype: DType) -> PyResult<Bound<'py, PyArrayDescr>> {
    match dtype {
        DType::F32 => Ok(builtin(py, NPY_TYPES::NPY_FLOAT)),
        DType::F16 => Ok(builtin(py, NPY_TYPES::NPY_HALF)),
        DType::I8 => Ok(builtin(py, NPY_TYPES::NPY_BYTE)),
        DType::BF16 => bfloat16(py).cloned(),
        DType::F8E4M3 => ml_dtype(py, &FLOAT8_E4M3FN, "float8_e4m3fn").cloned(),
        DType::F8E5M2 => ml_dtype(py, &FLOAT8_E5M2, "float8_e5m2").cloned(),
    }
}

fn builtin(py: Python<'_>, t: NPY_TYPES) -> Bound<'_, PyArrayDescr> {
    // SAFETY: DescrFromType returns a new reference to a builtin descriptor.
    unsafe {
        let d = PY_ARRAY_API.PyArray_DescrFromType(py, t as _);
        Bound::from_owned_ptr(py, d.cast()).cast_into_unchecked()
    }
}

/// The cached `numpy.dtype(ml_dtypes.bfloat16)`.
pub fn bfloat16(py: Python<'_>) -> PyResult<&Bound<'_, PyArrayDescr>> {
    ml_dtype(py, &BFLOAT16, "bfloat16")
}

/// The cached `numpy.dtype(ml_dtypes.<name>)`.
fn ml_dtype<'py>(
    py: Python<'py>,
    cell: &'static PyOnceLock<Py<PyArrayDescr>>,
    name: &str,
) -> PyResult<&'py Bound<'py, PyArrayDescr>> {
    cell.get_or_try_init(py, || {
        let ml = py.import("ml_dtypes").map_err(|e| {
            pyo3::exceptions::PyImportError::new_err(format!(
                "{name} arrays need the ml_dtypes package (pip install ml_dtypes): {e}"
            ))
        })?;
        let d = PyArrayDescr::new(py, ml.getattr(name)?)?;
        Ok::<_, PyErr>(d.unbind())
    })
    .map(|d| d.bind(py))
}

/// The array type of `dtype`'s arrays: `kvrs.HostArray` (an ndarray that exports itself
/// through DLPack) for the ml_dtypes dtypes NumPy cannot export (bfloat16, fp8), else
/// `numpy.ndarray` (also when the package's module cannot be imported).
fn array_type(py: Python<'_>, dtype: DType) -> *mut pyo3::ffi::PyTypeObject {
    // SAFETY: NumPy's C API is loaded (this module imports numpy before any array).
    let plain = || unsafe { npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type) };
    if matches!(dtype, DType::F32 | DType::F16 | DType::I8) {
        return plain();
    }
    HOST_ARRAY
        .get_or_try_init(py, || {
            let t = py.import("kvrs._host_array")?.getattr("HostArray")?;
            Ok::<_, PyErr>(t.cast_into::<PyType>()?.unbind())
        })
        .map_or_else(|_| plain(), |t| t.as_ptr() as *mut pyo3::ffi::PyTypeObject)
}

/// Calls `PyArray_NewFromDescr` for an ndarray of `dtype` and `shape`: over `data` with byte
/// `strides` when given, else over fresh C-contiguous memory that NumPy allocates.
///
/// # Safety
/// When `data` is given it must be valid for every element the layout addresses.
unsafe fn ndarray<'py>(
    py: Python<'py>,
    dtype: DType,
    shape: &[usize],
    layout: Option<(*mut u8, &[isize])>,
    flags: i32,
) -> PyResult<Bound<'py, PyAny>> {
    let mut dims: [npy_intp; 8] = [0; 8];
    let mut st: [npy_intp; 8] = [0; 8];
    for (i, &d) in shape.iter().enumerate() {
        dims[i] = d as npy_intp;
    }
    let (data, strides) = match layout {
        Some((data, strides)) => {
            for (i, &s) in strides.iter().enumerate() {
                st[i] = s as npy_intp;
            }
            (data as *mut c_void, st.as_mut_ptr())
        }
        None => (ptr::null_mut(), ptr::null_mut()),
    };
    let arr = PY_ARRAY_API.PyArray_NewFromDescr(
        py,
        array_type(py, dtype),
        descr(py, dtype)?.into_ptr() as *mut _,
        shape.len() as i32,
        dims.as_mut_ptr(),
        strides,
        data,
        flags,
        ptr::null_mut(),
    );
    Bound::from_owned_ptr_or_err(py, arr)
}

/// A NumPy array over `data` with `shape` and byte `strides`, whose base is `owner`, so
/// the memory outlives the array. Read-only unless `writeable`.
///
/// # Safety
/// `data` must stay valid for every element the layout addresses for as long as `owner`
/// is alive.
pub unsafe fn borrowed_array<'py>(
    owner: &Bound<'py, PyAny>,
    data: *mut u8,
    dtype: DType,
    shape: &[usize],
    strides: &[isize],
    writeable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = owner.py();
    let flags = NPY_ARRAY_ALIGNED | if writeable { NPY_ARRAY_WRITEABLE } else { 0 };
    let arr = ndarray(py, dtype, shape, Some((data, strides)), flags)?;
    // SetBaseObject steals the reference it is given.
    if PY_ARRAY_API.PyArray_SetBaseObject(py, arr.as_ptr() as *mut _, owner.clone().into_ptr()) != 0
    {
        return Err(PyErr::fetch(py));
    }
    Ok(arr)
}

/// A new, uninitialised C-contiguous NumPy array and its data pointer.
pub fn new_array<'py>(
    py: Python<'py>,
    dtype: DType,
    shape: &[usize],
) -> PyResult<(Bound<'py, PyAny>, *mut u8)> {
    // SAFETY: NumPy allocates the data itself.
    let arr = unsafe { ndarray(py, dtype, shape, None, 0)? };
    // SAFETY: `arr` is an ndarray; its data pointer is valid while it lives.
    let data = unsafe { (*(arr.as_ptr() as *mut npyffi::PyArrayObject)).data as *mut u8 };
    Ok((arr, data))
}

/// A view of `len` elements of a cache's memory at `data` (`owner` keeps it alive):
/// a NumPy array for host caches, a [`PyDeviceTensor`] for CUDA caches.
///
/// # Safety
/// As for [`borrowed_array`].
pub unsafe fn borrowed_view<'py>(
    owner: &Bound<'py, PyAny>,
    device: Device,
    data: *mut u8,
    dtype: DType,
    shape: &[usize],
    strides: &[isize],
    writeable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    match device {
        Device::Cpu => borrowed_array(owner, data, dtype, shape, strides, writeable),
        Device::Cuda(ordinal) => {
            let es = dtype.size() as isize;
            let elems: Vec<isize> = strides.iter().map(|s| s / es).collect();
            PyDeviceTensor::view(owner, data as u64, dtype, ordinal, shape, &elems)
        }
    }
}

/// Whether `d` is the bfloat16 dtype (false when ml_dtypes is not importable).
pub fn is_bfloat16(py: Python<'_>, d: &Bound<'_, PyArrayDescr>) -> bool {
    bfloat16(py)
        .map(|b| b.is(d) || b.is_equiv_to(d))
        .unwrap_or(false)
}
