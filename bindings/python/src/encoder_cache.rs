//! `kvrs.EncoderCache`: cross-attention K/V of one encoder input.

use super::attention::{self, AttnArgs};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::args::{parse_device, parse_dtype};
use super::errors::ToPython;
use super::guarded::Guarded;
use super::input::{read_tensor, Target};
use super::kv_cache::{layer_view, Copied};
use super::quant::{dequantized_pair, layer_scales, parse_scales, scale_property, LayerScales};
use kvrs::unstable::{check_size, CacheShape, EncoderCache};
use kvrs::{DType, Device, Kv};

/// Position-independent K/V of one encoder input (cross-attention): each layer is
/// written once with `set`, read by every decode step with `get`, and has no causal mask.
#[pyclass(frozen, name = "EncoderCache", module = "kvrs")]
pub struct PyEncoderCache {
    /// The core, entered only through closures (see [`super::guarded`]).
    core: Guarded<EncoderCache>,
    /// Its storage's allocations: what no input may overlap.
    target: Target,
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
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, max_len, *, v_head_dim = None, dtype = None, device = None, k_scale = None, v_scale = None))]
    #[pyo3(
        text_signature = "(num_layers, num_kv_heads, head_dim, max_len, *, v_head_dim=None, dtype='float16', device='cpu', k_scale=None, v_scale=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_layers: i64,
        num_kv_heads: i64,
        head_dim: i64,
        max_len: i64,
        v_head_dim: Option<i64>,
        dtype: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        k_scale: Option<&Bound<'_, PyAny>>,
        v_scale: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let shape = CacheShape {
            num_layers: check_size("num_layers", num_layers).py()?,
            num_kv_heads: check_size("num_kv_heads", num_kv_heads).py()?,
            head_dim: check_size("head_dim", head_dim).py()?,
            v_head_dim: check_size("v_head_dim", v_head_dim.unwrap_or(head_dim)).py()?,
            max_seq_len: check_size("max_len", max_len).py()?,
        };
        let dtype = dtype.map(parse_dtype).transpose()?.unwrap_or(DType::F16);
        let device = device.map(parse_device).transpose()?.unwrap_or(Device::Cpu);
        // The sizes are checked (and the storage allocated) before the scales are read.
        let cache = EncoderCache::new(shape, dtype, device).py()?;
        let scales = parse_scales(k_scale, v_scale, shape.num_layers, shape.num_kv_heads)?;
        let cache = cache.with_scales(scales).py()?;
        let data = cache.cache().data_ptr() as usize;
        let target = Target {
            device,
            spans: cache.cache().storage_spans(),
        };
        Ok(PyEncoderCache {
            core: Guarded::new(cache),
            target,
            shape,
            dtype,
            device,
            data,
        })
    }

    /// Cross-attention of q [n, num_q_heads, head_dim] (any number of decoder tokens)
    /// over every encoder position of `layer` (no causal mask), read in place. Returns
    /// a new array of q's shape and dtype, or fills `out`.
    #[pyo3(signature = (layer, q, *, out = None, scale = None, softcap = None, sinks = None, alibi_slopes = None, latent = false))]
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
        latent: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let args = AttnArgs::parse(scale, softcap, sinks, alibi_slopes, latent)?;
        let out_dim = args.out_dim(self.shape.head_dim, self.shape.v_head_dim);
        attention::run(py, q, out, &self.target, out_dim, |q, o| {
            self.core.read_moving(py, usize::MAX, |c| {
                c.attention(layer, q, o, &args.options())
            })
        })
    }

    /// Encoder positions every layer holds (None before the first set).
    #[getter]
    fn length(&self, py: Python<'_>) -> Option<usize> {
        self.core.read(py, |c| c.length())
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
    fn is_complete(&self, py: Python<'_>) -> bool {
        let layers = self.shape.num_layers;
        self.core.read(py, |c| (0..layers).all(|l| c.is_set(l)))
    }

    /// Whether `layer` holds its K/V.
    fn is_set(&self, py: Python<'_>, layer: i64) -> PyResult<bool> {
        self.core
            .read(py, |c| c.cache().check_layer(layer).map(|l| c.is_set(l)))
            .py()
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
            read_tensor(k, "k", &self.target)?,
            read_tensor(v, "v", &self.target)?,
        );
        let (kt, vt) = (k.tensor(), v.tensor());
        self.core
            .write_moving(py, kt.nbytes() + vt.nbytes(), |c| c.set(layer, &kt, &vt))
            .py()
    }

    /// The fp8 key scales, [num_layers, num_kv_heads] float32 (None for other dtypes).
    #[getter]
    fn k_scale<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let scales = self.core.read(py, |c| c.cache().scales().clone());
        scale_property(py, self.dtype, &scales, Kv::Key)
    }

    /// The fp8 value scales, [num_layers, num_kv_heads] float32 (None for other dtypes).
    #[getter]
    fn v_scale<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let scales = self.core.read(py, |c| c.cache().scales().clone());
        scale_property(py, self.dtype, &scales, Kv::Value)
    }

    /// The scales (K, V) that multiply `get(layer)`'s codes: int8, zero-copy read-only
    /// views [num_kv_heads, length]; fp8, [num_kv_heads, 1]; float dtypes, ones.
    fn scales<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, PyTuple>> {
        let scales = slf
            .get()
            .core
            .read(slf.py(), |c| {
                let cache = c.cache();
                cache.check_layer(layer).map(|l| LayerScales::of(cache, l))
            })
            .py()?;
        layer_scales(slf.as_any(), scales)
    }

    /// Zero-copy read-only views (K, V) [num_kv_heads, length, head_dim] of a set layer
    /// (the raw codes for 8-bit dtypes); copies the caller owns with `copy=True`; float32
    /// copies of the values with `dequantize=True`.
    #[pyo3(signature = (layer, *, dequantize = false, copy = false))]
    fn get<'py>(
        slf: &Bound<'py, Self>,
        layer: i64,
        dequantize: bool,
        copy: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let me = slf.get();
        let py = slf.py();
        let (layer, len) = me
            .core
            .read(py, |c| {
                let l = c.cache().check_layer(layer)?;
                if !c.is_set(l) {
                    return Err(kvrs::KvError::InvalidArgument {
                        name: "layer",
                        value: l.to_string(),
                        reason: "is not set yet".into(),
                    });
                }
                Ok((l, c.cache().layer_len(l)))
            })
            .py()?;
        if copy && !dequantize {
            let what = Copied {
                device: me.device,
                dtype: me.dtype,
                shape: me.shape,
                layer,
                head: None,
            };
            let pair = what.read(
                py,
                &me.core,
                |c| c.cache(),
                &[Kv::Key, Kv::Value],
                |c| c.layer_len(layer),
            )?;
            return PyTuple::new(py, pair);
        }
        if dequantize {
            let dims = [me.shape.head_dim, me.shape.v_head_dim];
            return dequantized_pair(
                py,
                me.device,
                me.shape.num_kv_heads,
                len,
                dims,
                |k, v, len| {
                    me.core.read_moving(py, 2 * k.nbytes(), |c| {
                        let cache = c.cache();
                        if cache.layer_len(layer) != len {
                            return Ok(Err(cache.layer_len(layer)));
                        }
                        if len > 0 {
                            cache.extract_block(layer as i64, 0, len as i64, k, v)?;
                        }
                        Ok(Ok(()))
                    })
                },
            );
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
    fn clear(&self, py: Python<'_>) {
        self.core.write(py, |c| c.clear())
    }

    /// Bytes of storage held.
    fn memory_bytes(&self, py: Python<'_>) -> usize {
        self.core.read(py, |c| c.cache().memory_bytes())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = self.shape;
        format!(
            "EncoderCache(num_layers={}, num_kv_heads={}, head_dim={}{}, max_len={}, dtype='{}', device='{}', length={})",
            s.num_layers, s.num_kv_heads, s.head_dim, super::pool::v_head_dim_repr(s.head_dim, s.v_head_dim), s.max_seq_len, self.dtype, self.device,
            self.length(py).map_or("None".into(), |n| n.to_string())
        )
    }
}
