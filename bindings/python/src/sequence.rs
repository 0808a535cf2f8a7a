//! `kvrs.Sequence`: one sequence of a pool, its block table and lengths, and the
//! operations on it (appends, reads, views, attention, forks, edits).

use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::attention::{self, AttnArgs};
use super::errors::ToPython;
use super::input::{read_ints, read_tensor, read_token_ids};
use super::kv_cache::PyKVCache;
use super::output::{new_output, writable, Output};
use super::quant::{head_scales, read_dtype};
use super::shared_pool::{i32_array, SharedPool};
use kvrs::unstable::{PoolCore, Region, NO_BLOCK};
use kvrs::{DType, Kv, KvError, KvLayout, SeqId};

/// One sequence's view of a pool: its block table and lengths.
#[pyclass(frozen, name = "Sequence", module = "kvrs")]
pub struct PySequence {
    /// The `kvrs.BlockPool` object (kept alive by its sequences, the base of their views).
    pub(crate) pool: Py<PyAny>,
    /// The pool's shared state.
    pub(crate) core: Arc<SharedPool>,
    /// This sequence's id in the pool.
    pub(crate) id: SeqId,
}

impl Drop for PySequence {
    fn drop(&mut self) {
        // Release on garbage collection, which may run anywhere (even while this thread
        // is inside the pool's lock for another call): the pool frees it without waiting.
        self.core.release(self.id);
    }
}

impl PySequence {
    fn pool_ref(&self) -> &SharedPool {
        &self.core
    }

    /// Runs `f` on this sequence's state under the pool's shared lock.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&kvrs::unstable::SeqState, &PoolCore) -> T + Send,
    ) -> PyResult<T> {
        let id = self.id;
        self.core.read(py, |c| c.seq(id).map(|s| f(s, c))).py()
    }
}

#[pymethods]
impl PySequence {
    /// `Sequence[np.ndarray]` or `Sequence[kvrs.DeviceTensor]`: the type of its reads, for
    /// annotations (the stub's generic parameter).
    #[classmethod]
    #[pyo3(signature = (item, /))]
    fn __class_getitem__<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        super::generic_alias(cls, item)
    }

    /// The pool this sequence lives in.
    #[getter]
    fn pool(&self, py: Python<'_>) -> Py<PyAny> {
        self.pool.clone_ref(py)
    }

    /// Committed length.
    #[getter]
    fn seq_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s, _| s.seq_len)
    }

    /// Blocks the sequence holds (every layer group).
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s, _| s.all_blocks().count())
    }

    /// The block ids, in position order (an int32 copy), of a pool with one layer group.
    #[getter]
    fn block_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let blocks = self
            .with(py, |s, p| {
                p.group_for(None).map(|g| {
                    s.tables[g]
                        .blocks
                        .iter()
                        .map(|&b| b as i32)
                        .collect::<Vec<_>>()
                })
            })?
            .py()?;
        Ok(i32_array(py, blocks))
    }

    /// `layer`'s block table (int32): entry i covers positions i * block_size.., -1 where
    /// the block was released (out of a sliding or chunked layer's reach).
    fn layer_blocks<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let blocks = self
            .with(py, |s, p| {
                p.group_for(Some(layer)).map(|g| {
                    s.tables[g]
                        .blocks
                        .iter()
                        .map(|&b| if b == NO_BLOCK { -1 } else { b as i32 })
                        .collect::<Vec<_>>()
                })
            })?
            .py()?;
        Ok(i32_array(py, blocks))
    }

    /// Lowest position every layer holds (-1 when empty): 0 unless sliding or chunked
    /// layers released their beginning.
    #[getter]
    fn pos_min(&self, py: Python<'_>) -> PyResult<i64> {
        self.with(py, |s, _| {
            let first = s.tables.iter().map(|t| t.start).max().unwrap_or(0);
            if s.seq_len == 0 || first >= s.seq_len {
                -1
            } else {
                first as i64
            }
        })
    }

    /// First position `layer` holds (get() returns positions layer_start..layer_len).
    fn layer_start(&self, py: Python<'_>, layer: i64) -> PyResult<usize> {
        let layer =
            kvrs::unstable::check_index("layer", layer, self.pool_ref().shape.num_layers).py()?;
        let id = self.id;
        Ok(self.with(py, |_, p| p.layer_span(id, layer))?.py()?.0)
    }

    /// Whether the cache still holds everything needed to continue at `pos` (after
    /// truncating to it), for every layer kind (ollama's CanResume).
    fn can_resume(&self, py: Python<'_>, pos: i64) -> PyResult<bool> {
        let id = self.id;
        self.core.read(py, |c| c.can_resume(id, pos)).py()
    }

    /// Highest committed position (-1 when empty).
    #[getter]
    fn pos_max(&self, py: Python<'_>) -> PyResult<i64> {
        self.with(py, |s, _| s.seq_len as i64 - 1)
    }

    /// Whether free() has been called (or the pool's keep() dropped it).
    #[getter]
    fn is_freed(&self, py: Python<'_>) -> bool {
        let id = self.id;
        !self.core.read(py, |c| c.is_live(id))
    }

    /// Positions written into `layer` (committed and appended).
    fn layer_len(&self, py: Python<'_>, layer: i64) -> PyResult<usize> {
        let layer =
            kvrs::unstable::check_index("layer", layer, self.pool_ref().shape.num_layers).py()?;
        self.with(py, |s, _| s.layer_len[layer])
    }

    /// Bytes of the blocks this sequence holds (shared blocks count in full), and of its
    /// state slot in a pool with state layers.
    fn memory_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s, p| {
            let slot = p
                .states()
                .filter(|_| s.state_slot.is_some())
                .map_or(0, |a| a.config().slot_bytes());
            s.all_blocks().count() * p.bytes_per_block() + slot
        })
    }

    /// Appends k, v [n_tokens, num_kv_heads, head_dim] at the layer's next free
    /// position, allocating (and copying shared) blocks as needed; returns that position.
    fn append(
        &self,
        py: Python<'_>,
        layer: i64,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let pool = self.pool_ref();
        let (k, v) = (
            read_tensor(k, "k", &pool.target)?,
            read_tensor(v, "v", &pool.target)?,
        );
        let (kt, vt, id) = (k.tensor(), v.tensor(), self.id);
        pool.write_moving(py, kt.nbytes() + vt.nbytes(), |c| {
            c.append(id, layer, &kt, &vt)
        })
        .py()
    }

    /// Commits n tokens: seq_len += n. Every layer must hold them already. `tokens` (n
    /// ids) records their token ids, so the blocks they fill join the prefix cache.
    #[pyo3(signature = (n = 1, tokens = None))]
    fn advance(&self, py: Python<'_>, n: i64, tokens: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let tokens = tokens.map(|t| read_token_ids(t, "tokens")).transpose()?;
        let id = self.id;
        self.core
            .write(py, |c| c.advance(id, n, tokens.as_deref()))
            .py()
    }

    /// Prompt tokens served from the prefix cache when the sequence started.
    #[getter]
    fn num_cached_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s, _| s.num_cached_tokens)
    }

    /// Of num_cached_tokens, what the pool itself served ("pool") and what each offload
    /// tier served (by its name), when the sequence started.
    #[getter]
    fn cached_tokens_by_tier<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let counts = self.with(py, |s, p| super::tiers::cached_by_tier(p, s))?;
        let d = pyo3::types::PyDict::new(py);
        for (name, n) in counts {
            d.set_item(name, n)?;
        }
        Ok(d)
    }

    /// The token ids the sequence knows (its prompt and committed tokens), as uint32.
    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let t = self.with(py, |s, _| s.tokens.clone())?;
        Ok(PyArray1::from_vec(py, t))
    }

    /// Sets seq_len and every layer's length to n, growing or shrinking the block table
    /// (for callers that inject blocks kept elsewhere); caches blocks whose ids are known.
    /// Positions a layer gains without a write read as zeros and are never cached.
    fn set_seq_len(&self, py: Python<'_>, n: i64) -> PyResult<()> {
        let id = self.id;
        self.core.write(py, |c| c.set_seq_len(id, n)).py()
    }

    /// Copies [num_kv_heads, block_size, head_dim] keys and values of `layer` from
    /// start_pos (of the storage dtype; float32, dequantized, for 8-bit pools); positions
    /// the layer does not hold come back as zeros.
    fn extract_block<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        start_pos: i64,
        block_size: i64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let pool = self.pool_ref();
        pool.read(py, |c| c.check_block_args(layer, start_pos, block_size))
            .py()?;
        let (h, n) = (pool.shape.num_kv_heads, block_size as usize);
        let dtype = read_dtype(pool.dtype);
        let mut k = new_output(py, pool.device, dtype, &[h, n, pool.shape.head_dim])?;
        let mut v = new_output(py, pool.device, dtype, &[h, n, pool.shape.v_head_dim])?;
        let (mut kt, mut vt, id) = (k.tensor(), v.tensor(), self.id);
        pool.read_moving(py, 2 * kt.nbytes(), |c| {
            c.extract_block(id, layer, start_pos, block_size, &mut kt, &mut vt)
        })
        .py()?;
        PyTuple::new(py, [k.into_object(), v.into_object()])
    }

    /// Writes [num_kv_heads, block_size, head_dim] keys and values of `layer` at
    /// start_pos, allocating blocks as needed; commit with set_seq_len() or advance().
    fn inject_block(
        &self,
        py: Python<'_>,
        layer: i64,
        start_pos: i64,
        block_size: i64,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let pool = self.pool_ref();
        let (k, v) = (
            read_tensor(keys, "keys", &pool.target)?,
            read_tensor(values, "values", &pool.target)?,
        );
        let (kt, vt, id) = (k.tensor(), v.tensor(), self.id);
        pool.write_moving(py, kt.nbytes() + vt.nbytes(), |c| {
            c.inject_block(id, layer, start_pos, block_size, &kt, &vt)
        })
        .py()?;
        Ok(())
    }

    /// Replaces `cache`'s content with this sequence's (lengths included).
    fn copy_to_cache(&self, py: Python<'_>, cache: &Bound<'_, PyKVCache>) -> PyResult<()> {
        let cache = cache.get();
        let id = self.id;
        // The pool's lock, then the cache's (always in this order), both waited for
        // without the GIL.
        self.core
            .read_moving(py, usize::MAX, |c| {
                cache.core().write_blocking(|kv| c.copy_to_cache(id, kv))
            })
            .py()?;
        Ok(())
    }

    /// Fills this empty sequence from `cache` (every layer's positions and lengths).
    fn copy_from_cache(&self, py: Python<'_>, cache: &Bound<'_, PyKVCache>) -> PyResult<()> {
        let cache = cache.get();
        let id = self.id;
        self.core
            .write_detached(py, |c| {
                cache.core().read_blocking(|kv| c.copy_from_cache(id, kv))
            })
            .py()?;
        Ok(())
    }

    /// Attention of this sequence's newest tokens over `layer`, read in place from the
    /// pool's blocks: q [n, num_q_heads, head_dim] are the queries of the last n
    /// positions the layer holds (the tokens just appended); each attends up to its own
    /// position within the layer's window. Returns a new array of q's shape and dtype,
    /// or fills `out`.
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
        let pool = self.pool_ref();
        let id = self.id;
        let out_dim = args.out_dim(pool.shape.head_dim, pool.shape.v_head_dim);
        attention::run(py, q, out, &pool.target, out_dim, |q, o| {
            pool.read_moving(py, usize::MAX, |c| {
                c.seq_attention(id, layer, q, o, &args.options())
            })
        })
    }

    /// The layer's K and V gathered into contiguous [num_kv_heads, length, head_dim]
    /// arrays of the storage dtype (8-bit pools: the raw codes; float32 values with
    /// `dequantize=True`), or into `out`, a (K, V) pair of writable float arrays
    /// [num_kv_heads, >= length, head_dim] (the result is then a view of `out`).
    #[pyo3(signature = (layer, out = None, *, dequantize = false))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        out: Option<&Bound<'py, PyAny>>,
        dequantize: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let pool = self.pool_ref();
        let dtype = if dequantize { DType::F32 } else { pool.dtype };
        let id = self.id;
        let (h, d, dv) = (
            pool.shape.num_kv_heads,
            pool.shape.head_dim,
            pool.shape.v_head_dim,
        );
        let l = kvrs::unstable::check_index("layer", layer, pool.shape.num_layers).py()?;
        if let Some(pair) = out {
            let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = pair.extract()?;
            let (mut ko, mut vo) = (
                writable(&k, "out[0]", &pool.target)?,
                writable(&v, "out[1]", &pool.target)?,
            );
            let (mut kt, mut vt) = (ko.tensor(), vo.tensor());
            let bytes = kt.nbytes() + vt.nbytes();
            let (_, len) = pool
                .read_moving(py, bytes, |c| c.gather(id, layer, &mut kt, &mut vt))
                .py()?;
            let cut = (
                pyo3::types::PySlice::full(py),
                pyo3::types::PySlice::new(py, 0, len as isize, 1),
            );
            return PyTuple::new(py, [k.get_item(&cut)?, v.get_item(&cut)?]);
        }
        // The length and the positions are read in one locked call. The fresh outputs are
        // sized before it (allocating takes the GIL, never held under the lock), so a
        // sequence whose length changed in between is read again at its new length.
        let mut len = self
            .with(py, |_, p| p.layer_span(id, l).map(|(a, b)| b - a))?
            .py()?;
        loop {
            let (mut k, mut v) = (
                new_output(py, pool.device, dtype, &[h, len, d])?,
                new_output(py, pool.device, dtype, &[h, len, dv])?,
            );
            let (mut kt, mut vt) = (k.tensor(), v.tensor());
            let read = pool
                .read_moving(py, kt.nbytes() + vt.nbytes(), |c| {
                    let (first, end) = c.layer_span(id, l)?;
                    if end - first != len {
                        return Ok(Err(end - first));
                    }
                    c.gather(id, layer, &mut kt, &mut vt).map(|_| Ok(()))
                })
                .py()?;
            match read {
                Ok(()) => return PyTuple::new(py, [k.into_object(), v.into_object()]),
                Err(now) => len = now,
            }
        }
    }

    /// The scales (K, V) that multiply `get(layer)`'s codes: int8, float32 copies
    /// [num_kv_heads, length] (one per token and head; [num_kv_heads, length, chunks]
    /// when K and V have different head sizes, one per gcd(head_dim, v_head_dim)
    /// elements); fp8, [num_kv_heads, 1] (one per
    /// head); float dtypes, ones [num_kv_heads, 1].
    fn scales<'py>(&self, py: Python<'py>, layer: i64) -> PyResult<Bound<'py, PyTuple>> {
        let pool = self.pool_ref();
        let id = self.id;
        let read = pool
            .read(py, |p| -> kvrs::Result<_> {
                p.seq(id)?;
                if p.row_scales().is_none() {
                    let l = kvrs::unstable::check_index("layer", layer, p.shape().num_layers)?;
                    return Ok(Err((l, p.scales().clone())));
                }
                p.gather_scales(id, layer).map(Ok)
            })
            .py()?;
        let (_, n, k, v) = match read {
            Ok(rows) => rows,
            Err((l, scales)) => {
                return PyTuple::new(
                    py,
                    [
                        head_scales(py, &scales, l, Kv::Key)?,
                        head_scales(py, &scales, l, Kv::Value)?,
                    ],
                )
            }
        };
        let sh = pool.shape;
        let h = sh.num_kv_heads;
        // [heads, n], or [heads, n, chunks] where a vector has several scales (int8 K and V
        // of different head sizes: one per gcd(head_dim, v_head_dim) elements).
        let arr = |x: Vec<f32>, kv: Kv| -> PyResult<Bound<'py, PyAny>> {
            let c = sh.dim(kv) / sh.scale_unit();
            let a = PyArray1::from_vec(py, x);
            Ok(if c == 1 {
                a.reshape([h, n])?.into_any()
            } else {
                a.reshape([h, n, c])?.into_any()
            })
        };
        PyTuple::new(py, [arr(k, Kv::Key)?, arr(v, Kv::Value)?])
    }

    /// Zero-copy read-only per-block views of the layer: a list of (start, length, K, V),
    /// K and V in the pool's layout ([length, heads, dim] for NHD, [heads, length, dim] for
    /// HND). With `copy=True`, copies the caller owns, all read under one lock.
    #[pyo3(signature = (layer, *, copy = false))]
    fn views<'py>(&self, py: Python<'py>, layer: i64, copy: bool) -> PyResult<Bound<'py, PyList>> {
        let sh = self.pool_ref().shape;
        let layer = kvrs::unstable::check_index("layer", layer, sh.num_layers).py()?;
        let parts =
            |s: &kvrs::unstable::SeqState, p: &PoolCore| -> Vec<(usize, usize, [Region; 2])> {
                let t = &s.tables[p.groups().group_of[layer]];
                let (len, bs, tensor) = (s.layer_len[layer], sh.block_size, p.tensor_of(layer));
                let mut parts = Vec::new();
                for (i, &b) in t.blocks.iter().enumerate() {
                    let start = (i * bs).max(t.start);
                    if start >= len {
                        break;
                    }
                    if b == NO_BLOCK {
                        continue;
                    }
                    let n = ((i + 1) * bs).min(len) - start;
                    let region = |kv: Kv| {
                        let mut r = sh.positions(tensor, kv, b, start % bs, n);
                        if sh.layout == KvLayout::Hnd {
                            // [heads, length, dim], as the pool stores it.
                            r.shape.swap(0, 1);
                            r.strides.swap(0, 1);
                        }
                        r
                    };
                    parts.push((start, n, [region(Kv::Key), region(Kv::Value)]));
                }
                parts
            };
        let mut snapshot = self.with(py, parts)?;
        let out = PyList::empty(py);
        if !copy {
            let pool_obj = self.pool.bind(py);
            for (start, n, [k, v]) in snapshot {
                let view = |r: Region| {
                    let strides = r.strides;
                    self.core
                        .view(pool_obj, r.offset, &r.shape, &strides, false)
                };
                out.append((start, n, view(k)?, view(v)?))?;
            }
            return Ok(out);
        }
        let pool = self.pool_ref();
        let id = self.id;
        loop {
            let mut outs = Vec::with_capacity(2 * snapshot.len());
            for (_, _, regions) in &snapshot {
                for r in regions {
                    outs.push(new_output(py, pool.device, pool.dtype, &r.shape)?);
                }
            }
            let mut tensors: Vec<_> = outs.iter_mut().map(|o| o.tensor()).collect();
            let bytes = tensors.iter().map(|t| t.nbytes()).sum();
            let read = pool
                .read_moving(py, bytes, |c| {
                    let now = parts(c.seq(id)?, c);
                    if now != snapshot {
                        return Ok(Err(now));
                    }
                    let regions = snapshot.iter().flat_map(|(_, _, r)| r);
                    for (t, r) in tensors.iter_mut().zip(regions) {
                        c.storage().read(*r, t)?;
                    }
                    Ok::<_, KvError>(Ok(()))
                })
                .py()?;
            drop(tensors);
            match read {
                Ok(()) => {
                    let mut objs = outs.into_iter().map(Output::into_object);
                    for (start, n, _) in snapshot {
                        let (k, v) = (objs.next().expect("a key"), objs.next().expect("a value"));
                        out.append((start, n, k, v))?;
                    }
                    return Ok(out);
                }
                Err(now) => snapshot = now,
            }
        }
    }

    /// Takes a checkpoint of this sequence's recurrent state at its committed length
    /// (pools with state layers that cache prefixes): the state the model wrote for its
    /// seq_len tokens. Returns whether it holds one there (False when its token ids
    /// there are unknown, or every checkpoint slot is held). Commits take them by
    /// themselves at prefill chunk ends, branch points and every checkpoint_interval
    /// tokens; a rollback (truncate) can return to any position with one.
    fn checkpoint(&self, py: Python<'_>) -> PyResult<bool> {
        let id = self.id;
        self.core.write(py, |c| c.checkpoint(id)).py()
    }

    /// Positions of the state checkpoints this sequence holds (ascending).
    #[getter]
    fn checkpoints(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        self.with(py, |s, _| {
            let mut at: Vec<usize> = s.checkpoints.iter().map(|&(p, _)| p).collect();
            at.sort_unstable();
            at
        })
    }

    /// Where this sequence's next prefill chunk should end for the state there to be
    /// checkpointed (pools with state layers that cache prefixes): the first of the
    /// position where its prompt leaves the K/V the cache held when it started, the next
    /// multiple of the pool's checkpoint_interval, and its prompt's last block boundary,
    /// past its committed length and before its prompt's end; else None.
    #[getter]
    fn checkpoint_due(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        let id = self.id;
        self.core.read(py, |c| c.checkpoint_due(id)).py()
    }

    /// Its recurrent-state slot in a pool with state layers (its row of
    /// `pool.state_cache(layer)`), else None.
    #[getter]
    fn state_slot(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        self.with(py, |s, _| s.state_slot)
    }

    /// Zero-copy writable views of this sequence's states in state layer `layer`, by
    /// name (`{name: array of the state's shape}`): the model reads and updates them in
    /// place. A new sequence's states are zeros; `fork` copies them. The views are the
    /// slot's memory: after `free()` they belong to the next sequence given the slot.
    fn state<'py>(slf: &Bound<'py, Self>, layer: i64) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let me = slf.get();
        let states = me.core.state_layout()?;
        let slot = me
            .with(slf.py(), |s, _| s.state_slot)?
            .ok_or_else(|| {
                kvrs::KvError::NotSupported(format!("sequence {} has no state slot", me.id))
            })
            .py()?;
        states.views(slf.as_any(), me.core.device, layer, slot, 1, true)
    }

    /// A new sequence sharing every block of this one (copy-on-write on first write).
    fn fork(&self, py: Python<'_>) -> PyResult<PySequence> {
        let me = self.id;
        let id = self.core.write(py, |c| c.fork(me)).py()?;
        Ok(PySequence {
            pool: self.pool.clone_ref(py),
            core: self.core.clone(),
            id,
        })
    }

    /// Drops positions >= n, returning freed blocks; a no-op when n >= seq_len.
    fn truncate(&self, py: Python<'_>, n: i64) -> PyResult<()> {
        let id = self.id;
        self.core.write(py, |c| c.truncate(id, n)).py()
    }

    /// Commits the accepted path of speculative decoding: of the draft positions from
    /// `start` on, keeps those at start + keep[i] (keep: strictly increasing offsets),
    /// moved to start + i in every layer, and cuts the rest; afterwards every layer
    /// holds start + len(keep) positions, committed where they were (after
    /// batch.finish(); else commit them with advance(n, tokens=accepted ids)). Token ids
    /// move with their positions and the accepted blocks join the prefix cache. ValueError for bad
    /// arguments, CacheFullError when shared blocks cannot be copied, NotSupportedError
    /// for a hybrid pool's cut to a length with no state checkpoint; a refusal changes
    /// nothing.
    fn accept(&self, py: Python<'_>, start: i64, keep: &Bound<'_, PyAny>) -> PyResult<()> {
        let keep = read_ints(keep, "keep")?;
        let id = self.id;
        self.core.write(py, |c| c.accept(id, start, &keep)).py()
    }

    /// llama.cpp's seq_rm: removes positions [begin, end) (end=None: to the end). A tail
    /// is cut; a middle span moves later positions down and re-rotates their keys, which
    /// needs the pool's `rope` (else kvrs.NotSupportedError).
    #[pyo3(signature = (begin, end = None))]
    fn remove(&self, py: Python<'_>, begin: i64, end: Option<i64>) -> PyResult<()> {
        let id = self.id;
        self.core
            .write_detached(py, |c| c.remove(id, begin, end))
            .py()
    }

    /// llama.cpp's seq_add over a tail: positions p0.. move down by -delta (delta < 0),
    /// replacing those they land on; positions that would fall below 0 are removed; keys
    /// are re-rotated with the pool's `rope`. Equals remove(max(0, p0 + delta),
    /// max(p0, -delta)). A shift up or of a middle span raises kvrs.NotSupportedError.
    #[pyo3(signature = (p0, p1, delta))]
    fn shift(&self, py: Python<'_>, p0: i64, p1: Option<i64>, delta: i64) -> PyResult<()> {
        let id = self.id;
        self.core
            .write_detached(py, |c| c.shift(id, p0, p1, delta))
            .py()
    }

    /// Returns every block to the pool; the sequence cannot be used afterwards.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        let id = self.id;
        self.core.write(py, |c| c.free_sequence(id)).py()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) {
        let id = self.id;
        let _ = self.core.write(py, |c| c.free_sequence(id));
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        match self.with(py, |s, _| (s.seq_len, s.all_blocks().count())) {
            Ok((len, blocks)) => format!(
                "Sequence(id={}, seq_len={len}, num_blocks={blocks})",
                self.id
            ),
            Err(_) => format!("Sequence(id={}, freed)", self.id),
        }
    }
}
