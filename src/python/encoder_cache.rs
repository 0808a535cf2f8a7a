//! `kvrs.EncoderCache`: cross-attention K/V of one encoder input.

use super::attention::{self, AttnArgs};
use parking_lot::RwLock;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::args::{parse_device, parse_dtype};
use super::copying;
use super::input::read_tensor;
use super::kv_cache::layer_view;
use super::quant::{dequantized_pair, layer_scales, parse_scales, scale_property};
use crate::dtype::DType;
use crate::encoder_cache::EncoderCache;
use crate::error::check_size;
use crate::kv_cache::{CacheShape, Kv};
use crate::storage::Device;

/// Position-independent K/V of one encoder input (cross-attention): each layer is
/// written once with `set`, read by every decode step with `get`, and has no causal mask.
#[pyclass(frozen, name = "EncoderCache", module = "kvrs")]
pub struct PyEncoderCache {
    inner: RwLock<EncoderCache>,
    shape: CacheShape,
    dtype: DType,
    device: Device,
    data: usize,
}

#[pymethods]
impl PyEncoderCache {
    /// `EncoderCache[np.ndarray]` or `EncoderCache[kvrs.DeviceTensor]`: the type of its reads, for
    /// annotations (the stub's generic parameter).
    #[classmethod]
    #[pyo3(signature = (item, /))]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        super::generic_alias(cls, item)
    }

    #[new]
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, max_len, *, dtype = None, device = None, k_scale = None, v_scale = None))]
    #[pyo3(
        text_signature = "(num_layers, num_kv_heads, head_dim, max_len, *, dtype='float16', device='cpu', k_scale=None, v_scale=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_layers: i64,
        num_kv_heads: i64,
        head_dim: i64,
        max_len: i64,
        dtype: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        k_scale: Option<&Bound<'_, PyAny>>,
        v_scale: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let shape = CacheShape {
            num_layers: check_size("num_layers", num_layers)?,
            num_kv_heads: check_size("num_kv_heads", num_kv_heads)?,
            head_dim: check_size("head_dim", head_dim)?,
            max_seq_len: check_size("max_len", max_len)?,
        };
        let dtype = dtype.map(parse_dtype).transpose()?.unwrap_or(DType::F16);
        let device = device.map(parse_device).transpose()?.unwrap_or(Device::Cpu);
        // The sizes are checked (and the storage allocated) before the scales are read.
        let cache = EncoderCache::new(shape, dtype, device)?;
        let scales = parse_scales(k_scale, v_scale, shape.num_layers, shape.num_kv_heads)?;
        let cache = cache.with_scales(scales)?;
        let data = cache.cache().data_ptr() as usize;
        Ok(PyEncoderCache {
            inner: RwLock::new(cache),
            shape,
            dtype,
            device,
            data,
        })
    }

    /// Cross-attention of q [n, num_q_heads, head_dim] (any number of decoder tokens)
    /// over every encoder position of `layer` (no causal mask), read in place. Returns
    /// a new array of q's shape and dtype, or fills `out`.
    #[pyo3(signature = (layer, q, *, out = None, scale = None, softcap = None, sinks = None, alibi_slopes = None))]
    #[allow(clippy::too_many_arguments)]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        scale: Option<f64>,
        softcap: Option<f64>,
        sinks: Option<&Bound<'py, PyAny>>,
        alibi_slopes: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let args = AttnArgs::parse(scale, softcap, sinks, alibi_slopes)?;
        attention::run(py, q, out, self.device, |q, o| {
            self.inner.read().attention(layer, q, o, &args.options())
        })
    }

    /// Encoder positions every layer holds (None before the first set).
    #[getter]
    fn length(&self) -> Option<usize> {
        self.inner.read().length()
    }

    /// Encoder positions the cache can hold.
    #[getter]
    fn max_len(&self) -> usize {
        self.shape.max_seq_len
    }

    /// Number of layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.shape.num_layers
    }

    /// Storage dtype name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// Device name.
    #[getter]
    fn device(&self) -> String {
        self.device.to_string()
    }

    /// Whether every layer holds its K/V.
    #[getter]
    fn is_complete(&self) -> bool {
        let c = self.inner.read();
        (0..self.shape.num_layers).all(|l| c.is_set(l))
    }

    /// Whether `layer` holds its K/V.
    fn is_set(&self, layer: i64) -> PyResult<bool> {
        let c = self.inner.read();
        Ok(c.is_set(c.cache().check_layer(layer)?))
    }

    /// Writes `layer`'s K and V ([n, num_kv_heads, head_dim], the same n for every layer),
    /// once until clear().
    fn set(
        &self,
        py: Python<'_>,
        layer: i64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (k, v) = (
            read_tensor(k, "k", self.device)?,
            read_tensor(v, "v", self.device)?,
        );
        let (kt, vt) = (*k.tensor(), *v.tensor());
        Ok(copying(py, kt.nbytes() + vt.nbytes(), || {
            self.inner.write().set(layer, &kt, &vt)
        })?)
    }

    /// The fp8 key scales, [num_layers, num_kv_heads] float32 (None for other dtypes).
    #[getter]
    fn k_scale<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        scale_property(py, self.dtype, self.inner.read().cache().scales(), Kv::Key)
    }

    /// The fp8 value scales, [num_layers, num_kv_heads] float32 (None for other dtypes).
    #[getter]
    fn v_scale<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        scale_property(
            py,
            self.dtype,
            self.inner.read().cache().scales(),
            Kv::Value,
        )
    }

    /// The scales (K, V) that multiply `get(layer)`'s codes: int8, zero-copy read-only
    /// views [num_kv_heads, length]; fp8, [num_kv_heads, 1]; float dtypes, ones.
    fn scales<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, PyTuple>> {
        let c = slf.get().inner.read();
        let layer = c.cache().check_layer(layer)?;
        layer_scales(slf.as_any(), c.cache(), layer)
    }

    /// Zero-copy read-only views (K, V) [num_kv_heads, length, head_dim] of a set layer
    /// (the raw codes for 8-bit dtypes); float32 copies of the values with
    /// `dequantize=True`.
    #[pyo3(signature = (layer, *, dequantize = false))]
    fn get<'py>(
        slf: &Bound<'py, Self>,
        layer: i64,
        dequantize: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let me = slf.get();
        let (layer, len) = {
            let c = me.inner.read();
            let l = c.cache().check_layer(layer)?;
            if !c.is_set(l) {
                return Err(crate::error::KvError::InvalidArgument {
                    name: "layer",
                    value: l.to_string(),
                    reason: "is not set yet".into(),
                }
                .into());
            }
            (l, c.cache().layer_len(l))
        };
        let py = slf.py();
        if dequantize {
            let shape = [me.shape.num_kv_heads, len, me.shape.head_dim];
            return dequantized_pair(py, me.device, shape, |k, v| {
                let c = me.inner.read();
                c.cache().extract_block(layer as i64, 0, len as i64, k, v)
            });
        }
        // SAFETY: the storage lives as long as `slf`, the base of the views.
        let k = unsafe {
            layer_view(
                slf.as_any(),
                me.device,
                me.data,
                me.shape,
                me.dtype,
                layer,
                Kv::Key,
                None,
                len,
            )?
        };
        let v = unsafe {
            layer_view(
                slf.as_any(),
                me.device,
                me.data,
                me.shape,
                me.dtype,
                layer,
                Kv::Value,
                None,
                len,
            )?
        };
        PyTuple::new(slf.py(), [k, v])
    }

    /// Forgets the input; the memory stays allocated for the next one.
    fn clear(&self) {
        self.inner.write().clear()
    }

    /// Bytes of storage held.
    fn memory_bytes(&self) -> usize {
        self.inner.read().cache().memory_bytes()
    }

    fn __repr__(&self) -> String {
        let s = self.shape;
        format!(
            "EncoderCache(num_layers={}, num_kv_heads={}, head_dim={}, max_len={}, dtype='{}', device='{}', length={:?})",
            s.num_layers, s.num_kv_heads, s.head_dim, s.max_seq_len, self.dtype, self.device, self.length()
        )
    }
}
