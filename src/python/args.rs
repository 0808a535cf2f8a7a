//! Arguments that accept several Python spellings: dtypes and devices.

use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::dtype::DType;
use crate::storage::Device;

/// Parses a dtype given as a string (`"float16"`, `"bf16"`), a NumPy dtype or scalar type
/// (`numpy.float16`, `ml_dtypes.bfloat16`) or a torch dtype (`torch.bfloat16`).
pub fn parse_dtype(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.parse()?);
    }
    let text = obj.str()?.to_string();
    if let Some(name) = text.strip_prefix("torch.") {
        return Ok(name.parse()?);
    }
    let py = obj.py();
    let name = py
        .import("numpy")?
        .call_method1("dtype", (obj,))
        .and_then(|d| d.getattr("name"))
        .and_then(|n| n.extract::<String>())
        .unwrap_or(text);
    Ok(name.parse()?)
}

/// Parses `"cpu"`, `"cuda"`, `"cuda:N"` (or anything whose `str()` is one of those, such
/// as a `torch.device`).
pub fn parse_device(obj: &Bound<'_, PyAny>) -> PyResult<Device> {
    Ok(obj.str()?.to_str()?.parse()?)
}
