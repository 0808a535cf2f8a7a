//! `kvrs.KVCache`: the Python face of the contiguous cache.

use super::attention::{self, AttnArgs};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::args::{parse_device, parse_dtype};
use super::errors::ToPython;
use super::guarded::Guarded;
use super::input::{read_tensor, Target};
use super::output::{new_output, Output};
use super::quant::{
    dequantized_pair, layer_scales, parse_scales, read_dtype, scale_property, LayerScales,
};
use super::views::borrowed_view;
use kvrs::unstable::{check_index, check_size, CacheCore, CacheShape};
use kvrs::{DType, Device, Kv, KvError};

/// A read-only view (NumPy, or a `DeviceTensor` on CUDA), owned by `owner`, of `len`
/// positions of one layer's K or V in a contiguous cache's storage at `data` on
/// `device`: `[heads, len, head_dim]`, or `[len, head_dim]` for one `head`.
///
/// # Safety
/// `data` must be the storage of a cache of `shape` and `dtype` that lives as long as `owner`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn layer_view<'py>(
    owner: &Bound<'py, PyAny>,
    device: Device,
    data: usize,
    shape: CacheShape,
    dtype: DType,
    layer: usize,
    kv: Kv,
    head: Option<usize>,
    len: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let (s, es) = (shape, dtype.size());
    let d = s.dim(kv);
    let run = s.num_kv_heads * s.max_seq_len;
    let offset = layer * run * (s.head_dim + s.v_head_dim)
        + kv as usize * run * s.head_dim
        + head.unwrap_or(0) * s.max_seq_len * d;
    let ptr = (data + offset * es) as *mut u8;
    let row = (d * es) as isize;
    match head {
        None => borrowed_view(
            owner,
            device,
            ptr,
            dtype,
            &[s.num_kv_heads, len, d],
            &[row * s.max_seq_len as isize, row, es as isize],
            false,
        ),
        Some(_) => borrowed_view(
            owner,
            device,
            ptr,
            dtype,
            &[len, d],
            &[row, es as isize],
            false,
        ),
    }
}

/// Copies of one layer's K and/or V as stored (8-bit dtypes: the codes), every head
/// (`[heads, len, dim]`) or one (`[len, dim]`): what `copy=True` reads return.
pub(crate) struct Copied {
    pub device: Device,
    pub dtype: DType,
    pub shape: CacheShape,
    pub layer: usize,
    pub head: Option<usize>,
}

impl Copied {
    /// Reads `kvs` of the cache that `cache_of` finds in `core`, at the length `len_now`
    /// gives, all under one lock; the outputs are arrays (or device tensors) the caller
    /// owns, apart from the cache.
    pub fn read<'py, T: Send + Sync>(
        &self,
        py: Python<'py>,
        core: &Guarded<T>,
        cache_of: impl Fn(&T) -> &CacheCore + Sync,
        kvs: &[Kv],
        len_now: impl Fn(&CacheCore) -> usize + Sync,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut len = core.read(py, |c| len_now(cache_of(c)));
        loop {
            let mut outs = Vec::with_capacity(kvs.len());
            for &kv in kvs {
                let d = self.shape.dim(kv);
                let shape = match self.head {
                    None => vec![self.shape.num_kv_heads, len, d],
                    Some(_) => vec![len, d],
                };
                outs.push(new_output(py, self.device, self.dtype, &shape)?);
            }
            let mut tensors: Vec<_> = outs.iter_mut().map(|o| o.tensor()).collect();
            let bytes = tensors.iter().map(|t| t.nbytes()).sum();
            let read = core
                .read_moving(py, bytes, |c| {
                    let c = cache_of(c);
                    let now = len_now(c);
                    if now != len {
                        return Ok(Err(now));
                    }
                    for (t, &kv) in tensors.iter_mut().zip(kvs) {
                        c.read_stored(self.layer, kv, self.head, len, t)?;
                    }
                    Ok::<_, KvError>(Ok(()))
                })
                .py()?;
            drop(tensors);
            match read {
                Ok(()) => return Ok(outs.into_iter().map(Output::into_object).collect()),
                Err(now) => len = now,
            }
        }
    }
}

/// A contiguous KV cache for one sequence, preallocated for `max_seq_len` positions.
#[pyclass(frozen, name = "KVCache", module = "kvrs")]
pub struct PyKVCache {
    /// The core, entered only through closures (see [`super::guarded`]).
    core: Guarded<CacheCore>,
    /// Its storage's allocations: what no input may overlap.
    target: Target,
    shape: CacheShape,
    dtype: DType,
    device: Device,
    /// Address of the storage; stable for the cache's life.
    data: usize,
}

impl PyKVCache {
    /// The guarded core (for copies between a pool and this cache).
    pub(crate) fn core(&self) -> &Guarded<CacheCore> {
        &self.core
    }

    /// A read-only view `[heads, len, head_dim]` (or one head's `[len, head_dim]`) of a
    /// layer's K or V, owned by `slf`.
    fn view<'py>(
        slf: &Bound<'py, Self>,
        layer: usize,
        kv: Kv,
        head: Option<usize>,
        len: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = slf.get();
        // SAFETY: the storage is never reallocated and lives as long as `slf`, the base.
        unsafe {
            layer_view(
                slf.as_any(),
                me.device,
                me.data,
                me.shape,
                me.dtype,
                layer,
                kv,
                head,
                len,
            )
        }
    }

    /// One head's `[seq_len, dim]` of a layer's K or V: a view, or with `copy`, a copy.
    fn head_read<'py>(
        slf: &Bound<'py, Self>,
        kv: Kv,
        layer: i64,
        head: i64,
        seq_len: Option<i64>,
        copy: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = slf.get();
        let (layer, committed) = me
            .core
            .read(slf.py(), |c| c.check_layer(layer).map(|l| (l, c.seq_len())))
            .py()?;
        let head = check_index("head", head, me.shape.num_kv_heads).py()?;
        let len = match seq_len {
            None => committed,
            Some(n) if n < 0 || n as usize > me.shape.max_seq_len => {
                return Err(KvError::InvalidArgument {
                    name: "seq_len",
                    value: n.to_string(),
                    reason: format!("must be in [0, max_seq_len={}]", me.shape.max_seq_len),
                }
                .py())
            }
            Some(n) => n as usize,
        };
        if copy {
            let fixed = seq_len.is_some();
            let what = Copied {
                device: me.device,
                dtype: me.dtype,
                shape: me.shape,
                layer,
                head: Some(head),
            };
            let mut read = what.read(
                slf.py(),
                &me.core,
                |c| c,
                &[kv],
                |c| {
                    if fixed {
                        len
                    } else {
                        c.seq_len()
                    }
                },
            )?;
            return Ok(read.remove(0));
        }
        Self::view(slf, layer, kv, Some(head), len)
    }

    fn store(
        &self,
        py: Python<'_>,
        kv: Kv,
        layer: i64,
        head: i64,
        pos: i64,
        vector: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let input = read_tensor(
            vector,
            if kv == Kv::Key { "key" } else { "value" },
            &self.target,
        )?;
        let t = input.tensor();
        self.core
            .write_moving(py, t.nbytes(), |c| c.store(kv, layer, head, pos, &t))
            .py()?;
        Ok(())
    }
}

#[pymethods]
impl PyKVCache {
    /// `KVCache[np.ndarray]` or `KVCache[kvrs.DeviceTensor]`: the type of its reads, for
    /// annotations (the stub's generic parameter).
    #[classmethod]
    #[pyo3(signature = (item, /))]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        super::generic_alias(cls, item)
    }

    /// Attention of the newest tokens over `layer`, read in place: q [n, num_q_heads,
    /// head_dim] are the queries of the last n positions the layer holds (the tokens
    /// just appended); the token at position p sees positions 0..=p, or the `window`
    /// most recent of them (itself included). Returns a new array of q's shape and
    /// dtype, or fills `out`.
    #[pyo3(signature = (layer, q, *, out = None, window = None, scale = None, softcap = None, sinks = None, alibi_slopes = None, latent = false))]
    #[allow(clippy::too_many_arguments)]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        q: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        window: Option<i64>,
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
                c.attention(layer, q, o, window, &args.options())
            })
        })
    }

    /// The device address of the int64 position counter (CUDA caches), set to seq_len
    /// now: call it before capturing a decode loop in a CUDA graph.
    fn gpu_counter_ptr(&self, py: Python<'_>) -> PyResult<u64> {
        self.core.read(py, |c| c.gpu_counter_ptr()).py()
    }

    /// Appends k, v [n_tokens, num_kv_heads, head_dim] (tensors on the cache's device) to
    /// `layer` at the position the device counter holds, with no host bookkeeping: the
    /// step of a decode loop captured in a CUDA graph.
    fn append_at_counter(
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
            .read(py, |c| c.append_at_counter(layer, &kt, &vt))
            .py()
    }

    /// Sends later launches to `stream` (an integer handle such as
    /// torch.cuda.current_stream().cuda_stream, a torch or CuPy stream object; None:
    /// kvrs's own stream). CUDA caches.
    #[pyo3(signature = (stream))]
    fn set_stream(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let stream = super::args::parse_stream(stream)?;
        self.core.read(py, |c| c.set_stream(stream)).py()
    }

    /// Adds n to the device counter on the device (the end of a captured decode step).
    fn advance_counter(&self, py: Python<'_>, n: i64) -> PyResult<()> {
        self.core.read(py, |c| c.advance_counter(n)).py()
    }

    /// Waits for the device, reads the counter back and makes it seq_len (and every
    /// layer's length); returns it. CacheFullError if appends ran past max_seq_len.
    fn sync_counter_from_gpu(&self, py: Python<'_>) -> PyResult<usize> {
        self.core
            .write_moving(py, usize::MAX, |c| c.sync_counter_from_gpu())
            .py()
    }

    #[new]
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, max_seq_len, *, v_head_dim = None, dtype = None, device = None, k_scale = None, v_scale = None))]
    #[pyo3(
        text_signature = "(num_layers, num_kv_heads, head_dim, max_seq_len, *, v_head_dim=None, dtype='float16', device='cpu', k_scale=None, v_scale=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_layers: i64,
        num_kv_heads: i64,
        head_dim: i64,
        max_seq_len: i64,
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
            max_seq_len: check_size("max_seq_len", max_seq_len).py()?,
        };
        let dtype = dtype.map(parse_dtype).transpose()?.unwrap_or(DType::F16);
        let device = device.map(parse_device).transpose()?.unwrap_or(Device::Cpu);
        // The sizes are checked (and the storage allocated) before the scales are read.
        let cache = CacheCore::new(shape, dtype, device).py()?;
        let scales = parse_scales(k_scale, v_scale, shape.num_layers, shape.num_kv_heads)?;
        let cache = cache.with_scales(scales).py()?;
        let data = cache.data_ptr() as usize;
        let target = Target {
            device,
            spans: cache.storage_spans(),
        };
        Ok(PyKVCache {
            core: Guarded::new(cache),
            target,
            shape,
            dtype,
            device,
            data,
        })
    }

    /// Committed length.
    #[getter]
    fn seq_len(&self, py: Python<'_>) -> usize {
        self.core.read(py, |c| c.seq_len())
    }

    /// Positions each layer can hold.
    #[getter]
    fn max_seq_len(&self) -> usize {
        self.shape.max_seq_len
    }

    /// Number of layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.shape.num_layers
    }

    /// Key/value heads per layer.
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.shape.num_kv_heads
    }

    /// Elements per key head vector.
    #[getter]
    fn head_dim(&self) -> usize {
        self.shape.head_dim
    }

    /// Elements per value head vector (head_dim unless the cache was made with another).
    #[getter]
    fn v_head_dim(&self) -> usize {
        self.shape.v_head_dim
    }

    /// Storage dtype name: 'float32', 'float16', 'bfloat16', 'fp8_e4m3', 'fp8_e5m2' or
    /// 'int8'.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The storage dtype as a torch dtype (`torch.bfloat16`, `torch.float8_e4m3fn`, ...;
    /// `torch.int8` for int8 codes). Needs torch.
    #[getter]
    fn torch_dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        super::args::torch_dtype(py, self.dtype)
    }

    /// The fp8 key scales, [num_layers, num_kv_heads] float32 (None for other dtypes).
    #[getter]
    fn k_scale<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let scales = self.core.read(py, |c| c.scales().clone());
        scale_property(py, self.dtype, &scales, Kv::Key)
    }

    /// The fp8 value scales, [num_layers, num_kv_heads] float32 (None for other dtypes).
    #[getter]
    fn v_scale<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let scales = self.core.read(py, |c| c.scales().clone());
        scale_property(py, self.dtype, &scales, Kv::Value)
    }

    /// The scales (K, V) that multiply `get(layer)`'s codes: int8, zero-copy read-only
    /// views [num_kv_heads, length] (one per token and head); fp8, [num_kv_heads, 1]
    /// (one per head); float dtypes, ones [num_kv_heads, 1]. For every dtype,
    /// `codes.astype(np.float32) * scales[..., None]` is what the cache holds.
    fn scales<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, PyTuple>> {
        let scales = slf
            .get()
            .core
            .read(slf.py(), |c| {
                c.check_layer(layer).map(|l| LayerScales::of(c, l))
            })
            .py()?;
        layer_scales(slf.as_any(), scales)
    }

    /// Device name: 'cpu' (or 'cuda:N').
    #[getter]
    fn device(&self) -> String {
        self.device.to_string()
    }

    /// Positions written into `layer` (committed and appended).
    fn layer_len(&self, py: Python<'_>, layer: i64) -> PyResult<usize> {
        self.core
            .read(py, |c| c.check_layer(layer).map(|l| c.layer_len(l)))
            .py()
    }

    /// Writes one key vector of `head_dim` at (layer, head, pos); the layer holds pos after.
    fn store_key(
        &self,
        py: Python<'_>,
        layer: i64,
        head: i64,
        pos: i64,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.store(py, Kv::Key, layer, head, pos, key)
    }

    /// Writes one value vector of `head_dim` at (layer, head, pos); the layer holds pos after.
    fn store_value(
        &self,
        py: Python<'_>,
        layer: i64,
        head: i64,
        pos: i64,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.store(py, Kv::Value, layer, head, pos, value)
    }

    /// Appends `k`, `v` of shape [n_tokens, num_kv_heads, head_dim] at the layer's next
    /// free position; returns that position.
    fn append(
        &self,
        py: Python<'_>,
        layer: i64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let (k, v) = (
            read_tensor(k, "k", &self.target)?,
            read_tensor(v, "v", &self.target)?,
        );
        let (kt, vt) = (k.tensor(), v.tensor());
        self.core
            .write_moving(py, kt.nbytes() + vt.nbytes(), |c| c.append(layer, &kt, &vt))
            .py()
    }

    /// Commits `n` tokens: `seq_len += n`. Every layer must hold them already.
    #[pyo3(signature = (n = 1))]
    fn advance(&self, py: Python<'_>, n: i64) -> PyResult<()> {
        self.core.write(py, |c| c.advance(n)).py()
    }

    /// Zero-copy read-only views (K, V) of shape [num_kv_heads, length, head_dim], where
    /// length is what the layer holds (committed and appended): the raw codes for 8-bit
    /// dtypes. With `copy=True`, copies the caller owns (writing them never changes the
    /// cache); with `dequantize=True`, float32 copies of the values.
    #[pyo3(signature = (layer, *, dequantize = false, copy = false))]
    fn get<'py>(
        slf: &Bound<'py, Self>,
        layer: i64,
        dequantize: bool,
        copy: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let me = slf.get();
        let py = slf.py();
        let (l, len) = me
            .core
            .read(py, |c| c.check_layer(layer).map(|l| (l, c.layer_len(l))))
            .py()?;
        if copy && !dequantize {
            let what = Copied {
                device: me.device,
                dtype: me.dtype,
                shape: me.shape,
                layer: l,
                head: None,
            };
            let pair = what.read(
                py,
                &me.core,
                |c| c,
                &[Kv::Key, Kv::Value],
                |c| c.layer_len(l),
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
                        if c.layer_len(l) != len {
                            return Ok(Err(c.layer_len(l)));
                        }
                        if len > 0 {
                            c.extract_block(layer, 0, len as i64, k, v)?;
                        }
                        Ok(Ok(()))
                    })
                },
            );
        }
        let k = Self::view(slf, l, Kv::Key, None, len)?;
        let v = Self::view(slf, l, Kv::Value, None, len)?;
        PyTuple::new(py, [k, v])
    }

    /// Zero-copy read-only view [seq_len, head_dim] of one head's keys (default: the
    /// committed length); with `copy=True`, a copy the caller owns.
    #[pyo3(signature = (layer, head, seq_len = None, *, copy = false))]
    fn keys_for<'py>(
        slf: &Bound<'py, Self>,
        layer: i64,
        head: i64,
        seq_len: Option<i64>,
        copy: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::head_read(slf, Kv::Key, layer, head, seq_len, copy)
    }

    /// Zero-copy read-only view [seq_len, head_dim] of one head's values (default: the
    /// committed length); with `copy=True`, a copy the caller owns.
    #[pyo3(signature = (layer, head, seq_len = None, *, copy = false))]
    fn values_for<'py>(
        slf: &Bound<'py, Self>,
        layer: i64,
        head: i64,
        seq_len: Option<i64>,
        copy: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::head_read(slf, Kv::Value, layer, head, seq_len, copy)
    }

    /// Drops positions >= n from every layer; a no-op when n >= seq_len.
    fn truncate(&self, py: Python<'_>, n: i64) -> PyResult<()> {
        self.core.write(py, |c| c.truncate(n)).py()
    }

    /// Empties the cache; memory stays allocated.
    fn clear(&self, py: Python<'_>) {
        self.core.write(py, |c| c.clear())
    }

    /// Sets seq_len and every layer's length to min(n, max_seq_len); positions no write
    /// reached read as zeros.
    fn set_seq_len(&self, py: Python<'_>, n: i64) -> PyResult<()> {
        self.core.write(py, |c| c.set_seq_len(n)).py()
    }

    /// Copies [num_kv_heads, block_size, head_dim] keys and values from start_pos (of the
    /// storage dtype; float32, dequantized, for 8-bit dtypes); positions past
    /// max_seq_len come back as zeros.
    fn extract_block<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        start_pos: i64,
        block_size: i64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        self.core
            .read(py, |c| c.check_block_args(layer, start_pos, block_size))
            .py()?;
        let (h, n) = (self.shape.num_kv_heads, block_size as usize);
        let dtype = read_dtype(self.dtype);
        let mut k = new_output(py, self.device, dtype, &[h, n, self.shape.head_dim])?;
        let mut v = new_output(py, self.device, dtype, &[h, n, self.shape.v_head_dim])?;
        let (mut kt, mut vt) = (k.tensor(), v.tensor());
        self.core
            .read_moving(py, 2 * kt.nbytes(), |c| {
                c.extract_block(layer, start_pos, block_size, &mut kt, &mut vt)
            })
            .py()?;
        PyTuple::new(py, [k.into_object(), v.into_object()])
    }

    /// Writes [num_kv_heads, block_size, head_dim] keys and values at start_pos,
    /// skipping positions past max_seq_len; lengths do not move.
    fn inject_block(
        &self,
        py: Python<'_>,
        layer: i64,
        start_pos: i64,
        block_size: i64,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (k, v) = (
            read_tensor(keys, "keys", &self.target)?,
            read_tensor(values, "values", &self.target)?,
        );
        let (kt, vt) = (k.tensor(), v.tensor());
        self.core
            .write_moving(py, kt.nbytes() + vt.nbytes(), |c| {
                c.inject_block(layer, start_pos, block_size, &kt, &vt)
            })
            .py()?;
        Ok(())
    }

    /// Bytes of storage held (K and V of every layer, allocated once).
    fn memory_bytes(&self, py: Python<'_>) -> usize {
        self.core.read(py, |c| c.memory_bytes())
    }

    /// seq_len / max_seq_len, in [0, 1].
    fn utilization_ratio(&self, py: Python<'_>) -> f64 {
        self.core.read(py, |c| c.utilization_ratio())
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.seq_len(py)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = self.shape;
        format!(
            "KVCache(num_layers={}, num_kv_heads={}, head_dim={}{}, max_seq_len={}, dtype='{}', device='{}', seq_len={})",
            s.num_layers, s.num_kv_heads, s.head_dim, super::pool::v_head_dim_repr(s.head_dim, s.v_head_dim), s.max_seq_len, self.dtype, self.device, self.seq_len(py)
        )
    }
}
