//! The Python side of 8-bit caches: the fp8 scales constructors take and properties
//! return, and the scale arrays that go with the raw codes.

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::output::new_output;
use super::views::borrowed_view;

use super::errors::ToPython;
use kvrs::unstable::{CacheCore, TensorMut};
use kvrs::{DType, Device, Kv, KvError, KvScales};

/// The scales `k_scale` and `v_scale` give (each a float, `num_layers` floats or a
/// `[num_layers, num_kv_heads]` array; a missing one is 1.0); unit scales when neither
/// is given.
pub fn parse_scales(
    k: Option<&Bound<'_, PyAny>>,
    v: Option<&Bound<'_, PyAny>>,
    num_layers: usize,
    num_kv_heads: usize,
) -> PyResult<KvScales> {
    if k.is_none() && v.is_none() {
        return KvScales::unit(num_layers, num_kv_heads).py();
    }
    let read = |name: &'static str, obj: Option<&Bound<'_, PyAny>>| -> PyResult<Vec<f32>> {
        let Some(obj) = obj else {
            return Ok(vec![1.0]);
        };
        let py = obj.py();
        let np = py.import("numpy")?;
        let arr = np
            .call_method1("asarray", (obj,))
            .and_then(|a| a.call_method1("astype", ("float32",)))
            .map_err(|e| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "{name} must be a float or an array of floats: {e}"
                ))
            })?;
        let shape: Vec<usize> = arr.getattr("shape")?.extract()?;
        let fits = match shape.as_slice() {
            [] | [_] => true,
            [l, h] => *l == num_layers && *h == num_kv_heads,
            _ => false,
        };
        if !fits {
            return Err(KvError::Shape {
                name,
                got: shape,
                expected: format!(
                    "a float, [{num_layers}] (per layer) or [{num_layers}, {num_kv_heads}] \
                     (per layer and KV head)"
                ),
            }
            .py());
        }
        let flat = arr.call_method0("ravel")?;
        let flat = flat.cast::<PyArray1<f32>>()?;
        Ok(flat.to_vec()?)
    };
    KvScales::new(
        num_layers,
        num_kv_heads,
        &read("k_scale", k)?,
        &read("v_scale", v)?,
    )
    .py()
}

/// The `[num_layers, num_kv_heads]` scales of K or V of an fp8 cache; `None` for others.
pub fn scale_property<'py>(
    py: Python<'py>,
    dtype: DType,
    scales: &KvScales,
    kv: Kv,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if dtype.fp8().is_none() {
        return Ok(None);
    }
    let all = match kv {
        Kv::Key => scales.keys(),
        Kv::Value => scales.values(),
    };
    let h = scales.num_kv_heads();
    let arr = PyArray1::from_slice(py, all).reshape([all.len() / h, h])?;
    Ok(Some(arr.into_any()))
}

/// A layer's per-head scales as `[num_kv_heads, 1]` float32 (ones for float dtypes): the
/// shape that broadcasts against `[num_kv_heads, len]` per-token scales.
pub fn head_scales<'py>(
    py: Python<'py>,
    scales: &KvScales,
    layer: usize,
    kv: Kv,
) -> PyResult<Bound<'py, PyAny>> {
    let s = scales.heads(layer, kv);
    Ok(PyArray1::from_slice(py, s)
        .reshape([s.len(), 1])?
        .into_any())
}

/// The dtype copies out of a cache of `storage` come in: the storage dtype, or float32
/// (dequantized) for 8-bit storage.
pub fn read_dtype(storage: DType) -> DType {
    if storage.is_quantized() {
        DType::F32
    } else {
        storage
    }
}

/// Float32 `[heads, len, dims[0]]` and `[heads, len, dims[1]]` copies (K, V) of a layer
/// on `device`. `read` fills
/// them under the cache's lock (a cache's `extract_block` over the layer's positions)
/// and returns `Err(now)` when the layer no longer holds `len` positions; they are then
/// made again at that length, so the length and the values come from one locked read.
pub fn dequantized_pair<'py>(
    py: Python<'py>,
    device: Device,
    heads: usize,
    mut len: usize,
    dims: [usize; 2],
    mut read: impl FnMut(
        &mut TensorMut<'_>,
        &mut TensorMut<'_>,
        usize,
    ) -> kvrs::Result<Result<(), usize>>,
) -> PyResult<Bound<'py, PyTuple>> {
    loop {
        let mut k = new_output(py, device, DType::F32, &[heads, len, dims[0]])?;
        let mut v = new_output(py, device, DType::F32, &[heads, len, dims[1]])?;
        match read(&mut k.tensor(), &mut v.tensor(), len).py()? {
            Ok(()) => return PyTuple::new(py, [k.into_object(), v.into_object()]),
            Err(now) => len = now,
        }
    }
}

/// Where a contiguous cache's scales of one layer are, read under its lock: the
/// per-token scales of an int8 cache (zero-copy views are made of them), or the fp8 /
/// unit scales per head.
pub enum LayerScales {
    /// int8: K's scales at `at` (V's follow after `num_kv_heads * max_seq_len` of K's
    /// vectors, each `head_dim / scale_unit` scales).
    Rows {
        /// Address of K's scale of head 0, position 0.
        at: usize,
        /// The cache's shape.
        shape: kvrs::unstable::CacheShape,
        /// Where the scales live.
        device: Device,
        /// Positions the layer holds.
        len: usize,
    },
    /// One scale per head (fp8; 1 for float dtypes).
    Heads(KvScales, usize),
}

impl LayerScales {
    /// The scales of `cache`'s `layer` (a checked index).
    pub fn of(cache: &CacheCore, layer: usize) -> Self {
        match cache.row_scales() {
            Some(r) => {
                let s = cache.shape();
                let at = layer * s.num_kv_heads * s.max_seq_len * (s.head_dim + s.v_head_dim)
                    / s.scale_unit();
                LayerScales::Rows {
                    // The address only; the views are built after the lock is released.
                    at: r.ptr.wrapping_add(at) as usize,
                    shape: s,
                    device: cache.device(),
                    len: cache.layer_len(layer),
                }
            }
            None => LayerScales::Heads(cache.scales().clone(), layer),
        }
    }
}

/// The scales (K, V) of a contiguous cache's layer, owned by `owner` (the Python cache
/// object): int8, zero-copy read-only views `[heads, length]` of the per-token scales
/// (`[heads, length, chunks]` when K and V have different head sizes: a scale per
/// `gcd(head_dim, v_head_dim)` elements); fp8, `[heads, 1]`; float dtypes, ones.
pub fn layer_scales<'py>(
    owner: &Bound<'py, PyAny>,
    scales: LayerScales,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = owner.py();
    let pair = match scales {
        LayerScales::Rows {
            at,
            shape: s,
            device,
            len,
        } => {
            let one = |kv: Kv| {
                // Chunks (scales) per vector: 1 when K and V have one head size.
                let c = s.dim(kv) / s.scale_unit();
                let k_chunks = s.head_dim / s.scale_unit();
                let ptr = (at as *mut f32)
                    .wrapping_add(kv as usize * s.num_kv_heads * s.max_seq_len * k_chunks);
                let (h, m) = (s.num_kv_heads, s.max_seq_len as isize);
                let c4 = 4 * c as isize;
                // SAFETY: the scales are allocated with the storage, never moved, and
                // live as long as `owner`, the array's base.
                unsafe {
                    if c == 1 {
                        borrowed_view(
                            owner,
                            device,
                            ptr as *mut u8,
                            DType::F32,
                            &[h, len],
                            &[4 * m, 4],
                            false,
                        )
                    } else {
                        borrowed_view(
                            owner,
                            device,
                            ptr as *mut u8,
                            DType::F32,
                            &[h, len, c],
                            &[m * c4, c4, 4],
                            false,
                        )
                    }
                }
            };
            [one(Kv::Key)?, one(Kv::Value)?]
        }
        LayerScales::Heads(scales, layer) => [
            head_scales(py, &scales, layer, Kv::Key)?,
            head_scales(py, &scales, layer, Kv::Value)?,
        ],
    };
    PyTuple::new(py, pair)
}
