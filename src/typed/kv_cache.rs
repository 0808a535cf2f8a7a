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
/// The seed's methods keep the seed's signatures and, like the seed's, panic on bad
/// arguments (each says when under `# Panics`); each has a `try_` twin
/// ([`KvCache::try_store_key`], [`KvCache::try_extract_block`], ...) that returns the
/// error instead and leaves the cache as it was. [`KvCache::new`] makes the seed's `f32`
/// cache; [`KvCache::zeros`] makes one of any [`Element`] (`half::f16`, `half::bf16`).
///
/// The seed's own usage, unchanged:
///
/// ```
/// use kvrs::KvCache;
///
/// let (num_layers, num_kv_heads, head_dim, max_seq_len) = (2, 4, 8, 128);
/// let mut cache = KvCache::new(num_layers, num_kv_heads, head_dim, max_seq_len);
/// for _step in 0..3 {
///     let pos = cache.seq_len();
///     for layer in 0..num_layers {
///         for head in 0..num_kv_heads {
///             let k = vec![(layer + head + pos) as f32; head_dim];
///             let v = vec![-((layer + head + pos) as f32); head_dim];
///             cache.store_key(layer, head, pos, &k);
///             cache.store_value(layer, head, pos, &v);
///         }
///     }
///     cache.advance();
/// }
/// assert_eq!(cache.seq_len(), 3);
/// assert_eq!(cache.keys_for(1, 2, 3)[2 * head_dim], 5.0); // layer 1 + head 2 + position 2
/// assert_eq!(cache.values_for(1, 2, 3)[2 * head_dim], -5.0);
///
/// // Blocks out of one cache and into another, then committed with set_seq_len.
/// let mut other = KvCache::new(num_layers, num_kv_heads, head_dim, max_seq_len);
/// for layer in 0..num_layers {
///     let (keys, values) = cache.extract_block(layer, 0, 3); // [num_kv_heads, 3, head_dim]
///     other.inject_block(layer, 0, 3, &keys, &values);
/// }
/// other.set_seq_len(3);
/// assert_eq!(other.keys_for(1, 2, 3), cache.keys_for(1, 2, 3));
/// assert_eq!(other.values_for(0, 3, 3), cache.values_for(0, 3, 3));
///
/// // 2 (K and V) x layers x heads x positions x head_dim x 4 bytes.
/// assert_eq!(cache.memory_bytes(), 2 * 2 * 4 * 128 * 8 * 4);
/// assert_eq!(other.utilization_ratio(), 3.0 / 128.0);
/// ```
#[derive(Debug)]
pub struct KvCache<T: Element = f32> {
    core: CacheCore,
    elem: PhantomData<T>,
}

/// `r`'s value, or a panic with the error prefixed by `KvCache::{method}`, reported at
/// the caller's call site.
#[track_caller]
fn or_panic<R>(method: &str, r: Result<R>) -> R {
    match r {
        Ok(x) => x,
        Err(e) => panic!("KvCache::{method}: {e}"),
    }
}

/// The seed's `f32` cache. Its constructors live here, not in the generic impl, so that
/// `KvCache::new(..)` names `KvCache<f32>` with no annotation (a default type parameter
/// does not drive inference); [`KvCache::zeros`] makes a cache of any element type.
impl KvCache<f32> {
    /// Allocates K and V for `num_layers` layers of `num_kv_heads` heads of `head_dim`
    /// `f32` elements, `max_seq_len` positions each, zero-filled; nothing is allocated
    /// after. `KvCache::new(..)` is a `KvCache<f32>` without annotations:
    ///
    /// ```
    /// use kvrs::KvCache;
    ///
    /// let c = KvCache::new(1, 1, 4, 8); // f32, inferred from `new` alone
    /// assert_eq!(c.memory_bytes(), 2 * 1 * 1 * 8 * 4 * 4);
    /// ```
    ///
    /// # Panics
    /// If a size is zero or the cache exceeds the address space or the host's memory
    /// ([`KvCache::try_new`] returns those as errors).
    #[track_caller]
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_seq_len: usize,
    ) -> Self {
        or_panic(
            "new",
            Self::try_new(num_layers, num_kv_heads, head_dim, max_seq_len),
        )
    }

    /// [`KvCache::new`], with invalid sizes and failed allocations as errors.
    pub fn try_new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_seq_len: usize,
    ) -> Result<Self> {
        Self::try_zeros(num_layers, num_kv_heads, head_dim, max_seq_len)
    }
}

impl<T: Element> KvCache<T> {
    /// Allocates K and V for `num_layers` layers of `num_kv_heads` heads of `head_dim`
    /// elements of `T`, `max_seq_len` positions each, zero-filled; nothing is allocated
    /// after: `KvCache::<half::f16>::zeros(..)`. For `f32`, the same as [`KvCache::new`].
    ///
    /// # Panics
    /// If a size is zero or the cache exceeds the address space or the host's memory
    /// ([`KvCache::try_zeros`] returns those as errors).
    #[track_caller]
    pub fn zeros(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_seq_len: usize,
    ) -> Self {
        or_panic(
            "zeros",
            Self::try_zeros(num_layers, num_kv_heads, head_dim, max_seq_len),
        )
    }

    /// [`KvCache::zeros`], with invalid sizes and failed allocations as errors.
    pub fn try_zeros(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        max_seq_len: usize,
    ) -> Result<Self> {
        let shape = CacheShape::uniform(num_layers, num_kv_heads, head_dim, max_seq_len);
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
    ///
    /// # Panics
    /// If `key.len() != head_dim`, `layer >= num_layers`, `head >= num_kv_heads` or
    /// `pos >= max_seq_len` ([`KvCache::try_store_key`] returns those as errors).
    #[track_caller]
    pub fn store_key(&mut self, layer: usize, head: usize, pos: usize, key: &[T]) {
        or_panic("store_key", self.try_store_key(layer, head, pos, key))
    }

    /// [`KvCache::store_key`], with bad arguments as errors ([`crate::KvError::Shape`]
    /// for the length, `OutOfRange` for `layer`, `head` and `pos`); an
    /// error leaves the cache as it was.
    pub fn try_store_key(
        &mut self,
        layer: usize,
        head: usize,
        pos: usize,
        key: &[T],
    ) -> Result<()> {
        self.store(Kv::Key, layer, head, pos, key)
    }

    /// Writes one value vector at `(layer, head, pos)`, as [`KvCache::store_key`].
    ///
    /// # Panics
    /// If `value.len() != head_dim`, `layer >= num_layers`, `head >= num_kv_heads` or
    /// `pos >= max_seq_len` ([`KvCache::try_store_value`] returns those as errors).
    #[track_caller]
    pub fn store_value(&mut self, layer: usize, head: usize, pos: usize, value: &[T]) {
        or_panic("store_value", self.try_store_value(layer, head, pos, value))
    }

    /// [`KvCache::store_value`], with bad arguments as errors, as
    /// [`KvCache::try_store_key`].
    pub fn try_store_value(
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

    /// Commits one position: `seq_len += 1`.
    ///
    /// # Panics
    /// Unless every layer holds position `seq_len` (`layer_len(layer) > seq_len` for
    /// every layer: store or append it in every layer first); so also when `seq_len ==
    /// max_seq_len`. The message names the first layer that does not
    /// ([`KvCache::try_advance`] returns that as an error).
    #[track_caller]
    pub fn advance(&mut self) {
        or_panic("advance", self.try_advance())
    }

    /// [`KvCache::advance`], with a layer that does not hold the position as an error
    /// ([`crate::KvError::InvalidArgument`]); an error leaves the cache as it was.
    pub fn try_advance(&mut self) -> Result<()> {
        self.advance_by(1)
    }

    /// Commits `n` positions, as [`KvCache::try_advance`].
    pub fn advance_by(&mut self, n: usize) -> Result<()> {
        self.core.advance(index(n))
    }

    /// Sets `seq_len` and every layer's fill length to `min(n, max_seq_len)`: the seed's
    /// way to commit positions written with [`KvCache::inject_block`] (which moves no
    /// length), or to cut the cache back. Positions it brings in read as whatever was
    /// last written there (zeros if nothing was).
    ///
    /// # Panics
    /// Never: an `n` past `max_seq_len` is clamped to it, as `kvrs.KVCache.set_seq_len`
    /// does in Python.
    #[track_caller]
    pub fn set_seq_len(&mut self, n: usize) {
        or_panic("set_seq_len", self.try_set_seq_len(n))
    }

    /// [`KvCache::set_seq_len`] as a `Result`, the twin of the other `try_` methods; no
    /// `usize` is refused, so it returns `Ok(())`.
    pub fn try_set_seq_len(&mut self, n: usize) -> Result<()> {
        self.core.set_seq_len(index(n))
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
    ///
    /// # Panics
    /// If `layer >= num_layers`, `start_pos >= max_seq_len`, `block_size == 0` or
    /// `block_size > max_seq_len` ([`KvCache::try_extract_block`] returns those as
    /// errors).
    #[track_caller]
    pub fn extract_block(
        &self,
        layer: usize,
        start_pos: usize,
        block_size: usize,
    ) -> (Vec<T>, Vec<T>) {
        or_panic(
            "extract_block",
            self.try_extract_block(layer, start_pos, block_size),
        )
    }

    /// [`KvCache::extract_block`], with bad arguments as errors (`OutOfRange` for
    /// `layer` and `start_pos`, `InvalidArgument` for `block_size`), refused before
    /// anything is allocated.
    pub fn try_extract_block(
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
    /// `start_pos`, skipping positions past `max_seq_len`; lengths do not move (commit
    /// with [`KvCache::set_seq_len`]).
    ///
    /// # Panics
    /// If `layer >= num_layers`, `start_pos >= max_seq_len`, `block_size == 0`,
    /// `block_size > max_seq_len`, or `keys.len()` or `values.len()` is not
    /// `num_kv_heads * block_size * head_dim` ([`KvCache::try_inject_block`] returns
    /// those as errors).
    #[track_caller]
    pub fn inject_block(
        &mut self,
        layer: usize,
        start_pos: usize,
        block_size: usize,
        keys: &[T],
        values: &[T],
    ) {
        or_panic(
            "inject_block",
            self.try_inject_block(layer, start_pos, block_size, keys, values),
        )
    }

    /// [`KvCache::inject_block`], with bad arguments as errors (as
    /// [`KvCache::try_extract_block`], and [`crate::KvError::Shape`] for a slice of
    /// the wrong length); an error leaves the cache as it was.
    pub fn try_inject_block(
        &mut self,
        layer: usize,
        start_pos: usize,
        block_size: usize,
        keys: &[T],
        values: &[T],
    ) -> Result<()> {
        // The block's arguments first: a valid block_size keeps the length check's
        // product within the cache's size.
        self.core
            .check_block_args(index(layer), index(start_pos), index(block_size))?;
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
        let d = self.head_dim();
        let (qt, mut ot) = query_tensors(q, out, num_q_heads, [d, d])?;
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
    /// Unstable: the core is internal (`kvrs::unstable`), with no stability promise.
    #[doc(hidden)]
    pub fn core(&self) -> &CacheCore {
        &self.core
    }
}
