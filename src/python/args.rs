//! Arguments that accept several Python spellings: dtypes and devices.

use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::dtype::DType;
use crate::error::KvError;
use crate::storage::Device;

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
            .into());
        }
        return Ok(s.parse()?);
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
