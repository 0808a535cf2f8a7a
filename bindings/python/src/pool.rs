//! `kvrs.BlockPool`: the Python face of the paged pool (its sequences are
//! [`super::sequence`], its batches [`super::batch`]; all three share a
//! [`SharedPool`]).

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use std::ops::Deref;
use std::sync::Arc;

use pyo3::exceptions::{PyAssertionError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::args::{parse_device, parse_dtype};
use super::batch::PyForwardBatch;
use super::errors::ToPython;
use super::input::{read_ints, read_slot_rows, read_stacked, read_tensor, read_token_ids};
use super::pool_args::{self, key_bytes, prefix_args};
use super::quant::{parse_scales, scale_property};
use super::rope::PyRope;
use super::sequence::PySequence;
use super::shared_pool::{i32_array, slot_array, SharedPool};
use super::views::borrowed_view;
use kvrs::unstable::{check_size, LayerGroups, PoolCore, StateConfig};
use kvrs::{DType, Device, Kv, KvError, KvLayout, PagedShape, SeqId};

/// A pool of fixed-size KV blocks for every layer, allocated once and shared by many
/// sequences.
#[pyclass(frozen, name = "BlockPool", module = "kvrs")]
pub struct PyBlockPool {
    core: Arc<SharedPool>,
    /// Its suffix index (speculative drafts from the tokens it served).
    suffix: parking_lot::Mutex<super::suffix::SharedSuffix>,
}

impl Deref for PyBlockPool {
    type Target = SharedPool;

    fn deref(&self) -> &SharedPool {
        &self.core
    }
}

impl PyBlockPool {
    /// Ids of `seqs`, each checked to be a Sequence of this pool.
    pub(crate) fn ids(
        slf: &Bound<'_, Self>,
        seqs: &Bound<'_, PyAny>,
        name: &'static str,
    ) -> PyResult<Vec<SeqId>> {
        if let Ok(list) = seqs.cast::<PyList>() {
            // The common case, without the generic iterator protocol.
            let mut ids = kvrs::unstable::sizes::with_capacity(name, list.len()).py()?;
            for s in list.iter() {
                ids.push(Self::id_of(slf, &s, name)?);
            }
            return Ok(ids);
        }
        let mut ids = Vec::new();
        for item in seqs.try_iter()? {
            ids.push(Self::id_of(slf, &item?, name)?);
        }
        Ok(ids)
    }

    /// Ids of `seqs` (each checked to be a Sequence of this pool), and the distinct
    /// Sequence objects in order of first appearance.
    fn sequences(
        slf: &Bound<'_, Self>,
        seqs: &Bound<'_, PyAny>,
        name: &'static str,
    ) -> PyResult<(Vec<SeqId>, Vec<Py<PySequence>>)> {
        let mut ids = Vec::new();
        let mut objects: Vec<Py<PySequence>> = Vec::new();
        let mut seen = rustc_hash::FxHashSet::default();
        for item in seqs.try_iter()? {
            let item = item?;
            let id = Self::id_of(slf, &item, name)?;
            ids.push(id);
            if seen.insert(id) {
                objects.push(item.cast_into::<PySequence>()?.unbind());
            }
        }
        Ok((ids, objects))
    }

    pub(crate) fn id_of(
        slf: &Bound<'_, Self>,
        seq: &Bound<'_, PyAny>,
        name: &'static str,
    ) -> PyResult<SeqId> {
        let seq = seq
            .cast::<PySequence>()
            .map_err(|_| PyTypeError::new_err(format!("{name} must hold kvrs.Sequence objects")))?
            .get();
        if !Arc::ptr_eq(&seq.core, &slf.get().core) {
            return Err(KvError::InvalidArgument {
                name,
                value: format!("sequence {}", seq.id),
                reason: "belongs to another pool".into(),
            }
            .py());
        }
        Ok(seq.id)
    }

    fn sequence(slf: &Bound<'_, Self>, id: SeqId) -> PySequence {
        PySequence {
            pool: slf.clone().into_any().unbind(),
            core: slf.get().core.clone(),
            id,
        }
    }
}

#[pymethods]
impl PyBlockPool {
    /// `BlockPool[np.ndarray]` or `BlockPool[kvrs.DeviceTensor]`: the type of its reads, for
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
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, *, v_head_dim = None, block_size = 16, num_blocks = None, memory_bytes = None, dtype = None, device = None, layout = "NHD", prefix_caching = None, hash = "blake3", seed = None, partial_hits = true, events = false, rope = None, layer_types = None, sliding_window = None, chunk_size = None, swa_memory = 0, k_scale = None, v_scale = None, tiers = None, model_id = "", tier_queue = 1024, tier_write = "first", tier_key = None, tier_queue_bytes = None, tier_write_policy = None, tier_write_hits = 2, state_layers = 0, state_shapes = None, state_slots = None, state_dtype = None, state_checkpoints = None, checkpoint_interval = None))]
    #[pyo3(
        text_signature = "(num_layers, num_kv_heads, head_dim, *, v_head_dim=None, block_size=16, num_blocks=None, memory_bytes=None, dtype='float16', device='cpu', layout='NHD', prefix_caching=None, hash='blake3', seed=None, partial_hits=True, events=False, rope=None, layer_types=None, sliding_window=None, chunk_size=None, swa_memory=0, k_scale=None, v_scale=None, tiers=None, model_id='', tier_queue=1024, tier_write='first', tier_key=None, tier_queue_bytes='256MiB', tier_write_policy=None, tier_write_hits=2, state_layers=0, state_shapes=None, state_slots=None, state_dtype=None, state_checkpoints=None, checkpoint_interval=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_layers: i64,
        num_kv_heads: i64,
        head_dim: i64,
        v_head_dim: Option<i64>,
        block_size: i64,
        num_blocks: Option<i64>,
        memory_bytes: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        layout: &str,
        prefix_caching: Option<bool>,
        hash: &str,
        seed: Option<&Bound<'_, PyAny>>,
        partial_hits: bool,
        events: bool,
        rope: Option<&Bound<'_, PyRope>>,
        layer_types: Option<Vec<String>>,
        sliding_window: Option<i64>,
        chunk_size: Option<i64>,
        swa_memory: i64,
        k_scale: Option<&Bound<'_, PyAny>>,
        v_scale: Option<&Bound<'_, PyAny>>,
        tiers: Option<&Bound<'_, pyo3::types::PyList>>,
        model_id: &str,
        tier_queue: usize,
        tier_write: &str,
        tier_key: Option<&Bound<'_, PyAny>>,
        tier_queue_bytes: Option<&Bound<'_, PyAny>>,
        tier_write_policy: Option<&str>,
        tier_write_hits: i64,
        state_layers: i64,
        state_shapes: Option<&Bound<'_, PyAny>>,
        state_slots: Option<i64>,
        state_dtype: Option<&Bound<'_, PyAny>>,
        state_checkpoints: Option<i64>,
        checkpoint_interval: Option<i64>,
    ) -> PyResult<Self> {
        let prefix_caching = prefix_caching.unwrap_or(true);
        let mut states =
            super::states::parse_config(state_layers, state_shapes, state_slots, state_dtype)?;
        let block = check_size("block_size", block_size).py()?;
        let interval = super::states::checkpoint_policy(
            states.as_mut(),
            prefix_caching,
            state_checkpoints,
            checkpoint_interval,
            block,
        )?;
        let write_hits = u32::try_from(tier_write_hits)
            .ok()
            .filter(|&h| h >= 1)
            .ok_or_else(|| KvError::InvalidArgument {
                name: "tier_write_hits",
                value: tier_write_hits.to_string(),
                reason: format!(
                    "must be in [1, {}]: the prefix hits after which write_through_selective \
                     writes a block",
                    u32::MAX
                ),
            })
            .py()?;
        let tier_options = kvrs::TierOptions {
            secret: tier_key.map(super::tiers::secret).transpose()?,
            queue: tier_queue,
            queue_bytes: match tier_queue_bytes {
                Some(b) => super::tiers::size_arg("tier_queue_bytes", b)? as usize,
                None => kvrs::unstable::DEFAULT_QUEUE_BYTES,
            },
            policy: tier_write.parse().py()?,
            mode: tier_write_policy
                .map(|m| kvrs::WriteMode::parse(m, write_hits))
                .transpose()
                .py()?,
        };
        let tiers = super::tiers::parse_tiers(tiers)?;
        let seed = seed.map(pool_args::parse_seed).transpose()?;
        if !tiers.is_empty() && seed.is_none() {
            return Err(KvError::InvalidArgument {
                name: "seed",
                value: "None".into(),
                reason: "pools that share offload tiers (or find a disk tier again after a \
                         restart) must share the hash seed: pass seed=<int or hex string>, the \
                         same in every pool"
                    .into(),
            }
            .py());
        }
        let dtype = dtype.map(parse_dtype).transpose()?.unwrap_or(DType::F16);
        let device = device.map(parse_device).transpose()?.unwrap_or(Device::Cpu);
        let mut shape = PagedShape {
            num_layers: check_size("num_layers", num_layers).py()?,
            num_kv_heads: check_size("num_kv_heads", num_kv_heads).py()?,
            head_dim: check_size("head_dim", head_dim).py()?,
            v_head_dim: check_size("v_head_dim", v_head_dim.unwrap_or(head_dim)).py()?,
            block_size: check_size("block_size", block_size).py()?,
            num_blocks: 0,
            layout: layout.parse::<KvLayout>().py()?,
        };
        kvrs::unstable::check_layer_count(shape.num_layers).py()?;
        let attention = pool_args::attention(
            shape.num_layers,
            layer_types,
            sliding_window,
            chunk_size,
            swa_memory,
        )?;
        let per_block =
            pool_args::block_bytes(LayerGroups::new(attention.clone()).per_block, &shape, dtype)?;
        let reserved = states.as_ref().map_or(0, StateConfig::total_bytes);
        shape.num_blocks = pool_args::num_blocks(num_blocks, memory_bytes, per_block, reserved)?;
        let prefix = pool_args::prefix(prefix_caching, hash, seed, partial_hits, events)?;
        let mut pool = PoolCore::with_attention(shape, attention, dtype, device, prefix)
            .py()?
            .with_model_id(model_id);
        if let Some(r) = rope {
            pool = pool.with_rope(r.get().rope).py()?;
        }
        pool = pool
            .with_scales(parse_scales(
                k_scale,
                v_scale,
                shape.num_layers,
                shape.num_kv_heads,
            )?)
            .py()?;
        if let Some(config) = states {
            pool = pool
                .with_states(config)
                .py()?
                .with_checkpoint_interval(interval)
                .py()?;
        }
        if !tiers.is_empty() {
            // After the states: the tiers' fingerprint covers their layout.
            pool = pool.with_tiers(tiers, model_id, &tier_options).py()?;
        }
        Ok(PyBlockPool {
            core: Arc::new(SharedPool::new(pool)),
            suffix: parking_lot::Mutex::new(super::suffix::default_index()),
        })
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

    /// Elements per value head vector (head_dim unless the pool was made with another).
    #[getter]
    fn v_head_dim(&self) -> usize {
        self.shape.v_head_dim
    }

    /// Positions per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.shape.block_size
    }

    /// Blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.shape.num_blocks
    }

    /// Storage dtype name.
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

    /// Device name.
    #[getter]
    fn device(&self) -> String {
        self.device.to_string()
    }

    /// 'NHD' or 'HND'.
    #[getter]
    fn layout(&self) -> String {
        self.shape.layout.to_string()
    }

    /// Bytes of one block across all layers (K and V).
    #[getter]
    fn bytes_per_block(&self, py: Python<'_>) -> usize {
        self.core.read(py, |c| c.bytes_per_block())
    }

    /// Blocks no sequence holds.
    #[getter]
    fn free_blocks(&self, py: Python<'_>) -> usize {
        self.core.read(py, |c| c.num_free_blocks())
    }

    /// The rotary embedding used to re-rotate moved keys, or None.
    #[getter]
    fn rope(&self, py: Python<'_>) -> Option<PyRope> {
        self.core.read(py, |c| c.rope()).map(|rope| PyRope { rope })
    }

    /// Whether full blocks with known token ids are cached for reuse.
    #[getter]
    fn prefix_caching(&self, py: Python<'_>) -> bool {
        self.core.read(py, |c| c.prefix().is_some())
    }

    /// The prefix hash function ('blake3' or 'xxh3'), or None without prefix caching.
    #[getter]
    fn hash(&self, py: Python<'_>) -> Option<String> {
        self.core
            .read(py, |c| c.prefix().map(|p| p.kind.to_string()))
    }

    /// The seed of every hash chain (give it to another pool to share saved caches), or
    /// None without prefix caching.
    #[getter]
    fn seed(&self, py: Python<'_>) -> Option<u128> {
        self.core.read(py, |c| c.prefix().map(|p| p.seed))
    }

    /// Kind of each layer: "full", "sliding" or "chunked".
    #[getter]
    fn layer_types(&self, py: Python<'_>) -> Vec<&'static str> {
        self.core.read(py, |c| {
            c.groups()
                .attention
                .kinds
                .iter()
                .map(|k| k.name())
                .collect()
        })
    }

    /// Window of the sliding layers (positions seen, the token included), or None.
    #[getter]
    fn sliding_window(&self, py: Python<'_>) -> Option<usize> {
        self.core.read(py, |c| c.groups().attention.sliding_window)
    }

    /// Chunk size of the chunked layers, or None.
    #[getter]
    fn chunk_size(&self, py: Python<'_>) -> Option<usize> {
        self.core.read(py, |c| c.groups().attention.chunk_size)
    }

    /// Extra positions sliding layers keep behind their window.
    #[getter]
    fn swa_memory(&self, py: Python<'_>) -> usize {
        self.core.read(py, |c| c.groups().attention.swa_memory)
    }

    /// Block tables each sequence has: one per group of equally many layers of one kind.
    #[getter]
    fn num_layer_groups(&self, py: Python<'_>) -> usize {
        self.core.read(py, |c| c.groups().groups.len())
    }

    /// The group (row of reserve()'s slot mapping, block table) of `layer`.
    fn layer_group(&self, py: Python<'_>, layer: i64) -> PyResult<usize> {
        self.core.read(py, |c| c.group_for(Some(layer))).py()
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

    /// Zero-copy writable view of the per-token scales of one layer's cache tensor (int8
    /// pools): kv_cache(layer)'s shape without head_dim, [num_blocks, 2, block_size,
    /// num_kv_heads] (NHD) or [num_blocks, 2, num_kv_heads, block_size] (HND), float32.
    /// Pools of two head sizes (a scale per gcd(head_dim, v_head_dim) elements) have no
    /// such tensor: ValueError, naming Sequence.scales.
    fn scale_cache<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, PyAny>> {
        let me = slf.get();
        let sh = me.shape;
        let layer = kvrs::unstable::check_index("layer", layer, sh.num_layers).py()?;
        if sh.v_head_dim != sh.head_dim {
            return Err(KvError::InvalidArgument {
                name: "layer",
                value: layer.to_string(),
                reason: format!(
                    "scale_cache is one [num_blocks, 2, ...] tensor of a scale per head \
                     vector, which needs head_dim == v_head_dim; this pool has {} and {} and \
                     keeps a scale per {} elements: read them per sequence with \
                     Sequence.scales(layer)",
                    sh.head_dim,
                    sh.v_head_dim,
                    sh.scale_unit()
                ),
            }
            .py());
        }
        let (tensor, rows) = me.core.read(slf.py(), |c| {
            (c.tensor_of(layer), c.row_scales().map(|r| r.ptr as usize))
        });
        let Some(rows) = rows else {
            return Err(KvError::NotSupported(format!(
                "scale_cache: a {} pool keeps no per-token scales (int8 does; fp8 scales are \
                 k_scale and v_scale)",
                me.dtype
            ))
            .py());
        };
        let d5 = sh.layer_tensor_shape();
        let dims = [d5[0], d5[1], d5[2], d5[3]];
        let mut strides = [1isize; 4];
        for i in (0..3).rev() {
            strides[i] = strides[i + 1] * dims[i + 1] as isize;
        }
        let bytes: Vec<isize> = strides.iter().map(|s| s * 4).collect();
        let at = sh.block_offset(tensor, 0) / sh.scale_unit();
        // SAFETY: the scales are allocated with the pool's storage, never moved, and live
        // as long as the pool, the array's base.
        unsafe {
            borrowed_view(
                slf.as_any(),
                me.device,
                (rows as *mut f32).add(at) as *mut u8,
                DType::F32,
                &dims,
                &bytes,
                true,
            )
        }
    }

    /// State layers beside the K/V layers (hybrid models' linear-attention or Mamba
    /// layers; 0 for a pool of attention layers only).
    #[getter]
    fn state_layers(&self) -> usize {
        self.states.as_ref().map_or(0, |s| s.config.layers)
    }

    /// Sequences that can hold a recurrent state at once (0 without state layers).
    #[getter]
    fn state_slots(&self) -> usize {
        self.states.as_ref().map_or(0, |s| s.config.slots)
    }

    /// State slots no sequence holds (0 without state layers).
    #[getter]
    fn free_state_slots(&self, py: Python<'_>) -> usize {
        self.core
            .read(py, |c| c.states().map_or(0, |a| a.free_slots()))
    }

    /// Each state's shape per sequence and layer and its dtype: {name: (dims, dtype)}
    /// (empty without state layers).
    #[getter]
    fn state_shapes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        match &self.states {
            Some(s) => s.shapes(py),
            None => Ok(PyDict::new(py)),
        }
    }

    /// Zero-copy writable views of one state layer's states for every slot, by name:
    /// `{name: [state_slots, *dims]}`; a sequence's row is `seq.state_slot` (what a
    /// batched kernel indexes, as vLLM's Mamba layers do).
    fn state_cache<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, PyDict>> {
        let me = slf.get();
        let states = me.state_layout()?;
        states.views(
            slf.as_any(),
            me.device,
            layer,
            0,
            states.config.slots,
            false,
        )
    }

    /// Moves the states of `seqs` (distinct sequences of this pool) to consecutive slots
    /// in their order, the lowest such run, and returns its first slot: then
    /// `state_cache(layer)[name][first:first + len(seqs)]` is the batch's states as one
    /// tensor. Contents follow their sequences; views of the moved slots see the new
    /// holders.
    fn pack_states(slf: &Bound<'_, Self>, seqs: &Bound<'_, PyAny>) -> PyResult<u32> {
        slf.get().state_layout()?;
        let ids = Self::ids(slf, seqs, "seqs")?;
        if ids.is_empty() {
            return Ok(0);
        }
        slf.get().core.write(slf.py(), |c| c.pack_states(&ids)).py()
    }

    /// Zero-copy writable views (K, V) of one layer's cache tensor: FlashInfer's separate
    /// paged K and V caches (its MLA ckv and kpe caches for a latent pool), strided views
    /// [num_blocks, block_size, num_kv_heads, head_dim] and [..., v_head_dim] (NHD; HND
    /// swaps the middle axes).
    fn kv_cache_parts<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, PyTuple>> {
        let sh = slf.get().shape;
        let layer = kvrs::unstable::check_index("layer", layer, sh.num_layers).py()?;
        let tensor = slf.get().core.read(slf.py(), |c| c.tensor_of(layer));
        let part = |kv: Kv| {
            let (dims, strides) = sh.part_tensor_shape(kv);
            let at = sh.block_offset(tensor, 0) + sh.part_offset(kv);
            slf.get().view(slf.as_any(), at, &dims, &strides, true)
        };
        PyTuple::new(slf.py(), [part(Kv::Key)?, part(Kv::Value)?])
    }

    /// Zero-copy writable view of one layer's cache tensor, in FlashInfer's paged layout
    /// (K and V of one head size; kv_cache_parts otherwise).
    fn kv_cache<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, PyAny>> {
        let sh = slf.get().shape;
        if sh.v_head_dim != sh.head_dim {
            return Err(KvError::InvalidArgument {
                name: "layer",
                value: layer.to_string(),
                reason: format!(
                    "kv_cache is one [num_blocks, 2, ...] tensor, which needs head_dim == \
                     v_head_dim; this pool has {} and {}: use kv_cache_parts(layer), the (K, V) \
                     pair FlashInfer also takes",
                    sh.head_dim, sh.v_head_dim
                ),
            }
            .py());
        }
        let layer = kvrs::unstable::check_index("layer", layer, sh.num_layers).py()?;
        let tensor = slf.get().core.read(slf.py(), |c| c.tensor_of(layer));
        let dims = sh.layer_tensor_shape();
        let mut strides = [1usize; 5];
        for i in (0..4).rev() {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
        slf.get().view(
            slf.as_any(),
            sh.block_offset(tensor, 0),
            &dims,
            &strides,
            true,
        )
    }

    /// Occupancy as a dict (blocks, bytes, exact token counts).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, tiers) = self
            .core
            .read(py, |c| (c.stats(), super::tiers::tier_snapshot(c)));
        let d = super::pool_stats::stats_dict(py, &s, tiers.as_ref())?;
        let suffix = self.suffix.lock().lock().stats();
        super::suffix::put_stats(&d, &suffix, "suffix_")?;
        Ok(d)
    }

    /// The pool's suffix index: speculative drafts from the tokens its requests held
    /// (``generate_batch``'s suffix method); assign a `SuffixIndex` to resize it.
    #[getter]
    fn suffix_index(&self) -> super::suffix::PySuffixIndex {
        super::suffix::PySuffixIndex {
            inner: self.suffix.lock().clone(),
        }
    }

    #[setter]
    fn set_suffix_index(&self, index: PyRef<'_, super::suffix::PySuffixIndex>) {
        *self.suffix.lock() = index.inner.clone();
    }

    /// Starts a sequence; with `tokens` (the prompt's ids) it attaches the longest cached
    /// prefix (see num_cached_tokens) and caches its blocks as they fill.
    #[pyo3(signature = (tokens = None, namespace = None, extra_key = None))]
    fn new_sequence(
        slf: &Bound<'_, Self>,
        tokens: Option<&Bound<'_, PyAny>>,
        namespace: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PySequence> {
        let (ns, extra) = (
            key_bytes(namespace, "namespace")?,
            key_bytes(extra_key, "extra_key")?,
        );
        let pool = &slf.get().core;
        let py = slf.py();
        if pool.states.is_some() {
            // No prefix cache and no tiers: the state slot is the only thing to check.
            let t = tokens.map(|t| read_token_ids(t, "tokens")).transpose()?;
            let seq = pool
                .write(py, |c| {
                    c.check_state_room(1, || "starting a sequence".into())?;
                    Ok::<_, KvError>(c.new_sequence_owning(t.unwrap_or_default(), &ns, &extra))
                })
                .py()?;
            return Ok(Self::sequence(slf, seq));
        }
        let id = match tokens {
            Some(t) => {
                let t = read_token_ids(t, "tokens")?;
                // A tier lookup in three steps: planned under the pool's lock, fetched
                // without it and without the GIL, committed under the lock; long prompts
                // take a while to hash: without the GIL too.
                let limit = kvrs::unstable::prompt_limit(&t);
                let lookup = if pool.read(py, |c| c.tiers().is_some()) {
                    pool.read_moving(py, 4 * t.len(), |c| {
                        c.plan_tier_lookup(&t, &ns, &extra, limit)
                    })
                } else {
                    None
                };
                let fetched = lookup.map(|l| py.detach(|| l.fetch()));
                pool.write_detached(py, |c| c.new_sequence_fetched(t, &ns, &extra, fetched))
            }
            None if ns.is_empty() && extra.is_empty() => pool.write(py, |c| c.new_sequence()),
            None => pool.write(py, |c| c.new_sequence_with(&[], &ns, &extra)),
        };
        Ok(Self::sequence(slf, id))
    }

    /// Tokens of `tokens` a new sequence would find cached (whole blocks, then a partial
    /// block), without attaching anything.
    #[pyo3(signature = (tokens, namespace = None, extra_key = None))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (t, ns, extra) = prefix_args(tokens, namespace, extra_key)?;
        Ok(self
            .core
            .read_moving(py, 4 * t.len(), |c| c.match_prefix(&t, &ns, &extra)))
    }

    /// Loads what the offload tiers hold of `tokens`' prefix into the pool's cache
    /// without starting a sequence; returns the tokens a new sequence would now find
    /// cached. With wait=False, starts fetching it in the background and returns at
    /// once the tokens of whole blocks the pool lacks; the lookup of a sequence starting
    /// with `tokens` then loads from what was fetched.
    #[pyo3(signature = (tokens, namespace = None, extra_key = None, wait = true))]
    fn prefetch(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
        wait: bool,
    ) -> PyResult<usize> {
        let (t, ns, extra) = prefix_args(tokens, namespace, extra_key)?;
        if wait {
            // Planned under the pool's lock, fetched without it (and the GIL), committed.
            let lookup = self.core.read_moving(py, 4 * t.len(), |c| {
                c.plan_tier_lookup(&t, &ns, &extra, t.len())
            });
            let fetched = lookup.map(|l| py.detach(|| l.fetch()));
            Ok(self
                .core
                .write_detached(py, |c| c.prefetch_fetched(fetched, &t, &ns, &extra))
                .py()?)
        } else {
            Ok(self
                .core
                .write_detached(py, |c| c.prefetch_async(&t, &ns, &extra))
                .py()?)
        }
    }

    /// Queues the cached blocks `seqs` hold for the offload tiers now (as eviction
    /// would), with the cached state checkpoints at their ends (pools with state
    /// layers); returns how many blocks were queued. flush_tiers() waits for them.
    fn store_to_tiers(slf: &Bound<'_, Self>, seqs: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ids = Self::ids(slf, seqs, "seqs")?;
        slf.get()
            .core
            .read(slf.py(), |c| {
                ids.iter()
                    .map(|&id| c.store_to_tiers(id))
                    .sum::<kvrs::Result<usize>>()
            })
            .py()
    }

    /// Waits until every block queued for the offload tiers is written (or refused).
    fn flush_tiers(&self, py: Python<'_>) {
        // The tiers' threads are shared: waited for without the pool's lock.
        if let Some(ts) = self.core.read(py, |c| c.tiers().cloned()) {
            py.detach(|| ts.flush());
        }
    }

    /// Removes every block of `namespace` from the offload tiers; returns how many.
    #[pyo3(signature = (namespace = None))]
    fn drop_tier_namespace(
        &self,
        py: Python<'_>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let ns = key_bytes(namespace, "namespace")?;
        let (ts, prefix) = self
            .core
            .read(py, |c| {
                let prefix = c.tier_namespace_prefix(&ns)?;
                Ok::<_, KvError>((c.tiers().cloned(), prefix))
            })
            .py()?;
        // Tier I/O without the pool's lock and without the GIL.
        Ok(ts.map_or(0, |ts| py.detach(|| ts.drop_namespace(&prefix))))
    }

    /// Keeps the cached whole blocks of `tokens` from eviction until unpin(); returns the
    /// tokens pinned.
    #[pyo3(signature = (tokens, namespace = None, extra_key = None))]
    fn pin(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (t, ns, extra) = prefix_args(tokens, namespace, extra_key)?;
        self.core
            .write_moving(py, 4 * t.len(), |c| c.pin(&t, &ns, &extra))
            .py()
    }

    /// Undoes one pin() of the same prefix; returns the tokens unpinned.
    #[pyo3(signature = (tokens, namespace = None, extra_key = None))]
    fn unpin(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        extra_key: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (t, ns, extra) = prefix_args(tokens, namespace, extra_key)?;
        self.core
            .write_moving(py, 4 * t.len(), |c| c.unpin(&t, &ns, &extra))
            .py()
    }

    /// Drops every cached block no sequence holds; returns how many.
    fn evict_all(&self, py: Python<'_>) -> usize {
        self.core.write_detached(py, |c| c.evict_all())
    }

    /// Blocks stored in and removed from the prefix cache since the last call: a list of
    /// dicts (type 'stored' or 'removed', block_hash and parent_hash as 32-digit hex,
    /// num_tokens, block_id).
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.core.write(py, |c| c.drain_events()).py()?;
        let out = PyList::empty(py);
        for e in events {
            let d = PyDict::new(py);
            d.set_item("type", if e.stored { "stored" } else { "removed" })?;
            d.set_item("block_hash", format!("{:032x}", e.hash))?;
            d.set_item("parent_hash", format!("{:032x}", e.parent))?;
            d.set_item("num_tokens", e.num_tokens)?;
            d.set_item("block_id", e.block)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Closes the pool's offload tiers: writes every cached block (and cached state
    /// checkpoint at a block end) the tiers do not hold yet, waits until written, and
    /// stops the write-back thread; returns how many blocks were queued. Closing twice,
    /// or a pool without tiers, is harmless (0). The pool stays usable; later blocks are
    /// no longer written to the tiers (counted as dropped).
    fn close(&self, py: Python<'_>) -> usize {
        // Queued under the pool's lock; written, and the thread stopped, without it.
        let (n, tiers) = self.core.write_detached(py, |c| match c.tiers().cloned() {
            Some(ts) if !ts.writer.is_closed() => (c.store_cached(), Some(ts)),
            _ => (0, None),
        });
        if let Some(ts) = tiers {
            py.detach(|| ts.close());
        }
        n
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Closes the pool's tiers (close); an exception in the block propagates.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// When cached blocks are written to the tiers: 'write_through', 'write_back' or
    /// 'write_through_selective' (None without tiers).
    #[getter]
    fn tier_write_policy(&self, py: Python<'_>) -> Option<&'static str> {
        self.core
            .read(py, |c| c.tier_write_mode().map(|m| m.name()))
    }

    /// Binds the pool to the model of `fingerprint` (kvrs.model_fingerprint(model)):
    /// the first binding is kept, the same one again is a no-op, another raises
    /// ValueError naming both (one model's cached K/V are never served to another). A
    /// pool without model_id takes the fingerprint as its model_id.
    fn bind_model(&self, py: Python<'_>, fingerprint: &str) -> PyResult<()> {
        self.core.write(py, |c| c.bind_model(fingerprint)).py()
    }

    /// The fingerprint of the model the pool is bound to (bind_model), or None.
    #[getter]
    fn model_fingerprint(&self, py: Python<'_>) -> Option<String> {
        self.core
            .read(py, |c| c.model_fingerprint().map(str::to_string))
    }

    /// The model id that tiers and prefix-cache files key its blocks by ('' for none).
    #[getter]
    fn model_id(&self, py: Python<'_>) -> String {
        self.core.read(py, |c| c.model_id().to_string())
    }

    /// Writes every cached block to `path` (safetensors, atomically), with the pool's
    /// model_id (and, with state layers, every cached state checkpoint whose blocks it
    /// holds); returns how many blocks. MemoryError when the host cannot hold the copy.
    fn save_prefix_cache(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<usize> {
        // A copy under the pool's lock; the file is written after it is released.
        let snapshot = self
            .core
            .read_moving(py, usize::MAX, |c| c.snapshot_prefix_cache())
            .py()?;
        py.detach(|| snapshot.write(&path)).py()
    }

    /// Warms the prefix cache from a file written by save_prefix_cache() of a pool with
    /// the same seed, configuration and model_id; returns {'loaded': n, 'skipped': m},
    /// and in a pool with state layers 'checkpoints': the state checkpoints loaded. Any
    /// other file (mismatched, truncated or corrupted, or of another state layout)
    /// raises ValueError and loads nothing.
    fn load_prefix_cache<'py>(
        &self,
        py: Python<'py>,
        path: std::path::PathBuf,
    ) -> PyResult<Bound<'py, PyDict>> {
        // The file is read and checked whole without the pool's lock (and the GIL); only
        // loading the checked blocks takes the lock.
        let config = self.core.read(py, |c| c.prefix_file_config()).py()?;
        let file = py
            .detach(|| -> kvrs::Result<_> {
                config.check(&path, kvrs::unstable::read_file(&path)?)
            })
            .py()?;
        let (r, states) = self
            .core
            .write_detached(py, |c| {
                c.commit_file(file).map(|r| (r, c.states().is_some()))
            })
            .py()?;
        let d = PyDict::new(py);
        d.set_item("loaded", r.loaded)?;
        d.set_item("skipped", r.skipped)?;
        if states {
            d.set_item("checkpoints", r.checkpoints)?;
        }
        Ok(d)
    }

    /// Makes `dst` hold the first `n` committed positions of `src`, sharing blocks.
    fn copy_prefix(
        slf: &Bound<'_, Self>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        n: i64,
    ) -> PyResult<()> {
        let (s, d) = (Self::id_of(slf, src, "src")?, Self::id_of(slf, dst, "dst")?);
        slf.get()
            .core
            .write(slf.py(), |c| c.copy_prefix(s, d, n))
            .py()
    }

    /// Frees every sequence of the pool not in `seqs`.
    fn keep(slf: &Bound<'_, Self>, seqs: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = Self::ids(slf, seqs, "seqs")?;
        slf.get().core.write(slf.py(), |c| c.keep(&ids)).py()
    }

    /// Reserves room for counts[i] new tokens at the end of each sequence (all or nothing)
    /// and returns their int64 slot mapping (block * block_size + offset); the positions
    /// read as zeros until written.
    fn reserve<'py>(
        slf: &Bound<'py, Self>,
        seqs: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = Self::ids(slf, seqs, "seqs")?;
        let counts = read_ints(counts, "counts")?;
        let (slots, groups) = slf
            .get()
            .core
            .write(slf.py(), |c| {
                c.reserve(&ids, &counts)
                    .map(|s| (s, c.groups().groups.len()))
            })
            .py()?;
        slot_array(slf.py(), slots, groups)
    }

    /// Scatters k, v [n_tokens, num_kv_heads, head_dim] into slot_mapping (-1 skips).
    fn write(
        &self,
        py: Python<'_>,
        layer: i64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (k, v) = (
            read_tensor(k, "k", &self.target)?,
            read_tensor(v, "v", &self.target)?,
        );
        let slots = read_ints(slot_mapping, "slot_mapping")?;
        let (kt, vt) = (k.tensor(), v.tensor());
        self.core
            .write_moving(py, kt.nbytes() + vt.nbytes(), |c| {
                c.write(layer, &kt, &vt, &slots)
            })
            .py()?;
        Ok(())
    }

    /// Sends the pool's later launches (writes, attention, block copies, state
    /// updates) to a CUDA stream, in order on it and with no host synchronisation (the
    /// first launch on a new stream waits once for the previous stream's work): None
    /// (kvrs's own stream), an integer handle, or a torch.cuda.Stream, cupy.cuda.Stream
    /// or any object with __cuda_stream__. CUDA pools only.
    #[pyo3(signature = (stream))]
    fn set_stream(&self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let stream = super::args::parse_stream(stream)?;
        self.core.read(py, |c| c.set_stream(stream)).py()
    }

    /// Scatters every layer in one call (one launch on a CUDA pool): k, v
    /// [num_layers, n_tokens, num_kv_heads, head_dim] (any layer stride) into
    /// slot_mapping [n_tokens] or [num_layer_groups, n_tokens] (-1 skips), as write()
    /// per layer would.
    fn write_layers(
        &self,
        py: Python<'_>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (k, v) = (
            read_stacked(k, "k", &self.target)?,
            read_stacked(v, "v", &self.target)?,
        );
        let slots = read_slot_rows(slot_mapping)?;
        let (kl, vl) = (k.layers(), v.layers());
        let bytes = kl.iter().chain(&vl).map(|t| t.nbytes()).sum();
        self.core
            .write_moving(py, bytes, |c| c.write_layers(&kl, &vl, &slots))
            .py()?;
        Ok(())
    }

    /// FlashInfer's int32 page table (indptr, indices, last_page_len) of `seqs`.
    #[pyo3(signature = (seqs, layer = None))]
    fn page_table<'py>(
        slf: &Bound<'py, Self>,
        seqs: &Bound<'py, PyAny>,
        layer: Option<i64>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let ids = Self::ids(slf, seqs, "seqs")?;
        let py = slf.py();
        let (indptr, indices, last) = slf
            .get()
            .core
            .read(py, |c| c.page_table(&ids, c.group_for(layer)?))
            .py()?;
        PyTuple::new(
            py,
            [
                i32_array(py, indptr),
                i32_array(py, indices),
                i32_array(py, last),
            ],
        )
    }

    /// Block tables of `seqs` as an int32 [batch, max_blocks] array padded with `pad`.
    #[pyo3(signature = (seqs, pad = -1, layer = None))]
    #[pyo3(text_signature = "($self, seqs, pad=-1, layer=None)")]
    fn block_tables<'py>(
        slf: &Bound<'py, Self>,
        seqs: &Bound<'py, PyAny>,
        pad: i32,
        layer: Option<i64>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = Self::ids(slf, seqs, "seqs")?;
        let (flat, width) = slf
            .get()
            .core
            .read(slf.py(), |c| c.block_tables(&ids, c.group_for(layer)?, pad))
            .py()?;
        PyArray1::from_vec(slf.py(), flat).reshape([ids.len(), width])
    }

    /// Places a batch of tokens (token i: seqs[i] at positions[i], or where its sequence
    /// continues when positions is None; token id tokens[i] when given) and reserves their
    /// slots; returns a ForwardBatch for put / get / finish. draft=True: the tokens are
    /// speculative (a draft chain or tree); finish() commits them, but no block holding
    /// one joins the prefix cache until Sequence.accept keeps it (a batch that attends
    /// with a custom mask is marked so by that).
    #[pyo3(signature = (seqs, positions = None, tokens = None, *, draft = false))]
    fn start_forward(
        slf: &Bound<'_, Self>,
        seqs: &Bound<'_, PyAny>,
        positions: Option<&Bound<'_, PyAny>>,
        tokens: Option<&Bound<'_, PyAny>>,
        draft: bool,
    ) -> PyResult<PyForwardBatch> {
        let (ids, objects) = Self::sequences(slf, seqs, "seqs")?;
        let positions = positions.map(|p| read_ints(p, "positions")).transpose()?;
        let tokens = tokens.map(|t| read_token_ids(t, "tokens")).transpose()?;
        let core = &slf.get().core;
        let plan = core
            .write(slf.py(), |c| {
                c.start_forward(&ids, positions.as_deref(), tokens.as_deref())
            })
            .py()?;
        if draft {
            plan.mark_draft();
        }
        Ok(PyForwardBatch::new(core.clone(), plan, objects))
    }

    /// Verifies internal consistency (reference counts, free list, block tables);
    /// raises AssertionError naming the first broken invariant. O(blocks); for tests.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.core
            .write(py, |c| c.check_invariants())
            .map_err(PyAssertionError::new_err)
    }

    fn __repr__(&self) -> String {
        let s = self.shape;
        format!(
            "BlockPool(num_layers={}, num_kv_heads={}, head_dim={}{}, block_size={}, num_blocks={}, dtype='{}', device='{}', layout='{}')",
            s.num_layers, s.num_kv_heads, s.head_dim, v_head_dim_repr(s.head_dim, s.v_head_dim), s.block_size, s.num_blocks, self.dtype, self.device, s.layout
        )
    }
}

/// `", v_head_dim=N"` for a repr when the values' head size differs from the keys'.
pub(crate) fn v_head_dim_repr(head_dim: usize, v_head_dim: usize) -> String {
    if v_head_dim == head_dim {
        String::new()
    } else {
        format!(", v_head_dim={v_head_dim}")
    }
}
