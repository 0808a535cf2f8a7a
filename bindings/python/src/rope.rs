//! `kvrs.RoPE`: the rotary embedding description a pool uses to re-rotate moved keys.

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::errors::ToPython;
use super::input::{read_ints, read_tensor, Target};
use kvrs::unstable::{copy_strided, Rope, RopeStyle, TensorMut};
use kvrs::{DType, KvError};

/// A rotary position embedding: `theta`, the rotated leading dimensions, the pairing
/// style ('neox': i with i + rotary_dim/2; 'gptj': 2i with 2i+1) and optional linear
/// position scaling ("linear", factor).
#[pyclass(frozen, name = "RoPE", module = "kvrs")]
pub struct PyRope {
    pub(crate) rope: Rope,
}

#[pymethods]
impl PyRope {
    #[new]
    #[pyo3(signature = (theta = 10000.0, rotary_dim = None, style = "neox", scaling = None))]
    fn new(
        theta: f64,
        rotary_dim: Option<usize>,
        style: &str,
        scaling: Option<(String, f64)>,
    ) -> PyResult<Self> {
        let linear_factor = match scaling {
            None => 1.0,
            Some((kind, f)) if kind == "linear" => f,
            Some((kind, _)) => {
                return Err(KvError::InvalidArgument {
                    name: "scaling",
                    value: format!("{kind:?}"),
                    reason: "only ('linear', factor) is supported".into(),
                }
                .py())
            }
        };
        let rope = Rope {
            theta,
            rotary_dim,
            style: style.parse::<RopeStyle>().py()?,
            linear_factor,
        };
        rope.rotary_dim(rotary_dim.unwrap_or(2)).py()?;
        Ok(PyRope { rope })
    }

    /// Base of the rotation frequencies.
    #[getter]
    fn theta(&self) -> f64 {
        self.rope.theta
    }

    /// Rotated leading dimensions (None: all of head_dim).
    #[getter]
    fn rotary_dim(&self) -> Option<usize> {
        self.rope.rotary_dim
    }

    /// 'neox' or 'gptj'.
    #[getter]
    fn style(&self) -> &'static str {
        match self.rope.style {
            RopeStyle::Neox => "neox",
            RopeStyle::Gptj => "gptj",
        }
    }

    /// ('linear', factor), or None.
    #[getter]
    fn scaling<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if self.rope.linear_factor == 1.0 {
            return Ok(None);
        }
        Ok(Some(PyTuple::new(
            py,
            [
                ("linear").into_pyobject(py)?.into_any(),
                self.rope.linear_factor.into_pyobject(py)?.into_any(),
            ],
        )?))
    }

    /// Rotates x ([n, head_dim] or [n, heads, head_dim]; any float dtype kvrs reads)
    /// to `positions` (one per row of n); returns a new float32 array.
    fn apply<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        positions: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let input = read_tensor(x, "x", &Target::device_only(kvrs::Device::Cpu))?;
        let t = input.tensor();
        let shape = t.shape().to_vec();
        let positions = read_ints(positions, "positions")?;
        if shape.len() < 2 || shape[0] != positions.len() {
            return Err(KvError::Shape {
                name: "x",
                got: shape,
                expected: format!(
                    "[{} (one row per position), ..., head_dim]",
                    positions.len()
                ),
            }
            .py());
        }
        let head_dim = *shape.last().expect("rank >= 2");
        let per_row: usize = shape[1..].iter().product();
        let out = PyArray1::<f32>::zeros(py, shape.iter().product::<usize>(), false);
        {
            let mut view = unsafe { out.as_array_mut() };
            let buf = view.as_slice_mut().expect("fresh contiguous array");
            let mut dst = TensorMut::from_f32_mut(buf, &shape).py()?;
            // SAFETY: both tensors are valid for their shapes; the output is fresh.
            unsafe {
                copy_strided(
                    dst.as_mut_ptr(),
                    DType::F32,
                    dst.strides3(),
                    t.as_ptr(),
                    t.dtype(),
                    t.strides3(),
                    t.shape3(),
                )
            };
            // Rows of no element (a 0 in x's shape) have nothing to rotate.
            for (row, &p) in buf.chunks_exact_mut(per_row.max(1)).zip(&positions) {
                self.rope.rotate(head_dim, row, p as f64).py()?;
            }
        }
        Ok(out.reshape(shape)?.into_any())
    }

    fn __repr__(&self) -> String {
        format!(
            "RoPE(theta={}, rotary_dim={}, style='{}', scaling={})",
            self.rope.theta,
            self.rope
                .rotary_dim
                .map_or("None".into(), |d| d.to_string()),
            self.style(),
            if self.rope.linear_factor == 1.0 {
                "None".to_string()
            } else {
                format!("('linear', {})", self.rope.linear_factor)
            }
        )
    }
}
