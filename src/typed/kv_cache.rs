//! [`KvCache`]: the seed's contiguous cache, typed, over slices.

use std::marker::PhantomData;

use super::element::{index, query_tensors, tensor, tensor_mut, token_count, Element};
use crate::attention::AttnOptions;
use crate::error::Result;
use crate::kv_cache::{CacheCore, CacheShape, Kv};
use crate::layout::Device;

/// One sequence's keys and values for every layer, preallocated for `max_seq_len`
/// positions of `T` on the host: the seed's `KvCache`.
///
/// Per layer, K and V are head-major, `[num_kv_heads, max_seq_len, head_dim]`, so one
/// head's history is one contiguous slice ([`KvCache::keys_for`]). Each layer has its own
/// fill length ([`KvCache::layer_len`], moved by `append` and `store_*`); `seq_len` is
/// the committed length, moved by [`KvCache::advance`], never above any layer's.
///
/// ```
/// use kvrs::KvCache;
///
/// let (layers, heads, dim) = (2, 4, 8);
/// let mut cache = KvCache::<f32>::new(layers, heads, dim, 128);
/// for _step in 0..3 {
///     let pos = cache.seq_len();
///     for layer in 0..layers {
///         for head in 0..heads {
///             let k = vec![(layer + head + pos) as f32; dim];
///             cache.store_key(layer, head, pos, &k)?;
///             cache.store_value(layer, head, pos, &k)?;
///         }
///     }
///     cache.advance()?;
/// }
/// assert_eq!(cache.seq_len(), 3);
/// assert_eq!(cache.keys_for(1, 2, 3)[2 * dim], 5.0); // layer 1 + head 2 + position 2
/// # Ok::<(), kvrs::KvError>(())
/// ```
#[derive(Debug)]
pub struct KvCache<T: Element = f32> {
    core: CacheCore,
    elem: PhantomData<T>,
}

impl<T: Element> KvCache<T> {
    /// Allocates K and V for `num_layers` layers of `num_kv_heads` heads of `head_dim`
    /// elements, `max_seq_len` positions each, zero-filled; nothing is allocated after.
    ///
    /// # Panics
    /// If a size is zero or the cache exceeds the address space or the host's memory
    /// ([`KvCache::try_new`] returns those as errors).
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_seq_len: usize,
    ) -> Self {
        Self::try_new(num_layers, num_kv_heads, head_dim, max_seq_len)
            .unwrap_or_else(|e| panic!("KvCache::new: {e}"))
    }

    /// [`KvCache::new`], with invalid sizes and failed allocations as errors.
    pub fn try_new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_seq_len: usize,
    ) -> Result<Self> {
        let shape = CacheShape {
            num_layers,
            num_kv_heads,
            head_dim,
            max_seq_len,
        };
        Ok(KvCache {
            core: CacheCore::new(shape, T::DTYPE, Device::Cpu)?,
            elem: PhantomData,
        })
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.core.shape().num_layers
    }

    /// Key/value heads per layer.
    pub fn num_kv_heads(&self) -> usize {
        self.core.shape().num_kv_heads
    }

    /// Elements per head vector.
    pub fn head_dim(&self) -> usize {
        self.core.shape().head_dim
    }

    /// Positions the cache holds.
    pub fn max_seq_len(&self) -> usize {
        self.core.shape().max_seq_len
    }

    /// Committed positions.
    pub fn seq_len(&self) -> usize {
        self.core.seq_len()
    }

    /// Positions `layer` holds (committed and appended or stored).
    ///
    /// # Panics
    /// If `layer >= num_layers`.
    pub fn layer_len(&self, layer: usize) -> usize {
        self.core.layer_len(layer)
    }

    /// Writes one key vector (`head_dim` elements) at `(layer, head, pos)`, any `pos <
    /// max_seq_len`. The layer then holds `pos`; positions the store brings into the
    /// layer start as zeros (K and V, every head), so what is never stored reads as zero.
    pub fn store_key(&mut self, layer: usize, head: usize, pos: usize, key: &[T]) -> Result<()> {
        self.store(Kv::Key, layer, head, pos, key)
    }

    /// Writes one value vector at `(layer, head, pos)`, as [`KvCache::store_key`].
    pub fn store_value(
        &mut self,
        layer: usize,
        head: usize,
        pos: usize,
        value: &[T],
    ) -> Result<()> {
        self.store(Kv::Value, layer, head, pos, value)
    }

    fn store(&mut self, kv: Kv, layer: usize, head: usize, pos: usize, x: &[T]) -> Result<()> {
        let name = if kv == Kv::Key { "key" } else { "value" };
        let t = tensor(name, x, &[self.head_dim()])?;
        self.core
            .store(kv, index(layer), index(head), index(pos), &t)
    }

    /// Writes `n` tokens' keys and values (`[n, num_kv_heads, head_dim]`, C order) at
    /// `layer`'s next free position and returns that position.
    /// [`crate::KvError::CacheFull`] if they would pass `max_seq_len`.
    pub fn append(&mut self, layer: usize, k: &[T], v: &[T]) -> Result<usize> {
        let (h, d) = (self.num_kv_heads(), self.head_dim());
        let n = token_count("k", k.len(), h, d)?;
        let kt = tensor("k", k, &[n, h, d])?;
        let vt = tensor("v", v, &[n, h, d])?;
        self.core.append(index(layer), &kt, &vt)
    }

    /// Commits one position: `seq_len += 1`. Fails (naming the layer) unless every
    /// layer holds it.
    pub fn advance(&mut self) -> Result<()> {
        self.advance_by(1)
    }

    /// Commits `n` positions, as [`KvCache::advance`].
    pub fn advance_by(&mut self, n: usize) -> Result<()> {
        self.core.advance(index(n))
    }

    /// The keys of `head` in `layer` at positions `0..seq_len`: `seq_len * head_dim`
    /// elements, borrowed from the cache (no copy). Any `seq_len <= max_seq_len`.
    ///
    /// # Panics
    /// If `layer`, `head` or `seq_len` is out of range.
    pub fn keys_for(&self, layer: usize, head: usize, seq_len: usize) -> &[T] {
        self.head_slice(Kv::Key, layer, head, seq_len)
    }

    /// The values of `head` in `layer` at positions `0..seq_len`, as [`KvCache::keys_for`].
    ///
    /// # Panics
    /// If `layer`, `head` or `seq_len` is out of range.
    pub fn values_for(&self, layer: usize, head: usize, seq_len: usize) -> &[T] {
        self.head_slice(Kv::Value, layer, head, seq_len)
    }

    fn head_slice(&self, kv: Kv, layer: usize, head: usize, seq_len: usize) -> &[T] {
        let s = self.core.shape();
        assert!(
            layer < s.num_layers,
            "layer={layer} is out of range: must be in [0, {})",
            s.num_layers
        );
        assert!(
            head < s.num_kv_heads,
            "head={head} is out of range: must be in [0, {})",
            s.num_kv_heads
        );
        assert!(
            seq_len <= s.max_seq_len,
            "seq_len={seq_len} is out of range: must be in [0, {}]",
            s.max_seq_len
        );
        let offset = self.core.offset(layer, kv, head, 0);
        // SAFETY: the host storage holds `T` elements (the cache's dtype is `T::DTYPE`),
        // 64-byte aligned; the head's positions `0..max_seq_len` are contiguous and inside
        // it; `&self` keeps every write away for the borrow's life.
        unsafe {
            let base = self.core.data_ptr() as *const T;
            std::slice::from_raw_parts(base.add(offset), seq_len * s.head_dim)
        }
    }

    /// Copies `[num_kv_heads, block_size, head_dim]` keys and values of `layer` from
    /// `start_pos` (lengths ignored); positions past `max_seq_len` come back as zeros.
    pub fn extract_block(
        &self,
        layer: usize,
        start_pos: usize,
        block_size: usize,
    ) -> Result<(Vec<T>, Vec<T>)> {
        self.core
            .check_block_args(index(layer), index(start_pos), index(block_size))?;
        let shape = [self.num_kv_heads(), block_size, self.head_dim()];
        let mut keys = vec![T::default(); shape.iter().product()];
        let mut values = keys.clone();
        let mut kt = tensor_mut("keys", &mut keys, &shape)?;
        let mut vt = tensor_mut("values", &mut values, &shape)?;
        self.core.extract_block(
            index(layer),
            index(start_pos),
            index(block_size),
            &mut kt,
            &mut vt,
        )?;
        Ok((keys, values))
    }

    /// Writes `[num_kv_heads, block_size, head_dim]` keys and values into `layer` at
    /// `start_pos`, skipping positions past `max_seq_len`; lengths do not move.
    pub fn inject_block(
        &mut self,
        layer: usize,
        start_pos: usize,
        block_size: usize,
        keys: &[T],
        values: &[T],
    ) -> Result<()> {
        let shape = [self.num_kv_heads(), block_size, self.head_dim()];
        let kt = tensor("keys", keys, &shape)?;
        let vt = tensor("values", values, &shape)?;
        self.core
            .inject_block(index(layer), index(start_pos), index(block_size), &kt, &vt)
    }

    /// Causal attention of the last `n` positions `layer` holds: `q` is `[n,
    /// num_q_heads, head_dim]` (the queries of the tokens just appended; `num_q_heads` a
    /// multiple of `num_kv_heads`), `out` the same shape. Scale `1 / sqrt(head_dim)`,
    /// computed in `f32` with an online softmax.
    pub fn attention<Q: Element>(
        &self,
        layer: usize,
        num_q_heads: usize,
        q: &[Q],
        out: &mut [Q],
    ) -> Result<()> {
        self.attention_with(layer, num_q_heads, q, out, None, &AttnOptions::default())
    }

    /// [`KvCache::attention`] seeing only the `window` most recent positions (the token
    /// included) when given, with the model-specific parts in `opts`.
    pub fn attention_with<Q: Element>(
        &self,
        layer: usize,
        num_q_heads: usize,
        q: &[Q],
        out: &mut [Q],
        window: Option<usize>,
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        let (qt, mut ot) = query_tensors(q, out, num_q_heads, self.head_dim())?;
        self.core
            .attention(index(layer), &qt, &mut ot, window.map(index), opts)
    }

    /// Drops positions `>= n` from `seq_len` and every layer (rollback); a no-op when
    /// `n >= seq_len`.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        self.core.truncate(index(n))
    }

    /// Empties the cache (lengths to 0); memory stays allocated.
    pub fn clear(&mut self) {
        self.core.clear()
    }

    /// Bytes the cache holds: `2 * num_layers * num_kv_heads * max_seq_len * head_dim *
    /// size_of::<T>()`.
    pub fn memory_bytes(&self) -> usize {
        self.core.memory_bytes()
    }

    /// `seq_len / max_seq_len`, in [0, 1].
    pub fn utilization_ratio(&self) -> f64 {
        self.core.utilization_ratio()
    }

    /// The dtype-erased core this cache wraps (raw strided tensors, as the bindings use).
    pub fn core(&self) -> &CacheCore {
        &self.core
    }
}
