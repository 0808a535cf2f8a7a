//! [`BlockPool`]: the paged pool for Rust programs, typed, over slices.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use super::element::{index, query_tensors, tensor, tensor_mut, token_count, Element};
use crate::attention::AttnOptions;
use crate::dtype::DType;
use crate::error::{check_index, Result};
use crate::layout::{Device, KvLayout, PagedShape};
pub use crate::paged::tiering::TierOptions;
use crate::paged::{Attention, PoolCore, PoolStats, PrefixConfig, SeqId};
use crate::prefix::HashKind;
use crate::scales::KvScales;
use crate::tier::Tier;

/// The shape and options of a [`BlockPool`]: sizes by [`PoolConfig::new`], the rest by
/// the builder methods.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    /// Sizes and in-block layout.
    pub shape: PagedShape,
    /// Kind of every layer (full, sliding window, chunked); `None`: all full attention.
    pub attention: Option<Attention>,
    /// Prefix caching, when on.
    pub prefix: Option<PrefixConfig>,
    /// What the blocks store; `None`: `T` itself. An 8-bit dtype quantizes the `T`
    /// slices written and dequantizes reads back into `T`.
    pub storage: Option<DType>,
    /// fp8 scales (`None`: 1.0 everywhere).
    pub scales: Option<KvScales>,
    /// Offload tiers below the prefix cache.
    pub tiers: Option<TierConfig>,
}

/// Offload tiers of a [`PoolConfig`]: evicted cached blocks are written to them and
/// prompts that miss in the pool are looked up there.
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// The tiers, fastest first.
    pub tiers: Vec<Arc<dyn Tier>>,
    /// Joins the configuration fingerprint: pools of other models never read the blocks.
    pub model_id: String,
    /// The shared secret, the write-back queue's bounds and the write policy.
    pub options: TierOptions,
}

impl PartialEq for TierConfig {
    /// The same tier objects (by identity) and the same options.
    fn eq(&self, other: &Self) -> bool {
        self.tiers.len() == other.tiers.len()
            && self
                .tiers
                .iter()
                .zip(&other.tiers)
                .all(|(a, b)| Arc::ptr_eq(a, b))
            && (&self.model_id, &self.options) == (&other.model_id, &other.options)
    }
}

impl PoolConfig {
    /// A pool of `num_blocks` blocks of `block_size` positions for every layer, NHD
    /// layout (`[num_blocks, 2, block_size, num_kv_heads, head_dim]` per layer), full
    /// attention, no prefix caching.
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Self {
        PoolConfig {
            shape: PagedShape {
                num_layers,
                num_kv_heads,
                head_dim,
                v_head_dim: head_dim,
                block_size,
                num_blocks,
                layout: KvLayout::Nhd,
            },
            attention: None,
            prefix: None,
            storage: None,
            scales: None,
            tiers: None,
        }
    }

    /// Sets the values' head size (default `head_dim`): MLA latent pools keep a
    /// `kv_lora_rank` latent as the key and `qk_rope_head_dim` rotary values as the
    /// value, other models value heads of another size than their key heads.
    pub fn v_head_dim(mut self, v_head_dim: usize) -> Self {
        self.shape.v_head_dim = v_head_dim;
        self
    }

    /// Sets the order within a block (NHD, or HND: `[num_blocks, 2, num_kv_heads,
    /// block_size, head_dim]`).
    pub fn layout(mut self, layout: KvLayout) -> Self {
        self.shape.layout = layout;
        self
    }

    /// Sets each layer's kind (sliding-window and chunked layers keep only what their
    /// window sees).
    pub fn attention(mut self, attention: Attention) -> Self {
        self.attention = Some(attention);
        self
    }

    /// Stores the blocks in `dtype` instead of the element type: `DType::F8E4M3`,
    /// `DType::F8E5M2` (with [`PoolConfig::scales`]) or `DType::I8` hold twice the tokens
    /// of 16-bit blocks in the same memory.
    pub fn storage(mut self, dtype: DType) -> Self {
        self.storage = Some(dtype);
        self
    }

    /// Sets an fp8 pool's scales (per layer, for K and for V, optionally per KV head).
    pub fn scales(mut self, scales: KvScales) -> Self {
        self.scales = Some(scales);
        self
    }

    /// Puts offload `tiers` (fastest first) below the prefix cache, which must be on:
    /// evicted blocks go to the first tier that takes them, through a queue of 1024
    /// payloads and 256 MiB, MACed under a public key (see [`PoolConfig::tier_options`]).
    /// `model_id` keeps other models' blocks apart.
    pub fn tiers(mut self, tiers: Vec<Arc<dyn Tier>>, model_id: &str) -> Self {
        self.tiers = Some(TierConfig {
            tiers,
            model_id: model_id.to_string(),
            options: TierOptions::default(),
        });
        self
    }

    /// Sets how the pool uses the tiers [`PoolConfig::tiers`] gave: the secret its
    /// payloads are MACed with (shared by every process that shares the tiers), the
    /// write-back queue's bounds and the write policy.
    pub fn tier_options(mut self, options: TierOptions) -> Self {
        if let Some(t) = self.tiers.as_mut() {
            t.options = options;
        }
        self
    }

    /// Turns prefix caching on: BLAKE3 chains rooted at `seed` (pools that should find
    /// each other's blocks share it), partial-block hits, no event log.
    pub fn prefix_caching(mut self, seed: u128) -> Self {
        self.prefix = Some(PrefixConfig {
            hash: HashKind::Blake3,
            seed,
            partial_hits: true,
            events: false,
        });
        self
    }
}

/// Blocks of `T` on the host shared by many sequences, each named by a [`SeqId`]: the
/// pool vLLM, SGLang and llama.cpp keep inside their engines.
///
/// A sequence holds a block table per layer group; forks share blocks (copy-on-write on
/// the first write to a shared block); with prefix caching on, committed whole blocks
/// are indexed by the hash of their token prefix and found again by later sequences.
///
/// A [`SeqId`] is a handle, not an index: it names the pool that made it as well as the
/// sequence, so every method refuses a handle of another pool or of a freed sequence
/// with [`crate::KvError::InvalidArgument`] instead of touching another sequence.
///
/// ```
/// use kvrs::{BlockPool, PoolConfig};
///
/// let (layers, heads, dim) = (2, 2, 4);
/// let config = PoolConfig::new(layers, heads, dim, 16, 64).prefix_caching(7);
/// let mut pool = BlockPool::<f32>::new(config)?;
///
/// let prompt: Vec<u32> = (0..40).collect();
/// let first = pool.new_sequence_with_prompt(&prompt);
/// let kv = vec![0.5f32; prompt.len() * heads * dim]; // [40, heads, dim]
/// for layer in 0..layers {
///     pool.append(first, layer, &kv, &kv)?;
/// }
/// pool.advance_tokens(first, &prompt)?;
///
/// // A second request with the same prompt finds its two whole blocks cached.
/// let second = pool.new_sequence_with_prompt(&prompt);
/// assert_eq!(pool.num_cached_tokens(second)?, 32);
/// assert_eq!(pool.seq_len(second)?, 32);
/// # Ok::<(), kvrs::KvError>(())
/// ```
#[derive(Debug)]
pub struct BlockPool<T: Element = f32> {
    core: PoolCore,
    elem: PhantomData<T>,
}

impl<T: Element> BlockPool<T> {
    /// Allocates the whole pool, zero-filled. Fails on a zero size, a pool past the
    /// address space or the host's memory, or an invalid attention layout.
    pub fn new(config: PoolConfig) -> Result<Self> {
        let attention = config
            .attention
            .unwrap_or_else(|| Attention::full(config.shape.num_layers));
        let sh = config.shape;
        let core = PoolCore::with_attention(
            sh,
            attention,
            config.storage.unwrap_or(T::DTYPE),
            Device::Cpu,
            config.prefix,
        )?;
        let mut core = match config.scales {
            Some(scales) => core.with_scales(scales)?,
            None => core,
        };
        if let Some(t) = config.tiers {
            core = core.with_tiers(t.tiers, &t.model_id, &t.options)?;
        }
        Ok(BlockPool {
            core,
            elem: PhantomData,
        })
    }

    /// Sizes and layout.
    pub fn shape(&self) -> PagedShape {
        self.core.shape()
    }

    /// Blocks no sequence holds (free, or cached and evictable).
    pub fn free_blocks(&self) -> usize {
        self.core.num_free_blocks()
    }

    /// Bytes of one block id: a block of every layer of a group, K and V.
    pub fn bytes_per_block(&self) -> usize {
        self.core.bytes_per_block()
    }

    /// Occupancy: blocks, bytes, exact token counts, prefix-cache counters.
    pub fn stats(&self) -> PoolStats {
        self.core.stats()
    }

    /// Starts an empty sequence that tracks no tokens.
    pub fn new_sequence(&mut self) -> SeqId {
        self.core.new_sequence()
    }

    /// Starts a sequence whose tokens begin with `prompt`. With prefix caching on, the
    /// longest cached prefix is attached (whole blocks shared, a partial block copied)
    /// and committed: [`BlockPool::seq_len`] and [`BlockPool::num_cached_tokens`] say
    /// how many positions; at least one prompt token is always left to compute.
    pub fn new_sequence_with_prompt(&mut self, prompt: &[u32]) -> SeqId {
        self.core.new_sequence_with(prompt, b"", b"")
    }

    /// Prompt tokens `seq` found cached when it started.
    pub fn num_cached_tokens(&self, seq: SeqId) -> Result<usize> {
        Ok(self.core.seq(seq)?.num_cached_tokens)
    }

    /// Tokens a new sequence with this prompt would find cached.
    pub fn match_prefix(&self, prompt: &[u32]) -> usize {
        self.core.match_prefix(prompt, b"", b"")
    }

    /// Committed positions of `seq`.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.core.seq(seq)?.seq_len)
    }

    /// Positions `layer` of `seq` holds: from its first kept position (0 unless a
    /// sliding or chunked layer released older ones) to its fill length.
    pub fn layer_span(&self, seq: SeqId, layer: usize) -> Result<Range<usize>> {
        let layer = check_index("layer", index(layer), self.shape().num_layers)?;
        let (first, end) = self.core.layer_span(seq, layer)?;
        Ok(first..end)
    }

    /// Writes `n` tokens' keys (`[n, num_kv_heads, head_dim]`, C order) and values
    /// (`[n, num_kv_heads, v_head_dim]`) at
    /// `layer`'s next free position of `seq`, taking blocks as needed (copying a shared
    /// block first), and returns that position. [`crate::KvError::CacheFull`], with
    /// nothing written, when the pool has too few free blocks.
    pub fn append(&mut self, seq: SeqId, layer: usize, k: &[T], v: &[T]) -> Result<usize> {
        let sh = self.shape();
        let n = token_count("k", k.len(), sh.num_kv_heads, sh.head_dim)?;
        let kt = tensor("k", k, &[n, sh.num_kv_heads, sh.head_dim])?;
        let vt = tensor("v", v, &[n, sh.num_kv_heads, sh.v_head_dim])?;
        self.core.append(seq, index(layer), &kt, &vt)
    }

    /// Commits `n` positions of `seq`; fails (naming the layer) unless every layer
    /// holds them.
    pub fn advance(&mut self, seq: SeqId, n: usize) -> Result<()> {
        self.core.advance(seq, index(n), None)
    }

    /// Commits one position per token of `tokens`, recording their ids: with prefix
    /// caching on, blocks they complete become findable by later prompts.
    pub fn advance_tokens(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        self.core.advance(seq, index(tokens.len()), Some(tokens))
    }

    /// Copies the keys and values `layer` of `seq` holds (the positions of
    /// [`BlockPool::layer_span`]) as `[num_kv_heads, len, head_dim]` and `[num_kv_heads,
    /// len, v_head_dim]`.
    pub fn read(&self, seq: SeqId, layer: usize) -> Result<(Vec<T>, Vec<T>)> {
        let sh = self.shape();
        let len = self.layer_span(seq, layer)?.len();
        let (k_shape, v_shape) = (
            [sh.num_kv_heads, len, sh.head_dim],
            [sh.num_kv_heads, len, sh.v_head_dim],
        );
        let mut keys = vec![T::default(); k_shape.iter().product()];
        let mut values = vec![T::default(); v_shape.iter().product()];
        let mut kt = tensor_mut("keys", &mut keys, &k_shape)?;
        let mut vt = tensor_mut("values", &mut values, &v_shape)?;
        self.core.gather(seq, index(layer), &mut kt, &mut vt)?;
        Ok((keys, values))
    }

    /// Attention of `seq`'s last `n` positions in `layer` over what the layer holds,
    /// within its window: `q` is `[n, num_q_heads, head_dim]` (the queries of the tokens
    /// just appended), `out` `[n, num_q_heads, v_head_dim]` (for latent attention,
    /// [`AttnOptions::latent`]: `q` of `head_dim + v_head_dim`, `out` of `head_dim`).
    /// Computed in `f32` over the blocks in place.
    pub fn attention<Q: Element>(
        &self,
        seq: SeqId,
        layer: usize,
        num_q_heads: usize,
        q: &[Q],
        out: &mut [Q],
    ) -> Result<()> {
        self.attention_with(seq, layer, num_q_heads, q, out, &AttnOptions::default())
    }

    /// [`BlockPool::attention`] with the model-specific parts (scale, soft-cap, sinks,
    /// ALiBi) in `opts`.
    pub fn attention_with<Q: Element>(
        &self,
        seq: SeqId,
        layer: usize,
        num_q_heads: usize,
        q: &[Q],
        out: &mut [Q],
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        let sh = self.shape();
        let heads = crate::attention::KvHeads {
            num_kv_heads: sh.num_kv_heads,
            head_dim: sh.head_dim,
            v_head_dim: sh.v_head_dim,
        }
        .attended(opts.latent);
        let (qt, mut ot) = query_tensors(q, out, num_q_heads, [heads.head_dim, heads.v_head_dim])?;
        self.core
            .seq_attention(seq, index(layer), &qt, &mut ot, opts)
    }

    /// A new sequence sharing every block of `seq` (copy-on-write: the first write to a
    /// shared block copies it).
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        self.core.fork(seq)
    }

    /// Drops positions `>= n` of `seq` (rollback), releasing the blocks no position
    /// needs; a no-op when `n >= seq_len`.
    pub fn truncate(&mut self, seq: SeqId, n: usize) -> Result<()> {
        self.core.truncate(seq, index(n))
    }

    /// Commits the accepted path of speculative decoding: of the draft positions of
    /// `seq` from `start` on, keeps those at `start + keep[i]` (strictly increasing),
    /// moved to `start + i` in every layer, and cuts the rest (see `docs/pools.md`,
    /// "Speculative decoding"). All or nothing.
    pub fn accept(&mut self, seq: SeqId, start: usize, keep: &[usize]) -> Result<()> {
        let keep: Vec<i64> = keep.iter().map(|&k| index(k)).collect();
        self.core.accept(seq, index(start), &keep)
    }

    /// Ends `seq`, releasing its blocks (cached ones stay findable until evicted).
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        self.core.free_sequence(seq)
    }

    /// Evicts every cached block no sequence holds; returns how many.
    pub fn evict_all(&mut self) -> usize {
        self.core.evict_all()
    }

    /// Waits until every block queued for the offload tiers is written (or refused).
    pub fn flush_tiers(&self) {
        self.core.flush_tiers();
    }

    /// Loads what the offload tiers hold of `tokens`' prefix into the cache now;
    /// returns the tokens a sequence starting with `tokens` would find cached.
    pub fn prefetch(&mut self, tokens: &[u32]) -> Result<usize> {
        self.core.prefetch(tokens, b"", b"")
    }

    /// Starts fetching what the offload tiers hold of `tokens`' prefix in the
    /// background and returns at once: the tokens of whole blocks the pool lacks. The
    /// lookup of a sequence starting with `tokens` loads from what was fetched.
    pub fn prefetch_async(&self, tokens: &[u32]) -> Result<usize> {
        self.core.prefetch_async(tokens, b"", b"")
    }

    /// The dtype-erased core this pool wraps (slot mappings, page tables, batched
    /// forwards, persistence, raw strided tensors).
    /// Unstable: the core is internal (`kvrs::unstable`), with no stability promise.
    #[doc(hidden)]
    pub fn core(&self) -> &PoolCore {
        &self.core
    }

    /// The core, mutable; its dtype and device stay those of this pool.
    /// Unstable: the core is internal (`kvrs::unstable`), with no stability promise.
    #[doc(hidden)]
    pub fn core_mut(&mut self) -> &mut PoolCore {
        &mut self.core
    }
}
