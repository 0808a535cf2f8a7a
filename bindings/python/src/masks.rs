//! Reading the custom masks of `ForwardBatch.attention` and `ForwardBatch.get`
//! (FlashInfer's `custom_mask` and `packed_custom_mask`) from Python objects.

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::ToPython;
use kvrs::unstable::{ForwardPlan, MaskInput, PlanMask};

/// Packs the mask a call was given (at most one of the two forms) for `plan`.
pub fn read_mask(
    plan: &ForwardPlan,
    custom_mask: Option<&Bound<'_, PyAny>>,
    packed_custom_mask: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<PlanMask>> {
    match (custom_mask, packed_custom_mask) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(PyValueError::new_err(
            "custom_mask and packed_custom_mask: give one of the two forms, not both",
        )),
        (Some(m), None) => {
            let bytes = flat_bytes(m, "custom_mask", b'b', "bool")?;
            // A bool array's bytes are 0 or 1 (numpy guarantees it for its bool dtype).
            let flat: Vec<bool> = bytes.iter().map(|&b| b != 0).collect();
            Ok(Some(plan.custom_mask(MaskInput::Flat(&flat)).py()?))
        }
        (None, Some(m)) => {
            let bytes = flat_bytes(m, "packed_custom_mask", b'u', "uint8")?;
            Ok(Some(plan.custom_mask(MaskInput::Packed(&bytes)).py()?))
        }
    }
}

/// The elements of `obj` (a NumPy array, a torch tensor, a list) of one-byte dtype
/// `kind` (`dtype_name`), flattened in C order: any other dtype is a TypeError (a float
/// bias mask, where 0 means "attend", must not be read as booleans).
fn flat_bytes(
    obj: &Bound<'_, PyAny>,
    name: &'static str,
    kind: u8,
    dtype_name: &str,
) -> PyResult<Vec<u8>> {
    let py = obj.py();
    let obj = if obj.hasattr(intern!(py, "detach"))? {
        obj.call_method0(intern!(py, "detach"))?
            .call_method0(intern!(py, "cpu"))?
            .call_method0(intern!(py, "numpy"))?
    } else {
        obj.clone()
    };
    let np = py.import(intern!(py, "numpy"))?;
    let arr = np.call_method1(intern!(py, "asarray"), (obj,))?;
    let arr = arr.cast_into::<PyUntypedArray>().map_err(PyErr::from)?;
    let dt = arr.dtype();
    let empty = arr.len() == 0;
    if !(empty || (dt.kind() == kind && dt.itemsize() == 1)) {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a {dtype_name} array (True = may attend), got dtype {}; \
             convert a float bias mask with (bias == 0)",
            dt.str()?
        )));
    }
    let flat = np.call_method1(
        intern!(py, "ascontiguousarray"),
        (arr.call_method1(intern!(py, "reshape"), (-1,))?, "uint8"),
    )?;
    let bytes = flat.call_method0(intern!(py, "tobytes"))?;
    Ok(bytes.cast::<PyBytes>()?.as_bytes().to_vec())
}
