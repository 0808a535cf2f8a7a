//! Where the core writes what a call returns: a caller's `out=` array (checked to be
//! writable and apart from the cache's storage) or a fresh array (NumPy on the host, a
//! `DeviceTensor` on CUDA), each held with the tensor the core writes through.

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::device_tensor::PyDeviceTensor;
use super::errors::ToPython;
use super::input::{read_writable, Target};
use super::views::new_array;
use kvrs::unstable::TensorMut;
use kvrs::{DType, Device, KvError};

/// NumPy's flag of a writable array.
const NPY_ARRAY_WRITEABLE: i32 = 0x0400;

/// A Python object the core writes into, and the tensor over its memory.
pub struct Output<'py> {
    obj: Bound<'py, PyAny>,
    /// Valid while `obj` lives: handed out only reborrowed through [`Output::tensor`],
    /// whose mutable borrow of `self` bounds it.
    tensor: TensorMut<'static>,
}

impl<'py> Output<'py> {
    /// The tensor the core writes through, borrowing this output mutably.
    pub fn tensor(&mut self) -> TensorMut<'_> {
        self.tensor.reborrow()
    }

    /// The Python object, once the core has written it.
    pub fn into_object(self) -> Bound<'py, PyAny> {
        self.obj
    }
}

/// Reads a caller's destination (argument `name`): a writable NumPy array for a host
/// cache, a tensor on the cache's device (through DLPack) for a CUDA cache. It must not
/// share memory with the cache's storage (`target`): the core would then overwrite
/// other sequences' K/V.
pub fn writable<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    target: &Target,
) -> PyResult<Output<'py>> {
    if target.device == Device::Cpu {
        let arr = obj
            .cast::<PyUntypedArray>()
            .map_err(|_| PyTypeError::new_err(format!("{name} must be a writable NumPy array")))?;
        // SAFETY: `arr` is an ndarray; its flags are plain data.
        let flags = unsafe { (*arr.as_array_ptr()).flags };
        if flags & NPY_ARRAY_WRITEABLE == 0 {
            return Err(KvError::InvalidArgument {
                name,
                value: "a read-only array".into(),
                reason: "must be writable".into(),
            }
            .py());
        }
        let d = arr.dtype();
        if d.is_native_byteorder() == Some(false) {
            // Reading converts through a copy; writing into one would lose the result.
            return Err(KvError::InvalidArgument {
                name,
                value: format!("an array of dtype '{}'", d.str()?),
                reason: "must be in the machine's byte order to be written in place: \
                         pass an array of dtype.newbyteorder('=')"
                    .into(),
            }
            .py());
        }
    }
    let tensor = read_writable(obj, name, target.device)?;
    if tensor.may_overlap_itself() {
        return Err(KvError::InvalidArgument {
            name,
            value: format!("an array of strides {:?} (elements)", tensor.strides3()),
            reason: "must not overlap itself (a broadcast or as_strided view): two results \
                     would land in one element; pass a separate array"
                .into(),
        }
        .py());
    }
    if target.overlaps(tensor.device(), &tensor.span()) {
        return Err(KvError::InvalidArgument {
            name,
            value: "an array sharing memory with this cache".into(),
            reason: "must not overlap the cache's storage (a view of the cache would be \
                     overwritten); pass a separate array"
                .into(),
        }
        .py());
    }
    Ok(Output {
        obj: obj.clone(),
        tensor,
    })
}

/// A fresh C-contiguous output of `dtype` and `shape` where a cache on `device` writes
/// it: a NumPy array for host caches, a [`PyDeviceTensor`] for CUDA caches.
pub fn new_output<'py>(
    py: Python<'py>,
    device: Device,
    dtype: DType,
    shape: &[usize],
) -> PyResult<Output<'py>> {
    let (obj, tensor) = match device {
        Device::Cpu => {
            let (arr, data) = new_array(py, dtype, shape)?;
            // SAFETY: a fresh C-contiguous array of exactly this shape, held in the
            // Output beside the tensor.
            (arr, unsafe {
                TensorMut::contiguous(data, dtype, shape).py()?
            })
        }
        Device::Cuda(ordinal) => PyDeviceTensor::fresh(py, ordinal, dtype, shape)?,
    };
    Ok(Output { obj, tensor })
}
