//! Arguments that accept several Python spellings: dtypes, devices and CUDA streams.

use pyo3::prelude::*;
use pyo3::types::PyString;

use super::errors::ToPython;
use kvrs::{DType, Device, KvError};

/// Parses a dtype given as a string (`"float16"`, `"bf16"`), a NumPy dtype or scalar type
/// (`numpy.float16`, `ml_dtypes.bfloat16`) or a torch dtype (`torch.bfloat16`).
pub fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    if let Ok(s) = obj.cast::<PyString>() {
        let s = s.to_str()?;
        if s.trim().eq_ignore_ascii_case("auto") {
            return Err(KvError::InvalidArgument {
                name: "dtype",
                value: "'auto'".into(),
                reason: "'auto' means a model's dtype, which only the transformers \
                         integration knows: block_pool_from_config(model, dtype='auto') or \
                         KvrsCache.from_config(model, ...); here give 'float16', \
                         torch.bfloat16, ..."
                    .into(),
            }
            .py());
        }
        return s.parse().py();
    }
    let text = obj.str()?.to_string();
    if let Some(name) = text.strip_prefix("torch.") {
        return name.parse().py();
    }
    let py = obj.py();
    let name = py
        .import("numpy")?
        .call_method1("dtype", (obj,))
        .and_then(|d| d.getattr("name"))
        .and_then(|n| n.extract::<String>())
        .unwrap_or(text);
    name.parse().py()
}

/// Parses `"cpu"`, `"cuda"`, `"cuda:N"` (or anything whose `str()` is one of those, such
/// as a `torch.device`).
pub fn parse_device(obj: &Bound<'_, PyAny>) -> PyResult<Device> {
    obj.str()?.to_str()?.parse().py()
}

/// Parses a CUDA stream: `None` (kvrs's own stream), an integer handle, or a stream
/// object: `cuda_stream` (`torch.cuda.Stream`), `__cuda_stream__()` (the CUDA stream
/// protocol's `(version, handle)`) or `ptr` (`cupy.cuda.Stream`).
pub fn parse_stream(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let handle = if let Ok(h) = obj.extract::<u64>() {
        Some(h)
    } else if let Ok(h) = obj.getattr("cuda_stream") {
        h.extract::<u64>().ok()
    } else if let Ok(p) = obj.call_method0("__cuda_stream__") {
        p.get_item(1).and_then(|h| h.extract::<u64>()).ok()
    } else if let Ok(h) = obj.getattr("ptr") {
        h.extract::<u64>().ok()
    } else {
        None
    };
    handle.map(Some).ok_or_else(|| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "stream must be None, a CUDA stream handle (int >= 0) or a stream object \
             (torch.cuda.Stream, cupy.cuda.Stream, or one with __cuda_stream__), not {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "that".into(), |n| n.to_string())
        ))
    })
}

/// The torch dtype that holds `dtype`'s elements (`torch.float8_e4m3fn` for fp8 E4M3,
/// `torch.int8` for int8 codes); an `ImportError` naming the fix without torch.
pub fn torch_dtype<'py>(py: Python<'py>, dtype: DType) -> PyResult<Bound<'py, PyAny>> {
    let torch = py.import("torch").map_err(|e| {
        pyo3::exceptions::PyImportError::new_err(format!(
            "torch_dtype needs torch (pip install torch): {e}"
        ))
    })?;
    torch.getattr(match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F8E4M3 => "float8_e4m3fn",
        DType::F8E5M2 => "float8_e5m2",
        DType::I8 => "int8",
    })
}
