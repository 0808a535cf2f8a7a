//! Reading tensors handed in from Python: NumPy arrays directly, anything with
//! `__dlpack__` (torch, JAX, CuPy) through DLPack, and anything else through
//! `numpy.asarray` (the buffer protocol, `__array__`). Nothing is copied: the core reads
//! the caller's memory in place and converts while it writes. The one exception is an
//! array in the other byte order (`>f4` on a little-endian host), read through a
//! native-order copy; an output in that order is refused. A cache on a CUDA device
//! takes only tensors on that device, and a host cache only host tensors: never a
//! silent copy between them.

use dlpark::ffi::{
    DLDataTypeCode, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned, DLTensor,
};
use dlpark::ManagedBox;
use numpy::{PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;

use super::errors::ToPython;
use super::views::is_bfloat16;
use kvrs::unstable::{copy_strided, sizes, Span, TensorMut, TensorRef, MAX_RANK};
use kvrs::{DType, Device, KvError};

/// The memory a call writes into (a cache's storage allocations, on its device): no
/// input may share a byte with it, or the write would read what it overwrites.
#[derive(Clone, Debug)]
pub struct Target {
    /// Where the cache lives.
    pub device: Device,
    /// The byte ranges of its allocations.
    pub spans: Vec<Span>,
}

impl Target {
    /// A call on `device` that writes no cache memory (attention's queries).
    pub fn device_only(device: Device) -> Self {
        Target {
            device,
            spans: Vec::new(),
        }
    }

    /// Whether a tensor on `device` touching `span` shares memory with the target.
    pub fn overlaps(&self, device: Device, span: &Span) -> bool {
        device == self.device && self.spans.iter().any(|s| s.overlaps(span))
    }
}

/// A tensor borrowed from a Python object; the object (or the DLPack capsule's owner, or
/// a private copy) is held for as long as this value lives, so the tensor stays valid.
pub struct Input<'py> {
    /// Valid while `_owner` lives: handed out only through [`Input::tensor`], whose
    /// borrow of `self` bounds it.
    tensor: TensorRef<'static>,
    /// A stacked input's leading dimension: its length and element stride (`tensor` is
    /// its first entry).
    lead: Option<(usize, isize)>,
    _owner: Owner<'py>,
}

/// What keeps the borrowed memory alive; its fields are held, never read.
#[allow(dead_code)]
enum Owner<'py> {
    Array(Bound<'py, PyAny>),
    Versioned(ManagedBox<DLManagedTensorVersioned>),
    Legacy(ManagedBox<DLManagedTensor>),
    /// A private copy of an input that shared memory with the cache it was written to.
    Copy(Vec<u64>),
}

impl Input<'_> {
    /// The borrowed tensor.
    pub fn tensor(&self) -> TensorRef<'_> {
        self.tensor
    }

    /// A stacked input's entries along its leading dimension (one per layer), each
    /// borrowed like [`Input::tensor`]; the tensor alone when not stacked.
    pub fn layers(&self) -> Vec<TensorRef<'_>> {
        let t = self.tensor;
        let Some((count, stride)) = self.lead else {
            return vec![t];
        };
        let bytes = stride * t.dtype().size() as isize;
        (0..count)
            .map(|l| {
                // SAFETY: entry l of the held input: its first entry's layout, `l` leading
                // strides on (the producer's shape and strides).
                unsafe {
                    TensorRef::new(
                        t.as_ptr().wrapping_offset(l as isize * bytes),
                        t.dtype(),
                        t.shape(),
                        &t.strides3()[MAX_RANK - t.shape().len()..],
                    )
                }
                .expect("the first entry's layout")
                .on(t.device())
            })
            .collect()
    }

    /// This input, or a private contiguous copy of it when it shares memory with
    /// `target` (a view of the cache handed back in): the copy is what the cache held
    /// before the write, as if the input had been copied first.
    fn apart_from(self, name: &'static str, target: &Target) -> PyResult<Self> {
        let views = self.layers();
        let Some(t) = views
            .iter()
            .find(|t| target.overlaps(t.device(), &t.span()))
            .copied()
        else {
            return Ok(self);
        };
        if t.device() != Device::Cpu {
            return Err(KvError::InvalidArgument {
                name,
                value: "a tensor sharing memory with this cache".into(),
                reason: "a device input must not overlap the cache's storage; pass a copy \
                         (x.clone())"
                    .into(),
            }
            .py());
        }
        let shape = t.shape().to_vec();
        let each = t.nbytes();
        let mut copy = sizes::filled(name, (views.len() * each).div_ceil(8), 0u64).py()?;
        {
            let all = bytemuck::cast_slice_mut::<u64, u8>(&mut copy);
            for (t, bytes) in views.iter().zip(all.chunks_mut(each.max(1))) {
                let mut dst =
                    TensorMut::from_bytes_mut(&mut bytes[..each], t.dtype(), &shape).py()?;
                // SAFETY: `t` is valid for reads (held by `self`); `dst` is the fresh copy.
                unsafe {
                    copy_strided(
                        dst.as_mut_ptr(),
                        t.dtype(),
                        dst.strides3(),
                        t.as_ptr(),
                        t.dtype(),
                        t.strides3(),
                        t.shape3(),
                    )
                };
            }
        }
        // SAFETY: the copy is moved into the new Input's owner (a Vec's buffer does not
        // move with it), which outlives every use of the tensor.
        let tensor =
            unsafe { TensorRef::contiguous(copy.as_ptr() as *const u8, t.dtype(), &shape).py()? };
        let numel = shape.iter().product::<usize>() as isize;
        Ok(Input {
            tensor,
            lead: self.lead.map(|(count, _)| (count, numel)),
            _owner: Owner::Copy(copy),
        })
    }
}

/// Reads `obj` (argument `name`) as a tensor of a supported dtype and rank <= 3 on the
/// device of `target`, the cache the call writes; an input that shares memory with the
/// cache's storage is copied first.
pub fn read_tensor<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    target: &Target,
) -> PyResult<Input<'py>> {
    read_any(obj, name, target.device, false)?.apart_from(name, target)
}

/// Reads `obj` (argument `name`) as a stacked tensor of 4 dimensions (one `[n, H, D]`
/// entry per layer, any leading stride; [`Input::layers`]), otherwise as
/// [`read_tensor`] does.
pub fn read_stacked<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    target: &Target,
) -> PyResult<Input<'py>> {
    read_any(obj, name, target.device, true)?.apart_from(name, target)
}

/// Reads `obj` as a tensor on `device`, wherever its memory lies.
fn read_any<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    device: Device,
    stacked: bool,
) -> PyResult<Input<'py>> {
    let py = obj.py();
    if let Device::Cuda(_) = device {
        if !obj.hasattr(intern!(py, "__dlpack__"))? {
            return Err(KvError::Device(format!(
                "{name} is a host array; this cache lives on {device}, so pass a tensor on that device \
                 (torch, CuPy or JAX, through DLPack)"
            ))
            .py());
        }
        return from_dlpack(obj, name, device, stacked);
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return from_numpy(arr, name, stacked);
    }
    if obj.hasattr(intern!(py, "__dlpack__"))? {
        return from_dlpack(obj, name, device, stacked);
    }
    let arr = py
        .import(intern!(py, "numpy"))?
        .call_method1(intern!(py, "asarray"), (obj,))
        .map_err(|e| {
            PyTypeError::new_err(format!(
                "{name} must be an array (NumPy, DLPack or buffer protocol): {e}"
            ))
        })?;
    let arr = arr.cast_into::<PyUntypedArray>().map_err(PyErr::from)?;
    from_numpy(&arr, name, stacked)
}

/// Reads a NumPy array in place, or through a native-order copy (held by the
/// [`Input`]) when its byte order is not the machine's.
fn from_numpy<'py>(
    arr: &Bound<'py, PyUntypedArray>,
    name: &'static str,
    stacked: bool,
) -> PyResult<Input<'py>> {
    let py = arr.py();
    let d = arr.dtype();
    let dtype = match d.num() {
        11 => DType::F32,
        23 => DType::F16,
        _ if is_bfloat16(py, &d) => DType::BF16,
        _ => {
            return Err(KvError::UnsupportedDType {
                name,
                got: d.str()?.to_string(),
            }
            .py())
        }
    };
    if d.is_native_byteorder() == Some(false) {
        let native = arr.call_method1(
            intern!(py, "astype"),
            (d.call_method1(intern!(py, "newbyteorder"), ("=",))?,),
        )?;
        return from_numpy(&native.cast_into::<PyUntypedArray>()?, name, stacked);
    }
    let shape = arr.shape();
    check_rank(name, shape, stacked)?;
    let es = dtype.size() as isize;
    let mut strides = [0isize; MAX_RANK + 1];
    for (i, &s) in arr.strides().iter().enumerate() {
        if s % es != 0 {
            return Err(KvError::InvalidArgument {
                name,
                value: format!("strides {:?}", arr.strides()),
                reason: format!("byte strides must be multiples of the element size {es}"),
            }
            .py());
        }
        strides[i] = s / es;
    }
    // SAFETY: the array object is held in `_owner`, and the tensor is handed out only
    // borrowed from the Input.
    let data = unsafe { (*arr.as_array_ptr()).data as *const u8 };
    let (lead, shape, strides) = split_lead(stacked, shape, &strides[..shape.len()]);
    let tensor = unsafe { TensorRef::new(data, dtype, shape, strides).py()? };
    Ok(Input {
        tensor,
        lead,
        _owner: Owner::Array(arr.clone().into_any()),
    })
}

fn from_dlpack<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    device: Device,
    stacked: bool,
) -> PyResult<Input<'py>> {
    let owner = match obj.extract::<ManagedBox<DLManagedTensorVersioned>>() {
        Ok(m) => Owner::Versioned(m),
        // Producers that predate DLPack 1.0 reject `max_version`: take the legacy capsule.
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => Owner::Legacy(
            obj.extract()
                .map_err(|e| unreadable_device(obj, name, device, e))?,
        ),
        Err(e) => return Err(unreadable_device(obj, name, device, e)),
    };
    let t: &DLTensor = match &owner {
        Owner::Versioned(m) => m.tensor(),
        Owner::Legacy(m) => m.tensor(),
        Owner::Array(_) | Owner::Copy(_) => unreachable!("built from DLPack above"),
    };
    let (kind, id) = (t.device.device_type, t.device.device_id);
    let on = match kind {
        DLDeviceType::CPU | DLDeviceType::CUDAHOST => Some(Device::Cpu),
        DLDeviceType::CUDA => Some(Device::Cuda(id.max(0) as usize)),
        _ => None,
    };
    if on != Some(device) {
        let lives = on.map_or(format!("DLPack device type {} (id {id})", kind.0), |d| {
            d.to_string()
        });
        let hint = match device {
            Device::Cpu => "pass a CPU tensor".to_string(),
            Device::Cuda(_) => format!("pass a tensor on {device}"),
        };
        return Err(KvError::Device(format!(
            "{name} lives on {lives}; this cache lives on {device}, so {hint} (kvrs never copies silently)"
        ))
        .py());
    }
    let dt = t.dtype;
    let dtype = match (dt.code, dt.bits, dt.lanes) {
        (DLDataTypeCode::FLOAT, 32, 1) => DType::F32,
        (DLDataTypeCode::FLOAT, 16, 1) => DType::F16,
        (DLDataTypeCode::BFLOAT, 16, 1) => DType::BF16,
        _ => {
            return Err(KvError::UnsupportedDType {
                name,
                got: dlpack_dtype_name(dt),
            }
            .py())
        }
    };
    let ndim = t.ndim.max(0) as usize;
    // SAFETY: the managed tensor (held in `_owner`) owns shape and strides.
    let shape_i64: &[i64] = if ndim == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let shape: Vec<usize> = shape_i64.iter().map(|&s| s.max(0) as usize).collect();
    check_rank(name, &shape, stacked)?;
    let mut strides = [0isize; MAX_RANK + 1];
    if t.strides.is_null() {
        let mut acc = 1isize;
        for i in (0..ndim).rev() {
            strides[i] = acc;
            acc *= shape[i] as isize;
        }
    } else {
        for (i, s) in strides.iter_mut().enumerate().take(ndim) {
            *s = unsafe { *t.strides.add(i) } as isize;
        }
    }
    // SAFETY: the managed tensor is held in `_owner`, and the tensor is handed out only
    // borrowed from the Input.
    let data = unsafe { (t.data as *const u8).add(t.byte_offset as usize) };
    let (lead, shape, strides) = split_lead(stacked, &shape, &strides[..ndim]);
    let tensor = unsafe { TensorRef::new(data, dtype, shape, strides).py()? }.on(device);
    Ok(Input {
        tensor,
        lead,
        _owner: owner,
    })
}

/// The error of a failed DLPack export: a kvrs `DeviceError` when the producer cannot
/// name the tensor's device in DLPack terms (torch's `meta` device holds no data; others
/// have no DLPack device), else the producer's own error. Asked only after a failure,
/// so a successful read pays nothing for it.
fn unreadable_device(
    obj: &Bound<'_, PyAny>,
    name: &'static str,
    device: Device,
    err: PyErr,
) -> PyErr {
    let py = obj.py();
    if !err.is_instance_of::<pyo3::exceptions::PyException>(py) {
        return err;
    }
    match obj.call_method0(intern!(py, "__dlpack_device__")) {
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyException>(py) => {}
        _ => return err,
    }
    let on = obj
        .getattr(intern!(py, "device"))
        .and_then(|d| d.str().map(|s| s.to_string()))
        .unwrap_or_else(|_| "a device DLPack cannot describe".into());
    KvError::Device(format!(
        "{name} is on {on}, which kvrs cannot read (DLPack cannot describe it; a 'meta' \
         tensor holds no data): pass a tensor with data on {device}, e.g. \
         {name}.to('{device}')"
    ))
    .py()
}

/// A DLPack dtype as NumPy would name it (`float64`, `int8`, `bool8`, ...).
fn dlpack_dtype_name(dt: dlpark::ffi::DLDataType) -> String {
    let kind = match dt.code.0 {
        0 => "int",
        1 => "uint",
        2 => "float",
        4 => "bfloat",
        5 => "complex",
        6 => "bool",
        code => return format!("DLPack type code {code} ({} bits)", dt.bits),
    };
    let lanes = if dt.lanes == 1 {
        String::new()
    } else {
        format!("x{}", dt.lanes)
    };
    format!("{kind}{}{lanes}", dt.bits)
}

fn check_rank(name: &'static str, shape: &[usize], stacked: bool) -> PyResult<()> {
    let expected = match stacked {
        false if shape.len() == MAX_RANK + 1 => format!(
            "at most {MAX_RANK} dimensions; a 4-D [batch, num_heads, seq_len, head_dim] tensor \
             (Hugging Face's layout) holds one sequence per batch row: pass row b as \
             {name}[b].transpose(0, 1), [seq_len, num_heads, head_dim] (NumPy: \
             {name}[b].swapaxes(0, 1))"
        ),
        false if shape.len() > MAX_RANK => format!("at most {MAX_RANK} dimensions"),
        true if shape.len() != MAX_RANK + 1 => {
            "[num_layers, n_tokens, num_kv_heads, head_dim] (4 dimensions)".to_string()
        }
        _ => return Ok(()),
    };
    Err(KvError::Shape {
        name,
        got: shape.to_vec(),
        expected,
    }
    .py())
}

/// A stacked input's leading dimension (length, stride) and the shape and strides of
/// its entries; the whole shape when not stacked.
#[allow(clippy::type_complexity)]
fn split_lead<'a>(
    stacked: bool,
    shape: &'a [usize],
    strides: &'a [isize],
) -> (Option<(usize, isize)>, &'a [usize], &'a [isize]) {
    if stacked {
        (Some((shape[0], strides[0])), &shape[1..], &strides[1..])
    } else {
        (None, shape, strides)
    }
}

/// Runs `f` on the elements of `obj` when it is a C-contiguous 1-D NumPy array of `T`;
/// `None` when it is not one.
fn with_slice<T: numpy::Element + Copy, R>(
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(&[T]) -> R,
) -> Option<R> {
    let arr = obj.cast::<numpy::PyArray1<T>>().ok()?;
    let ro = arr.try_readonly().ok()?;
    Some(f(ro.as_slice().ok()?))
}

/// `s` converted by `f`, in a vector allocated fallibly (`MemoryError` naming `name`
/// when the host refuses it).
fn copy_with<T: Copy, U>(s: &[T], name: &'static str, f: impl Fn(T) -> U) -> PyResult<Vec<U>> {
    let mut v = sizes::with_capacity(name, s.len()).py()?;
    v.extend(s.iter().map(|&x| f(x)));
    Ok(v)
}

/// Reads a slot mapping of one row (`[n]`) or one row per layer group (`[groups, n]`,
/// flattened row after row) as int64 (argument `slot_mapping`).
pub fn read_slot_rows(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let py = obj.py();
    let arr = py
        .import(intern!(py, "numpy"))?
        .call_method1(intern!(py, "asarray"), (obj,))?;
    if arr.getattr(intern!(py, "ndim"))?.extract::<usize>()? == 2 {
        return read_ints(
            &arr.call_method1(intern!(py, "reshape"), (-1,))?,
            "slot_mapping",
        );
    }
    read_ints(obj, "slot_mapping")
}

/// Reads `obj` (argument `name`: a list, tuple or 1-D integer array) as int64 values,
/// copied into a vector allocated fallibly (`MemoryError` when the host refuses it).
pub fn read_ints(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Vec<i64>> {
    let py = obj.py();
    if let Some(v) = with_slice::<i64, _>(obj, |s| copy_with(s, name, |x| x)) {
        return v;
    }
    if let Some(v) = with_slice::<i32, _>(obj, |s| copy_with(s, name, i64::from)) {
        return v;
    }
    // A list of Python ints converts faster item by item than through numpy.asarray.
    if let Ok(list) = obj.cast::<pyo3::types::PyList>() {
        let mut v = sizes::with_capacity(name, list.len()).py()?;
        if list
            .iter()
            .try_for_each(|x| x.extract::<i64>().map(|x| v.push(x)))
            .is_ok()
        {
            return Ok(v);
        }
    }
    let arr = py
        .import(intern!(py, "numpy"))?
        .call_method1(intern!(py, "asarray"), (obj,))?;
    let arr = arr.cast_into::<PyUntypedArray>().map_err(PyErr::from)?;
    let kind = arr.dtype().kind();
    if arr.ndim() != 1 || !(kind == b'i' || kind == b'u' || (kind == b'f' && arr.len() == 0)) {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a 1-D sequence of integers, got dtype {} and shape {:?}",
            arr.dtype().str()?,
            arr.shape()
        )));
    }
    let arr = arr.call_method1(intern!(py, "astype"), ("int64",))?;
    with_slice::<i64, _>(&arr, |s| copy_with(s, name, |x| x))
        .expect("a fresh contiguous int64 array")
}

/// Reads token ids (a 1-D sequence of integers in [0, 2**32)); uint32, int32 and int64
/// arrays are read straight from their memory. The ids are copied into a vector
/// allocated fallibly: an array the host cannot copy raises `MemoryError`.
pub fn read_token_ids(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Vec<u32>> {
    fn narrow<T: Copy + Into<i64>>(s: &[T], name: &'static str) -> PyResult<Vec<u32>> {
        if let Some(&bad) = s
            .iter()
            .find(|&&t| !(0..=u32::MAX as i64).contains(&t.into()))
        {
            let reason = "token ids must be in [0, 2**32)".into();
            return Err(KvError::InvalidArgument {
                name,
                value: bad.into().to_string(),
                reason,
            }
            .py());
        }
        copy_with(s, name, |t| t.into() as u32)
    }
    if let Some(v) = with_slice::<u32, _>(obj, |s| copy_with(s, name, |x| x)) {
        return v;
    }
    if let Some(v) = with_slice::<i64, _>(obj, |s| narrow(s, name)) {
        return v;
    }
    if let Some(v) = with_slice::<i32, _>(obj, |s| narrow(s, name)) {
        return v;
    }
    narrow(&read_ints(obj, name)?, name)
}

/// Reads `obj` (argument `name`) as a destination tensor on `device`: its memory, held
/// by `obj`, which the caller keeps alive for as long as it uses the tensor.
pub(super) fn read_writable(
    obj: &Bound<'_, PyAny>,
    name: &'static str,
    device: Device,
) -> PyResult<TensorMut<'static>> {
    let t = read_any(obj, name, device, false)?.tensor;
    // SAFETY: the memory belongs to `obj` (or a capsule of it that the producer keeps
    // valid while `obj` lives), which the caller holds beside the tensor; NumPy outputs
    // were checked writable.
    unsafe {
        TensorMut::new(
            t.as_ptr() as *mut u8,
            t.dtype(),
            t.shape(),
            &t.strides3()[MAX_RANK - t.shape().len()..],
        )
    }
    .map(|m| m.on(t.device()))
    .py()
}
