//! What every `attention` method shares: its keyword arguments (`scale`, `softcap`,
//! `sinks`, `alibi_slopes`, `out`) and running the core with the GIL released.

use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;

use super::errors::ToPython;
use super::input::{read_tensor, Target};
use super::output::{new_output, writable};
use kvrs::unstable::{TensorMut, TensorRef};
use kvrs::{AttnOptions, KvError, Result};

/// The model-specific options of an attention call, owned.
pub struct AttnArgs {
    scale: Option<f32>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
    alibi_slopes: Option<Vec<f32>>,
    latent: bool,
}

impl AttnArgs {
    /// Reads the keyword arguments; `sinks` and `alibi_slopes` are any 1-D float
    /// sequence or array (one value per query head); `latent`: absorbed MLA attention.
    pub fn parse(
        scale: Option<f64>,
        softcap: Option<f64>,
        sinks: Option<&Bound<'_, PyAny>>,
        alibi_slopes: Option<&Bound<'_, PyAny>>,
        latent: bool,
    ) -> PyResult<Self> {
        Ok(AttnArgs {
            scale: scale.map(|s| s as f32),
            softcap: softcap.map(|s| s as f32),
            sinks: sinks.map(|s| floats(s, "sinks")).transpose()?,
            alibi_slopes: alibi_slopes
                .map(|s| floats(s, "alibi_slopes"))
                .transpose()?,
            latent,
        })
    }

    /// Elements per output head of attention over K/V heads of `head_dim` and
    /// `v_head_dim`: the values', or the latent's for latent attention.
    pub fn out_dim(&self, head_dim: usize, v_head_dim: usize) -> usize {
        let heads = kvrs::unstable::KvHeads {
            num_kv_heads: 1,
            head_dim,
            v_head_dim,
        };
        heads.attended(self.latent).v_head_dim
    }

    /// The options as the core takes them.
    pub fn options(&self) -> AttnOptions<'_> {
        AttnOptions {
            latent: self.latent,
            scale: self.scale,
            softcap: self.softcap,
            sinks: self.sinks.as_deref(),
            alibi_slopes: self.alibi_slopes.as_deref(),
            mask: None,
        }
    }
}

/// A 1-D float32 copy of `obj` (a list, NumPy array or CPU tensor).
fn floats(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Vec<f32>> {
    let py = obj.py();
    let obj = if obj.hasattr(intern!(py, "detach"))? {
        obj.call_method0(intern!(py, "detach"))?
            .call_method0(intern!(py, "float"))?
            .call_method0(intern!(py, "cpu"))?
            .call_method0(intern!(py, "numpy"))?
    } else {
        obj.clone()
    };
    let arr = py
        .import(intern!(py, "numpy"))?
        .call_method1(intern!(py, "asarray"), (obj, "float32"))?;
    let arr: PyReadonlyArrayDyn<'_, f32> = arr.extract()?;
    if arr.ndim() != 1 {
        return Err(KvError::Shape {
            name,
            got: arr.shape().to_vec(),
            expected: "[num_q_heads] (1-D)".into(),
        }
        .py());
    }
    let mut v = kvrs::unstable::sizes::with_capacity(name, arr.len()).py()?;
    v.extend(arr.as_array().iter().copied());
    Ok(v)
}

/// Reads `q` (`[n, num_q_heads, head_dim]`), makes the output (`out`, or a fresh array
/// `[n, num_q_heads, out_dim]` of `q`'s dtype on the device of `target`, the cache
/// attended over; `out` must not overlap its storage) and runs `f(q, out)`, which
/// enters the cache's lock with the GIL released; returns the output.
pub fn run<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    target: &Target,
    out_dim: usize,
    f: impl FnOnce(&TensorRef<'_>, &mut TensorMut<'_>) -> Result<()>,
) -> PyResult<Bound<'py, PyAny>> {
    let q_in = read_tensor(q, "q", &Target::device_only(target.device))?;
    let qt = q_in.tensor();
    let mut o = match out {
        Some(o) => writable(o, "out", target)?,
        None => {
            // A malformed q keeps its own shape: the core names what it expected.
            let mut shape = qt.shape().to_vec();
            if let [.., last] = shape.as_mut_slice() {
                *last = out_dim;
            }
            new_output(py, target.device, qt.dtype(), &shape)?
        }
    };
    f(&qt, &mut o.tensor()).py()?;
    Ok(o.into_object())
}
