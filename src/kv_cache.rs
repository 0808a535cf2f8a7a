//! The contiguous KV cache: one sequence, every layer preallocated head-major
//! (`[num_kv_heads, max_seq_len, head_dim]` for K, `[.., v_head_dim]` for V), filled layer by layer and
//! committed with [`CacheCore::advance`].

use std::ops::Range;

use crate::attention::{self, AttnOptions, KvHeads, KvPages, QueryRow, SeqQueries};
use crate::dtype::DType;
use crate::error::{check_count, check_index, check_positive, check_tokens, KvError, Result, Unit};
pub use crate::layout::Kv;
use crate::layout::{Device, Region};
use crate::paged::pool::check_layer_count;
use crate::scales::{attention_scales, check_dtype, multiply_heads, with_divided, KvScales};
use crate::sizes;
use crate::storage::{allocate, RowScales, Storage};
use crate::tensor::{check_disjoint, expect_block_pair, TensorMut, TensorRef};

/// The sizes that fix a cache's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    /// Transformer layers.
    pub num_layers: usize,
    /// Key/value heads per layer.
    pub num_kv_heads: usize,
    /// Elements per key head vector.
    pub head_dim: usize,
    /// Elements per value head vector (`head_dim` for most models).
    pub v_head_dim: usize,
    /// Positions each layer holds.
    pub max_seq_len: usize,
}

impl CacheShape {
    /// A shape whose keys and values have the same head size.
    pub fn uniform(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_seq_len: usize,
    ) -> Self {
        CacheShape {
            num_layers,
            num_kv_heads,
            head_dim,
            v_head_dim: head_dim,
            max_seq_len,
        }
    }

    /// Elements per head vector of `kv`.
    pub fn dim(&self, kv: Kv) -> usize {
        match kv {
            Kv::Key => self.head_dim,
            Kv::Value => self.v_head_dim,
        }
    }

    /// Elements per int8 scale: `gcd(head_dim, v_head_dim)` ([`sizes::int8_scale_unit`]),
    /// one per head vector when K and V have one head size.
    pub fn scale_unit(&self) -> usize {
        sizes::int8_scale_unit([self.head_dim, self.v_head_dim])
    }

    /// Checks that every size is positive, that there are at most
    /// [`MAX_LAYERS`](crate::paged::pool::MAX_LAYERS) layers and that the whole cache
    /// is addressable; returns its number of elements.
    pub fn validate(&self, dtype: DType) -> Result<usize> {
        check_positive(&[
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("v_head_dim", self.v_head_dim),
            ("max_seq_len", self.max_seq_len),
        ])?;
        check_layer_count(self.num_layers)?;
        sizes::kv_bytes(
            "the cache",
            &[
                ("num_layers", self.num_layers),
                ("num_kv_heads", self.num_kv_heads),
                ("max_seq_len", self.max_seq_len),
            ],
            [self.head_dim, self.v_head_dim],
            dtype,
        )?;
        // The bytes fit, so the element count does.
        Ok(self.num_layers
            * self.num_kv_heads
            * self.max_seq_len
            * (self.head_dim + self.v_head_dim))
    }
}

/// The committed length after committing `n` more tokens to a cache whose layers hold
/// `layer_len` positions and whose committed length is `seq_len`; every layer must
/// already hold the tokens being committed.
pub fn commit_target(seq_len: usize, layer_len: &[usize], n: i64) -> Result<usize> {
    let n = check_count("n", n)?;
    let target = seq_len + n;
    if let Some((layer, &held)) = layer_len.iter().enumerate().find(|(_, &l)| l < target) {
        return Err(KvError::InvalidArgument {
            name: "n",
            value: n.to_string(),
            reason: format!(
                "committing to seq_len {target} needs every layer to hold {target} positions, \
                 but layer {layer} holds {held}; append to it first"
            ),
        });
    }
    Ok(target)
}

/// A contiguous KV cache for one sequence.
///
/// Storage order is `[layer][K|V][head][position][dim]`. Each layer keeps its own fill
/// length (`layer_len`), so a model can append layer by layer; `seq_len` is the committed
/// length, moved by [`CacheCore::advance`], and never exceeds any layer's fill length.
#[derive(Debug)]
pub struct CacheCore {
    shape: CacheShape,
    storage: Box<dyn Storage>,
    scales: KvScales,
    seq_len: usize,
    layer_len: Vec<usize>,
}

impl CacheCore {
    /// Allocates a zero-filled cache of `dtype` on `device`; nothing is allocated later.
    pub fn new(shape: CacheShape, dtype: DType, device: Device) -> Result<Self> {
        let numel = shape.validate(dtype)?;
        let storage = allocate(device, dtype, numel, shape.scale_unit())?;
        Ok(CacheCore {
            shape,
            storage,
            scales: KvScales::unit(shape.num_layers, shape.num_kv_heads)?,
            seq_len: 0,
            layer_len: vec![0; shape.num_layers],
        })
    }

    /// Sets the fp8 scales (an empty cache of an fp8 dtype; unit scales for any other).
    pub fn with_scales(mut self, scales: KvScales) -> Result<Self> {
        check_dtype(&scales, self.dtype())?;
        self.scales = scales;
        Ok(self)
    }

    /// The fp8 scales (all 1 for other dtypes).
    pub fn scales(&self) -> &KvScales {
        &self.scales
    }

    /// The sizes of this cache.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// The storage dtype.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// The device holding the storage.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// The committed length.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Positions written into `layer` (committed and appended), for a validated layer.
    pub fn layer_len(&self, layer: usize) -> usize {
        self.layer_len[layer]
    }

    /// Checks a layer index from a caller.
    pub fn check_layer(&self, layer: i64) -> Result<usize> {
        check_index("layer", layer, self.shape.num_layers)
    }

    /// Bytes of storage held (constant over the cache's life).
    pub fn memory_bytes(&self) -> usize {
        self.storage.nbytes()
    }

    /// `seq_len / max_seq_len`, in [0, 1].
    pub fn utilization_ratio(&self) -> f64 {
        self.seq_len as f64 / self.shape.max_seq_len as f64
    }

    /// Address of element 0 of the storage.
    pub fn data_ptr(&self) -> *mut u8 {
        self.storage.data_ptr()
    }

    /// The byte ranges of the storage's allocations (see [`Storage::spans`]).
    pub fn storage_spans(&self) -> Vec<crate::tensor::Span> {
        self.storage.spans()
    }

    /// The per-vector scales of an int8 cache (`[layer][K|V][head][position]`, one per
    /// head vector); `None` for other dtypes.
    pub fn row_scales(&self) -> Option<RowScales> {
        self.storage.row_scales()
    }

    /// Element offset of `[layer][kv][head][pos][0]`.
    pub fn offset(&self, layer: usize, kv: Kv, head: usize, pos: usize) -> usize {
        let s = &self.shape;
        let run = s.num_kv_heads * s.max_seq_len;
        let d = s.dim(kv);
        layer * run * (s.head_dim + s.v_head_dim)
            + kv as usize * run * s.head_dim
            + (head * s.max_seq_len + pos) * d
    }

    /// The region `[heads, positions start..start+len, head_dim]` of one layer's K or V
    /// (`v_head_dim` for V).
    pub fn region(&self, layer: usize, kv: Kv, start: usize, len: usize) -> Region {
        let s = &self.shape;
        let d = s.dim(kv);
        Region {
            offset: self.offset(layer, kv, 0, start),
            shape: [s.num_kv_heads, len, d],
            strides: [s.max_seq_len * d, d, 1],
        }
    }

    /// Copies positions `0..len` of one layer's K or V as stored (8-bit dtypes: the
    /// codes) into `dst`: every head (`[heads, len, dim]`) or one (`[len, dim]`).
    pub fn read_stored(
        &self,
        layer: usize,
        kv: Kv,
        head: Option<usize>,
        len: usize,
        dst: &mut TensorMut,
    ) -> Result<()> {
        let mut region = self.region(layer, kv, 0, len.min(self.shape.max_seq_len));
        if let Some(h) = head {
            region.offset = self.offset(layer, kv, h, 0);
            region.shape[0] = 1;
        }
        self.storage.read(region, dst)
    }

    /// A host tensor over positions `0..len` of one layer's K or V (`[heads, len,
    /// head_dim]`), for transfers between caches; it borrows the cache, so no write can
    /// change it while it lives. Host storage of a float dtype only.
    ///
    /// ```
    /// use kvrs::unstable::{CacheCore, CacheShape};
    /// use kvrs::Kv;
    /// use kvrs::{DType, Device};
    ///
    /// let shape = CacheShape::uniform(1, 1, 4, 8);
    /// let a = CacheCore::new(shape, DType::F32, Device::Cpu)?;
    /// let t = a.host_tensor(0, Kv::Key, 8)?;
    /// assert_eq!(t.shape(), &[1, 8, 4]);
    /// # Ok::<(), kvrs::KvError>(())
    /// ```
    ///
    /// The tensor is a source only: nothing writes through it, and it cannot outlive the
    /// cache (both fail to compile).
    ///
    /// ```compile_fail
    /// # use kvrs::unstable::{CacheCore, CacheShape};
    /// # use kvrs::Kv;
    /// # use kvrs::{DType, Device};
    /// # let shape = CacheShape::uniform(1, 1, 4, 8);
    /// let (a, b) = (CacheCore::new(shape, DType::F32, Device::Cpu)?, CacheCore::new(shape, DType::F32, Device::Cpu)?);
    /// let t = a.host_tensor(0, Kv::Key, 8)?;
    /// b.extract_block(0, 0, 8, &t, &t)?; // a TensorRef is no destination
    /// # Ok::<(), kvrs::KvError>(())
    /// ```
    ///
    /// ```compile_fail
    /// # use kvrs::unstable::{CacheCore, CacheShape};
    /// # use kvrs::Kv;
    /// # use kvrs::{DType, Device};
    /// # let shape = CacheShape::uniform(1, 1, 4, 8);
    /// let t = {
    ///     let a = CacheCore::new(shape, DType::F32, Device::Cpu)?;
    ///     a.host_tensor(0, Kv::Key, 8)?
    /// }; // `a` is dropped here while `t` borrows it
    /// println!("{:?}", t.shape());
    /// # Ok::<(), kvrs::KvError>(())
    /// ```
    pub fn host_tensor(&self, layer: usize, kv: Kv, len: usize) -> Result<TensorRef<'_>> {
        let (ptr, r) = self.host_region(layer, kv, len)?;
        // SAFETY: the region lies inside this cache's host allocation, borrowed (shared)
        // for the tensor's life: nothing writes it meanwhile.
        unsafe { TensorRef::new(ptr, self.dtype(), &r.shape, &r.signed_strides()) }
    }

    /// Writable host tensors over positions `0..len` of one layer's K and V (`[heads,
    /// len, head_dim]` each, disjoint), borrowing the cache exclusively. Host storage of
    /// a float dtype only.
    pub fn host_tensors_mut(
        &mut self,
        layer: usize,
        len: usize,
    ) -> Result<(TensorMut<'_>, TensorMut<'_>)> {
        let (k, rk) = self.host_region(layer, Kv::Key, len)?;
        let (v, rv) = self.host_region(layer, Kv::Value, len)?;
        let dtype = self.dtype();
        // SAFETY: two disjoint regions (K and V of one layer) of this cache's host
        // allocation, borrowed exclusively for the tensors' life.
        unsafe {
            Ok((
                TensorMut::new(k, dtype, &rk.shape, &rk.signed_strides())?,
                TensorMut::new(v, dtype, &rv.shape, &rv.signed_strides())?,
            ))
        }
    }

    /// The address and region of positions `0..len` of one layer's K or V, for host
    /// tensors over them.
    fn host_region(&self, layer: usize, kv: Kv, len: usize) -> Result<(*mut u8, Region)> {
        if self.device() != Device::Cpu {
            return Err(KvError::NotSupported(format!(
                "direct access to a cache on {}",
                self.device()
            )));
        }
        if self.dtype().is_quantized() {
            return Err(KvError::NotSupported(format!(
                "copies between a pool and a {} KVCache; use a float KVCache (a pool of any \
                 dtype copies into it, dequantized)",
                self.dtype()
            )));
        }
        let r = self.region(layer, kv, 0, len.min(self.shape.max_seq_len));
        // SAFETY (of the address): the region lies inside the host allocation.
        let ptr = unsafe { self.storage.data_ptr().add(r.offset * self.dtype().size()) };
        Ok((ptr, r))
    }

    /// Where `layer`'s K/V lie, for the attention core: one run of `max_seq_len`
    /// positions per head. Host storage only.
    pub fn kv_pages(&self, layer: usize) -> Result<KvPages<'_>> {
        if self.device() != Device::Cpu {
            return Err(KvError::NotSupported(format!(
                "attention over a cache on {} (the attention core reads host memory)",
                self.device()
            )));
        }
        let s = &self.shape;
        let base = self.offset(layer, Kv::Key, 0, 0);
        Ok(KvPages {
            data: self.storage.data_ptr(),
            dtype: self.dtype(),
            table: &[0],
            block_size: s.max_seq_len,
            block_stride: 0,
            base,
            v_offset: self.offset(layer, Kv::Value, 0, 0) - base,
            pos_stride: s.head_dim,
            head_stride: s.max_seq_len * s.head_dim,
            v_pos_stride: s.v_head_dim,
            v_head_stride: s.max_seq_len * s.v_head_dim,
            scales: attention_scales(self.storage.as_ref(), &self.scales, layer),
        })
    }

    /// Attention of the last `n` positions `layer` holds (`q`: `[n, num_q_heads,
    /// head_dim]`, the queries of the tokens just appended) over the layer, causal: the
    /// token at position `p` sees positions `0..=p`, or only the `window` most recent of
    /// them (the token included). Writes `out` (`q`'s shape, C-contiguous).
    pub fn attention(
        &self,
        layer: i64,
        q: &TensorRef,
        out: &mut TensorMut,
        window: Option<i64>,
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        let l = self.check_layer(layer)?;
        let window = match window {
            Some(w) if w < 1 => {
                return Err(KvError::InvalidArgument {
                    name: "window",
                    value: w.to_string(),
                    reason: "must be >= 1".into(),
                })
            }
            w => w.map(|w| w as usize),
        };
        let end = self.layer_len[l];
        let n = q.shape().first().copied().unwrap_or(0);
        if q.shape().len() == 3 && n > end {
            return Err(KvError::Shape {
                name: "q",
                got: q.shape().to_vec(),
                expected: format!("at most {end} query tokens: layer {l} holds {end} positions"),
            });
        }
        let rows: Vec<QueryRow> = (end.saturating_sub(n)..end)
            .enumerate()
            .map(|(token, pos)| QueryRow {
                token,
                pos,
                lo: window.map_or(0, |w| (pos + 1).saturating_sub(w)),
                hi: pos + 1,
            })
            .collect();
        self.attend_rows(l, q, out, &rows, opts)
    }

    /// Attention of `q`'s tokens as `rows` say, over `layer` (validated).
    pub(crate) fn attend_rows(
        &self,
        layer: usize,
        q: &TensorRef,
        out: &mut TensorMut,
        rows: &[QueryRow],
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        let heads = KvHeads {
            num_kv_heads: self.shape.num_kv_heads,
            head_dim: self.shape.head_dim,
            v_head_dim: self.shape.v_head_dim,
        };
        let seqs = [SeqQueries {
            kv: self.kv_pages(layer)?,
            rows: 0..rows.len(),
        }];
        // SAFETY: kv_pages describes this cache's host storage, borrowed for the call; a
        // row never sees past the layer's length (the callers build them so).
        unsafe { attention::attend(q, out, heads, rows, &seqs, opts) }
    }

    /// Sets the committed length and each layer's length (all at most `max_seq_len`,
    /// the committed one at most every layer's).
    pub fn set_lengths(&mut self, seq_len: usize, layer_len: &[usize]) {
        assert!(
            layer_len.len() == self.shape.num_layers
                && layer_len
                    .iter()
                    .all(|&l| l >= seq_len && l <= self.shape.max_seq_len)
        );
        self.seq_len = seq_len;
        self.layer_len.copy_from_slice(layer_len);
    }

    /// Writes one `head_dim` (`v_head_dim`) vector at `(layer, head, pos)`: the seed's `store_key` /
    /// `store_value`. The layer then holds position `pos` (its fill length becomes at
    /// least `pos + 1`), so the seed's decode step (store every head's K and V at
    /// `seq_len`, then [`CacheCore::advance`]) commits it. Positions a store brings into the
    /// layer are zeroed first (K and V, every head), so whatever was not stored there (a
    /// V without its K, a head left out, a gap before `pos`) reads as zeros, never as
    /// K/V of an earlier, truncated sequence.
    pub fn store(
        &mut self,
        kv: Kv,
        layer: i64,
        head: i64,
        pos: i64,
        vector: &TensorRef,
    ) -> Result<()> {
        let s = self.shape;
        let layer = self.check_layer(layer)?;
        let head = check_index("head", head, s.num_kv_heads)?;
        let pos = check_index("pos", pos, s.max_seq_len)?;
        vector.expect_shape(if kv == Kv::Key { "key" } else { "value" }, &[s.dim(kv)])?;
        // The write comes first: it is the step a bad vector (another device) fails, and
        // then nothing has changed.
        let region = self.heads_at(layer, kv, head..head + 1, pos);
        let scale = &self.scales.heads(layer, kv)[head..head + 1];
        let storage = &mut self.storage;
        with_divided(storage.scaler(), [(vector, scale)], 0, |[v]| {
            storage.write(region, v)
        })?;
        let held = self.layer_len[layer];
        if pos >= held {
            // Zero what the store brings in, all but the vector just written.
            for side in [Kv::Key, Kv::Value] {
                self.storage
                    .fill_zero(self.region(layer, side, held, pos - held))?;
                let (before, after) = if side == kv {
                    (0..head, head + 1..s.num_kv_heads)
                } else {
                    (0..s.num_kv_heads, 0..0)
                };
                for heads in [before, after].into_iter().filter(|h| !h.is_empty()) {
                    self.storage
                        .fill_zero(self.heads_at(layer, side, heads, pos))?;
                }
            }
            self.layer_len[layer] = pos + 1;
        }
        Ok(())
    }

    /// The region `[heads, 1, head_dim]` of one layer's K or V at position `pos`.
    fn heads_at(&self, layer: usize, kv: Kv, heads: Range<usize>, pos: usize) -> Region {
        let s = &self.shape;
        let d = s.dim(kv);
        Region {
            offset: self.offset(layer, kv, heads.start, pos),
            shape: [heads.len(), 1, d],
            strides: [s.max_seq_len * d, d, 1],
        }
    }

    /// Appends `k` and `v` (`[n_tokens, num_kv_heads, head_dim]`) at `layer`'s next free
    /// position and returns that position.
    pub fn append(&mut self, layer: i64, k: &TensorRef, v: &TensorRef) -> Result<usize> {
        let s = self.shape;
        let layer = self.check_layer(layer)?;
        let n = check_tokens("k", k.shape(), s.num_kv_heads, s.head_dim)?;
        check_tokens("v", v.shape(), s.num_kv_heads, s.v_head_dim)?;
        v.expect_shape("v", &[n, s.num_kv_heads, s.v_head_dim])?;
        let start = self.layer_len[layer];
        if start + n > s.max_seq_len {
            return Err(KvError::CacheFull {
                what: format!("appending {n} tokens to layer {layer} at position {start}"),
                needed: n,
                free: s.max_seq_len - start,
                capacity: s.max_seq_len,
                unit: Unit::Positions,
            });
        }
        // `k` is [n, H, D]; the storage region is viewed in the same index order.
        for (kv, src) in [(Kv::Key, k), (Kv::Value, v)] {
            let r = self.region(layer, kv, start, n);
            let transposed = Region {
                offset: r.offset,
                shape: [n, s.num_kv_heads, s.dim(kv)],
                strides: [r.strides[1], r.strides[0], 1],
            };
            let storage = &mut self.storage;
            let scales = self.scales.heads(layer, kv);
            with_divided(storage.scaler(), [(src, scales)], 1, |[src]| {
                storage.write(transposed, src)
            })?;
        }
        self.layer_len[layer] = start + n;
        Ok(start)
    }

    /// Commits `n` tokens (`seq_len += n`); every layer must already hold them.
    pub fn advance(&mut self, n: i64) -> Result<()> {
        self.seq_len = commit_target(self.seq_len, &self.layer_len, n)?;
        Ok(())
    }

    /// Drops positions `>= n` from every layer; a no-op when `n >= seq_len`.
    pub fn truncate(&mut self, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        if n < self.seq_len {
            self.seq_len = n;
            self.layer_len.iter_mut().for_each(|l| *l = (*l).min(n));
        }
        Ok(())
    }

    /// Empties the cache (lengths to 0; the memory stays allocated).
    pub fn clear(&mut self) {
        self.seq_len = 0;
        self.layer_len.fill(0);
    }

    /// Sets the committed length and every layer's fill length to `min(n, max_seq_len)`:
    /// the seed's way to take in positions written with [`CacheCore::inject_block`] (which
    /// moves no length). A contiguous cache has one holder, so what it shows there is
    /// what that holder last wrote.
    pub fn set_seq_len(&mut self, n: i64) -> Result<()> {
        let n = check_count("n", n)?.min(self.shape.max_seq_len);
        self.seq_len = n;
        self.layer_len.fill(n);
        Ok(())
    }

    /// Copies `[num_kv_heads, block_size, head_dim]` keys and values starting at
    /// `start_pos` into `keys`/`values` (host tensors of the storage dtype); positions at
    /// or past `max_seq_len` come back as zeros.
    pub fn extract_block(
        &self,
        layer: i64,
        start_pos: i64,
        block_size: i64,
        keys: &mut TensorMut,
        values: &mut TensorMut,
    ) -> Result<()> {
        let (layer, start, bs, inside) = self.check_block(layer, start_pos, block_size)?;
        let s = self.shape;
        expect_block_pair(
            keys.shape(),
            values.shape(),
            [
                [s.num_kv_heads, bs, s.head_dim],
                [s.num_kv_heads, bs, s.v_head_dim],
            ],
        )?;
        check_disjoint(("keys", keys), ("values", values))?;
        for (kv, mut out) in [(Kv::Key, keys.reborrow()), (Kv::Value, values.reborrow())] {
            let mut out_in = out.slice(1, 0, inside);
            self.storage
                .read(self.region(layer, kv, start, inside), &mut out_in)?;
            multiply_heads(
                self.storage.scaler(),
                &mut out_in,
                0,
                self.scales.heads(layer, kv),
            )?;
            // Positions past max_seq_len read as zeros.
            self.storage.zero(&mut out.slice(1, inside, bs - inside))?;
        }
        Ok(())
    }

    /// Writes `[num_kv_heads, block_size, head_dim]` keys and values at `start_pos`,
    /// skipping positions past `max_seq_len`. Fill lengths do not move.
    pub fn inject_block(
        &mut self,
        layer: i64,
        start_pos: i64,
        block_size: i64,
        keys: &TensorRef,
        values: &TensorRef,
    ) -> Result<()> {
        let (layer, start, bs, inside) = self.check_block(layer, start_pos, block_size)?;
        let s = self.shape;
        expect_block_pair(
            keys.shape(),
            values.shape(),
            [
                [s.num_kv_heads, bs, s.head_dim],
                [s.num_kv_heads, bs, s.v_head_dim],
            ],
        )?;
        for (kv, src) in [(Kv::Key, keys), (Kv::Value, values)] {
            let region = self.region(layer, kv, start, inside);
            let storage = &mut self.storage;
            let scales = self.scales.heads(layer, kv);
            with_divided(
                storage.scaler(),
                [(&src.slice(1, 0, inside), scales)],
                0,
                |[src]| storage.write(region, src),
            )?;
        }
        Ok(())
    }

    /// The CUDA storage, or why there is none.
    fn cuda(&self, what: &str) -> Result<&crate::storage::cuda::CudaStorage> {
        self.storage.as_cuda().ok_or_else(|| {
            KvError::NotSupported(format!(
                "{what} needs a cache on a CUDA device; this one is on {}",
                self.device()
            ))
        })
    }

    /// The address of the device-resident position counter (CUDA caches), set to
    /// `seq_len` now: call it before capturing a decode loop in a CUDA graph.
    pub fn gpu_counter_ptr(&self) -> Result<u64> {
        let c = self.cuda("gpu_counter_ptr")?;
        c.write_counter(self.seq_len as i64)?;
        c.counter()
    }

    /// Appends `k`, `v` (`[n, H, D]`, on the cache's device) to `layer` at the position
    /// the device counter holds, with no host bookkeeping: the step of a captured decode
    /// loop. Lengths on the host move at [`CacheCore::sync_counter_from_gpu`].
    pub fn append_at_counter(&self, layer: i64, k: &TensorRef, v: &TensorRef) -> Result<()> {
        let s = self.shape;
        let layer = self.check_layer(layer)?;
        let n = check_tokens("k", k.shape(), s.num_kv_heads, s.head_dim)?;
        check_tokens("v", v.shape(), s.num_kv_heads, s.v_head_dim)?;
        v.expect_shape("v", &[n, s.num_kv_heads, s.v_head_dim])?;
        let c = self.cuda("append_at_counter")?;
        crate::storage::check_kernel_dims(
            "append_at_counter",
            self.device(),
            [s.head_dim, s.v_head_dim],
        )?;
        if !self.scales.is_unit() {
            // A captured step takes plain values only; dividing by the scales would
            // upload them from the host on every replay.
            return Err(KvError::NotSupported(
                "append_at_counter on an fp8 cache with k_scale/v_scale other than 1.0; \
                 use append (or scales of 1.0) for a captured decode loop"
                    .into(),
            ));
        }
        c.append_at_counter(self.offset(layer, Kv::Key, 0, 0), s.max_seq_len, k, v)
    }

    /// Sends this cache's later launches to `stream` (a CUDA stream handle; `None`: kvrs's
    /// own stream), e.g. the stream a CUDA graph is being captured on.
    pub fn set_stream(&self, stream: Option<u64>) -> Result<()> {
        self.cuda("set_stream")?.set_stream(stream)
    }

    /// Launches `counter += n` on the device: the end of a captured decode step.
    pub fn advance_counter(&self, n: i64) -> Result<()> {
        if n < 0 {
            return Err(KvError::InvalidArgument {
                name: "n",
                value: n.to_string(),
                reason: "must be >= 0".into(),
            });
        }
        self.cuda("advance_counter")?.advance_counter(n)
    }

    /// Waits for the device, reads the counter and makes it the committed length of
    /// every layer. A counter past `max_seq_len` (appends the kernel dropped) is a
    /// `CacheFull` error and leaves the host lengths as they were.
    pub fn sync_counter_from_gpu(&mut self) -> Result<usize> {
        let value = self.cuda("sync_counter_from_gpu")?.read_counter()?;
        let max = self.shape.max_seq_len;
        if value < 0 {
            return Err(KvError::Device(format!(
                "the device counter holds {value}, not a position: a kernel wrote it out of turn"
            )));
        }
        if value as usize > max {
            return Err(KvError::CacheFull {
                what: format!("the device counter reached {value}"),
                needed: value as usize - self.seq_len,
                free: max - self.seq_len,
                capacity: max,
                unit: Unit::Positions,
            });
        }
        let n = value as usize;
        self.seq_len = n;
        self.layer_len.iter_mut().for_each(|l| *l = n);
        Ok(n)
    }

    /// Validates a block request; returns (layer, start, block_size, positions inside the cache).
    /// Checks `extract_block`/`inject_block` arguments without touching any tensor, so
    /// callers can refuse bad ones before allocating outputs.
    pub fn check_block_args(&self, layer: i64, start_pos: i64, block_size: i64) -> Result<()> {
        self.check_block(layer, start_pos, block_size).map(|_| ())
    }

    fn check_block(
        &self,
        layer: i64,
        start_pos: i64,
        block_size: i64,
    ) -> Result<(usize, usize, usize, usize)> {
        let layer = self.check_layer(layer)?;
        let start = check_index("start_pos", start_pos, self.shape.max_seq_len)?;
        let bs = check_count("block_size", block_size)?;
        if bs == 0 || bs > self.shape.max_seq_len {
            return Err(KvError::InvalidArgument {
                name: "block_size",
                value: bs.to_string(),
                reason: format!("must be in 1..={} (max_seq_len)", self.shape.max_seq_len),
            });
        }
        let inside = bs.min(self.shape.max_seq_len - start);
        Ok((layer, start, bs, inside))
    }
}
