//! The paged block pool: one preallocated storage of fixed-size blocks shared by many
//! sequences, with reference counting, copy-on-write forks, slot reservation, page
//! tables and (optionally) prefix caching with LRU eviction.

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::allocator::{BlockAllocator, BlockId};
use super::layout::PagedShape;
use crate::dtype::DType;
use crate::error::{check_count, check_index, check_positive, KvError, Result};
use crate::kv_cache::{commit_target, KVCache, Kv};
use crate::prefix::{BlockHash, HashKind, PrefixCounters, PrefixEvent, PrefixIndex};
use crate::rope::Rope;
use crate::storage::{allocate, Device, Storage};
use crate::tensor::{expect_block_pair, TensorRef};

/// Handle of a sequence in a pool (never reused within one pool).
pub type SeqId = u64;

/// A prefix match: the cached whole blocks with their hashes, then the best partial
/// match of the next block (source block, matching tokens).
type PrefixMatch = (Vec<(BlockId, BlockHash)>, Option<(BlockId, usize)>);

/// What one sequence holds: its block table, fill lengths and (when it tracks them)
/// token ids.
///
/// Positions `0..held()` live in `blocks` (`blocks.len() == ceil(held / block_size)`);
/// each layer has its own fill length, and `seq_len` is the committed length, never above
/// any layer's. `tokens` are the known token ids (the prompt may run ahead of `held`);
/// `hashes` are the chained hashes of the first full, committed blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqState {
    /// Block ids, in position order.
    pub blocks: Vec<BlockId>,
    /// Positions written per layer.
    pub layer_len: Vec<usize>,
    /// Committed positions.
    pub seq_len: usize,
    /// Known token ids, from position 0.
    pub tokens: Vec<u32>,
    /// Chained hashes of blocks `0..hashes.len()`.
    pub hashes: Vec<BlockHash>,
    /// Root of the sequence's hash chain (its namespace).
    pub root: BlockHash,
    /// Mixed into every block hash (LoRA adapter, multimodal inputs).
    pub extra: Arc<[u8]>,
    /// Prompt tokens served from the prefix cache when the sequence started.
    pub num_cached_tokens: usize,
    /// Blocks at or past this position are never cached: their K/V were moved by a
    /// middle removal and no longer match what the model computes for the tokens.
    pub cache_limit: usize,
}

impl SeqState {
    /// Positions the block table covers: the longest layer.
    pub fn held(&self) -> usize {
        self.layer_len.iter().copied().max().unwrap_or(0)
    }

    fn uniform_len(&self) -> Option<usize> {
        let first = self.layer_len[0];
        self.layer_len.iter().all(|&l| l == first).then_some(first)
    }
}

/// How a pool caches prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Hash function of the chains.
    pub hash: HashKind,
    /// Seed of every chain root.
    pub seed: u128,
    /// Whether prompts may match the beginning of a cached block.
    pub partial_hits: bool,
    /// Whether stored and removed blocks are recorded for [`BlockPool::drain_events`].
    pub events: bool,
}

/// Occupancy of the pool (see [`BlockPool::stats`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolStats {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Blocks no sequence holds (free, or cached and evictable).
    pub free_blocks: usize,
    /// Blocks referenced by at least one sequence (or pin).
    pub used_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Bytes of the whole pool.
    pub bytes_total: usize,
    /// Bytes of the used blocks.
    pub bytes_used: usize,
    /// Distinct positions held by sequences (a shared block counts once).
    pub tokens_stored: usize,
    /// Unfilled positions of used blocks: `used_blocks * block_size - tokens_stored`.
    pub fragmentation_tokens: usize,
    /// `tokens_stored / (num_blocks * block_size)`.
    pub utilization_ratio: f64,
    /// Live sequences.
    pub num_sequences: usize,
    /// Blocks in the prefix index (held or evictable).
    pub cached_blocks: usize,
    /// Cached blocks no sequence holds: evicted first-in, least recently used first.
    pub evictable_blocks: usize,
    /// Query and eviction counters.
    pub prefix: PrefixCounters,
}

/// A pool of `num_blocks` blocks of `block_size` positions for every layer, shared by
/// sequences.
#[derive(Debug)]
pub struct BlockPool {
    shape: PagedShape,
    storage: Box<dyn Storage>,
    alloc: BlockAllocator,
    prefix: Option<PrefixIndex>,
    pins: FxHashMap<BlockId, u32>,
    rope: Option<Rope>,
    seqs: FxHashMap<SeqId, SeqState>,
    next_id: SeqId,
}

impl BlockPool {
    /// Allocates the whole pool, zero-filled, on `device`; caches prefixes when `prefix`
    /// is given.
    pub fn new(
        shape: PagedShape,
        dtype: DType,
        device: Device,
        prefix: Option<PrefixConfig>,
    ) -> Result<Self> {
        check_positive(&[
            ("num_layers", shape.num_layers),
            ("num_kv_heads", shape.num_kv_heads),
            ("head_dim", shape.head_dim),
            ("block_size", shape.block_size),
            ("num_blocks", shape.num_blocks),
        ])?;
        if shape.num_blocks > i32::MAX as usize / shape.block_size {
            return Err(KvError::InvalidArgument {
                name: "num_blocks",
                value: shape.num_blocks.to_string(),
                reason: format!(
                    "slots must fit in int32: at most {} blocks",
                    i32::MAX as usize / shape.block_size
                ),
            });
        }
        let numel = shape
            .total_elems()
            .filter(|&n| {
                n.checked_mul(dtype.size())
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| KvError::InvalidArgument {
                name: "num_blocks",
                value: shape.num_blocks.to_string(),
                reason: "the pool would exceed the address space".into(),
            })?;
        let storage = allocate(device, dtype, numel)?;
        let prefix = prefix.map(|p| {
            PrefixIndex::new(
                p.hash,
                p.seed,
                p.partial_hits,
                p.events,
                shape.num_blocks,
                shape.block_size,
            )
        });
        Ok(BlockPool {
            shape,
            storage,
            alloc: BlockAllocator::new(shape.num_blocks),
            prefix,
            pins: FxHashMap::default(),
            rope: None,
            seqs: FxHashMap::default(),
            next_id: 0,
        })
    }

    /// Gives the pool the rotary embedding its keys were computed with, so that a span can
    /// be removed from the middle of a sequence (later keys are re-rotated).
    pub fn with_rope(mut self, rope: Rope) -> Result<Self> {
        rope.rotary_dim(self.shape.head_dim)?;
        self.rope = Some(rope);
        Ok(self)
    }

    /// The pool's rotary embedding, if it has one.
    pub fn rope(&self) -> Option<Rope> {
        self.rope
    }

    /// The pool's sizes and layout.
    pub fn shape(&self) -> PagedShape {
        self.shape
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Device of the storage.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// Address of element 0 of the storage.
    pub fn data_ptr(&self) -> *mut u8 {
        self.storage.data_ptr()
    }

    /// The storage (for persistence and transfers).
    pub(crate) fn storage(&self) -> &dyn Storage {
        self.storage.as_ref()
    }

    /// The storage, for writing (loading a saved cache).
    pub(crate) fn storage_mut(&mut self) -> &mut dyn Storage {
        self.storage.as_mut()
    }

    /// Blocks in the free list (not counting evictable cached ones).
    pub(crate) fn free_block_count(&self) -> usize {
        self.alloc.num_free()
    }

    /// The prefix index, when prefix caching is on.
    pub fn prefix(&self) -> Option<&PrefixIndex> {
        self.prefix.as_ref()
    }

    /// Bytes of one block across all layers.
    pub fn bytes_per_block(&self) -> usize {
        self.shape.num_layers * self.shape.block_elems() * self.dtype().size()
    }

    /// Blocks that allocation can hand out: free ones plus evictable cached ones.
    pub fn num_free_blocks(&self) -> usize {
        self.alloc.num_free() + self.prefix.as_ref().map_or(0, |p| p.lru.len())
    }

    /// References to `block` (from sequences and pins).
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.alloc.refcount(block)
    }

    /// Whether `block` is in the prefix index (and so immutable).
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.prefix
            .as_ref()
            .is_some_and(|p| p.meta(block).is_some())
    }

    // ----- block life cycle -------------------------------------------------------------

    /// Takes a block for writing: a free one, else the least recently used cached one.
    /// The caller has checked [`Self::num_free_blocks`].
    pub(crate) fn take_block(&mut self) -> BlockId {
        if let Some(b) = self.alloc.allocate() {
            return b;
        }
        let p = self
            .prefix
            .as_mut()
            .expect("free blocks checked by the caller");
        let b = p
            .lru
            .pop_front()
            .expect("free blocks checked by the caller");
        p.unregister(b);
        p.counters.evictions += 1;
        self.alloc.revive(b);
        b
    }

    /// Adds a reference to `b`, taking it out of the eviction order if it was there.
    pub(crate) fn hold_block(&mut self, b: BlockId) {
        if self.alloc.refcount(b) == 0 {
            self.prefix
                .as_mut()
                .expect("only cached blocks rest unreferenced")
                .lru
                .remove(b);
            self.alloc.revive(b);
        } else {
            self.alloc.share(b);
        }
    }

    /// Drops a reference to `b`; an unreferenced cached block becomes evictable (most
    /// recently used), any other goes back to the free list.
    pub(crate) fn release_block(&mut self, b: BlockId) {
        if self.alloc.release(b) {
            match self.prefix.as_mut() {
                Some(p) if p.meta(b).is_some() => p.lru.push_back(b),
                _ => self.alloc.push_free(b),
            }
        }
    }

    /// Releases blocks last first, so a freed prompt's end is evicted before its start.
    fn release_all(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            self.release_block(b);
        }
    }

    // ----- sequences --------------------------------------------------------------------

    fn empty_state(&self, root: BlockHash, extra: Arc<[u8]>) -> SeqState {
        SeqState {
            blocks: Vec::new(),
            layer_len: vec![0; self.shape.num_layers],
            seq_len: 0,
            tokens: Vec::new(),
            hashes: Vec::new(),
            root,
            extra,
            num_cached_tokens: 0,
            cache_limit: usize::MAX,
        }
    }

    fn insert(&mut self, s: SeqState) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, s);
        id
    }

    /// Starts an empty sequence that tracks no tokens.
    pub fn new_sequence(&mut self) -> SeqId {
        let root = self.prefix.as_ref().map_or(0, |p| p.root(b""));
        let s = self.empty_state(root, Arc::from(&[][..]));
        self.insert(s)
    }

    /// Starts a sequence whose token ids begin with `tokens` (the prompt). With prefix
    /// caching on, the longest cached prefix is attached (no copy for full blocks; a
    /// fresh copy of the matching beginning of a block for a partial hit) and reported
    /// as `num_cached_tokens`; at least one prompt token is always left to compute.
    pub fn new_sequence_with(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> SeqId {
        let bs = self.shape.block_size;
        let root = self.prefix.as_ref().map_or(0, |p| p.root(namespace));
        let mut s = self.empty_state(root, Arc::from(extra));
        s.tokens = tokens.to_vec();
        let limit = tokens.len().saturating_sub(1);
        let (full, partial) = self.match_blocks(root, tokens, extra, limit);
        for &(b, h) in &full {
            self.hold_block(b);
            s.blocks.push(b);
            s.hashes.push(h);
        }
        let mut cached = full.len() * bs;
        if let Some((src, n)) = partial {
            // Hold the source so allocating the copy cannot evict it (holding may take it
            // out of the eviction order, so room is counted afterwards).
            self.hold_block(src);
            if self.num_free_blocks() > 0 {
                let b = self.take_block();
                self.copy_block(src, b);
                s.blocks.push(b);
                cached += n;
            }
            self.release_block(src);
        }
        s.layer_len.fill(cached);
        s.seq_len = cached;
        s.num_cached_tokens = cached;
        if let Some(p) = self.prefix.as_mut() {
            p.counters.queries += 1;
            p.counters.query_tokens += tokens.len() as u64;
            p.counters.hit_tokens += cached as u64;
        }
        self.insert(s)
    }

    /// The cached blocks matching `tokens` from `root`: whole blocks (with their hashes),
    /// then the best partial match of the next block, covering at most `limit` tokens.
    fn match_blocks(
        &self,
        root: BlockHash,
        tokens: &[u32],
        extra: &[u8],
        limit: usize,
    ) -> PrefixMatch {
        let Some(p) = self.prefix.as_ref() else {
            return (Vec::new(), None);
        };
        let bs = self.shape.block_size;
        let mut full = Vec::new();
        let mut parent = root;
        let mut buf = Vec::with_capacity(16 + 4 * bs + extra.len());
        while (full.len() + 1) * bs <= limit {
            let start = full.len() * bs;
            let h = p
                .kind
                .block_with(&mut buf, parent, &tokens[start..start + bs], extra);
            match p.lookup(h) {
                Some(b) => {
                    full.push((b, h));
                    parent = h;
                }
                None => break,
            }
        }
        let mut partial = None;
        if p.partial_hits {
            let start = full.len() * bs;
            let want = &tokens[start..limit.min(start + bs).max(start)];
            let mut best = 0;
            for &c in p.children(parent) {
                // A child's hash also covers the extra key: only same-key children match.
                if p.kind.block(parent, p.block_tokens(c), extra)
                    != p.meta(c).expect("indexed").hash
                {
                    continue;
                }
                let lcp = p
                    .block_tokens(c)
                    .iter()
                    .zip(want)
                    .take_while(|(a, b)| a == b)
                    .count();
                if lcp > best {
                    best = lcp;
                    partial = Some((c, lcp));
                }
            }
        }
        (full, partial)
    }

    /// Tokens of `tokens` (in `namespace`, with `extra`) that a new sequence would find
    /// cached, without attaching anything or counting a query.
    pub fn match_prefix(&self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> usize {
        let Some(p) = self.prefix.as_ref() else {
            return 0;
        };
        let (full, partial) = self.match_blocks(
            p.root(namespace),
            tokens,
            extra,
            tokens.len().saturating_sub(1),
        );
        full.len() * self.shape.block_size + partial.map_or(0, |(_, n)| n)
    }

    /// Copies every layer of block `src` onto block `dst`.
    fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        for layer in 0..self.shape.num_layers {
            self.storage
                .copy_within(
                    self.shape.whole_block(layer, src),
                    self.shape.whole_block(layer, dst),
                )
                .expect("blocks of one pool");
        }
    }

    /// The state of a live sequence.
    pub fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or_else(|| freed(id))
    }

    fn seq_mut(&mut self, id: SeqId) -> &mut SeqState {
        self.seqs.get_mut(&id).expect("checked live")
    }

    /// Whether `id` is a live sequence.
    pub fn is_live(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Ids of every live sequence.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Releases a sequence's blocks (last first) and forgets it.
    pub fn free_sequence(&mut self, id: SeqId) -> Result<()> {
        let s = self.seqs.remove(&id).ok_or_else(|| freed(id))?;
        self.release_all(&s.blocks);
        Ok(())
    }

    /// Frees every live sequence not in `keep`.
    pub fn keep(&mut self, keep: &[SeqId]) -> Result<()> {
        for &id in keep {
            self.seq(id)?;
        }
        let keep: FxHashSet<SeqId> = keep.iter().copied().collect();
        let drop: Vec<SeqId> = self
            .seqs
            .keys()
            .copied()
            .filter(|id| !keep.contains(id))
            .collect();
        for id in drop {
            self.free_sequence(id)?;
        }
        Ok(())
    }

    /// A new sequence sharing every block of `id` (no copy).
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId> {
        let mut s = self.seq(id)?.clone();
        s.num_cached_tokens = 0;
        for &b in &s.blocks {
            self.hold_block(b);
        }
        Ok(self.insert(s))
    }

    /// Makes `dst` hold the first `n` committed positions of `src`, sharing their blocks
    /// (llama.cpp's `seq_cp`, ollama's `CopyPrefix`); `dst`'s previous content is released.
    pub fn copy_prefix(&mut self, src: SeqId, dst: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        let s = self.seq(src)?;
        self.seq(dst)?;
        if src == dst {
            return Err(KvError::InvalidArgument {
                name: "dst",
                value: format!("sequence {dst}"),
                reason: "must differ from src".into(),
            });
        }
        if n > s.seq_len {
            return Err(KvError::InvalidArgument {
                name: "n",
                value: n.to_string(),
                reason: format!("src has only {} committed positions", s.seq_len),
            });
        }
        let bs = self.shape.block_size;
        let mut copy = s.clone();
        copy.blocks.truncate(n.div_ceil(bs));
        copy.hashes.truncate(n / bs);
        copy.tokens.truncate(n);
        copy.layer_len.fill(n);
        copy.seq_len = n;
        copy.num_cached_tokens = 0;
        for &b in &copy.blocks {
            self.hold_block(b);
        }
        let old = std::mem::replace(self.seq_mut(dst), copy);
        self.release_all(&old.blocks);
        Ok(())
    }

    // ----- writing ----------------------------------------------------------------------

    /// Whether writing into block `b` needs a private copy first: it is shared, or it
    /// is cached (cached blocks are immutable).
    fn needs_copy(&self, b: BlockId) -> bool {
        self.alloc.refcount(b) > 1 || self.is_cached(b)
    }

    /// Blocks that writing positions `start..end` of `s` would take: new blocks past the
    /// table, plus copies of shared or cached blocks in the range.
    fn blocks_needed(&self, s: &SeqState, start: usize, end: usize) -> usize {
        if start >= end {
            return 0;
        }
        let bs = self.shape.block_size;
        let grow = end.div_ceil(bs).saturating_sub(s.blocks.len());
        let last_existing = end.div_ceil(bs).min(s.blocks.len());
        let copies = (start / bs..last_existing)
            .filter(|&i| self.needs_copy(s.blocks[i]))
            .count();
        grow + copies
    }

    /// Makes positions `start..end` of sequence `id` writable: copies shared or cached
    /// blocks in the range (copy-on-write, all layers) and appends new blocks. The caller
    /// has checked with [`Self::blocks_needed`] that enough blocks are available.
    fn prepare_write(&mut self, id: SeqId, start: usize, end: usize) {
        if start >= end {
            return;
        }
        let bs = self.shape.block_size;
        let mut blocks = std::mem::take(&mut self.seq_mut(id).blocks);
        for i in start / bs..end.div_ceil(bs).min(blocks.len()) {
            let old = blocks[i];
            if self.needs_copy(old) {
                let new = self.take_block();
                self.copy_block(old, new);
                self.release_block(old);
                blocks[i] = new;
            }
        }
        while blocks.len() < end.div_ceil(bs) {
            blocks.push(self.take_block());
        }
        self.seq_mut(id).blocks = blocks;
    }

    fn ensure_room(&self, needed: usize, what: impl FnOnce() -> String) -> Result<()> {
        if needed > self.num_free_blocks() {
            return Err(KvError::CacheFull {
                what: format!("{} (blocks)", what()),
                needed,
                capacity: self.num_free_blocks(),
            });
        }
        Ok(())
    }

    /// Appends `k`, `v` (`[n_tokens, num_kv_heads, head_dim]`) at `layer`'s next free
    /// position of sequence `id`, allocating and copying blocks as needed; returns the
    /// start position. All or nothing: `CacheFull` when the blocks do not suffice.
    pub fn append(&mut self, id: SeqId, layer: i64, k: &TensorRef, v: &TensorRef) -> Result<usize> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let n = token_count("k", k, sh)?;
        v.expect_shape("v", &[n, sh.num_kv_heads, sh.head_dim])?;
        let s = self.seq(id)?;
        let start = s.layer_len[layer];
        self.ensure_room(self.blocks_needed(s, start, start + n), || {
            format!("appending {n} tokens to layer {layer} at position {start}")
        })?;
        self.prepare_write(id, start, start + n);
        self.write_seq(id, layer, start, k, v)?;
        self.seq_mut(id).layer_len[layer] = start + n;
        Ok(start)
    }

    /// Writes `k`, `v` (`[n, H, D]`) at positions `start..start + n` of sequence `id`,
    /// whose blocks there are writable ([`Self::prepare_write`]).
    fn write_seq(
        &mut self,
        id: SeqId,
        layer: usize,
        start: usize,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        let blocks = std::mem::take(&mut self.seq_mut(id).blocks);
        let written = self.write_positions(&blocks, layer, start, k, v);
        self.seq_mut(id).blocks = blocks;
        written
    }

    /// Checks the arguments of a block transfer; returns (layer, start, block size).
    fn block_args(
        &self,
        layer: i64,
        start_pos: i64,
        block_size: i64,
        keys: &TensorRef,
        values: &TensorRef,
    ) -> Result<(usize, usize, usize)> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let start = check_count("start_pos", start_pos)?;
        let n = check_count("block_size", block_size)?;
        expect_block_pair(keys, values, [sh.num_kv_heads, n, sh.head_dim])?;
        Ok((layer, start, n))
    }

    /// Writes `k`, `v` (`[n, H, D]`) at positions `start..start + n` of a block table.
    fn write_positions(
        &mut self,
        blocks: &[BlockId],
        layer: usize,
        start: usize,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        let bs = self.shape.block_size;
        let n = k.shape3()[0];
        let mut t = 0;
        while t < n {
            let pos = start + t;
            let run = (bs - pos % bs).min(n - t);
            let block = blocks[pos / bs];
            for (kv, src) in [(Kv::Key, k), (Kv::Value, v)] {
                self.storage.write(
                    self.shape.positions(layer, kv, block, pos % bs, run),
                    &src.slice(0, t, run),
                )?;
            }
            t += run;
        }
        Ok(())
    }

    /// Checks that `new` token ids can be recorded at positions `start..` of `s`: its known
    /// tokens must reach `start`, and any it already knows there must agree.
    pub(crate) fn check_tokens(s: &SeqState, id: SeqId, start: usize, new: &[u32]) -> Result<()> {
        if s.tokens.len() < start {
            return Err(KvError::InvalidArgument {
                name: "tokens",
                value: format!("{} ids for positions {start}..{}", new.len(), start + new.len()),
                reason: format!(
                    "sequence {id} knows token ids only up to position {}; give them from the start \
                     (new_sequence(tokens=...)) and with every commit",
                    s.tokens.len()
                ),
            });
        }
        for (i, (&known, &given)) in s.tokens[start..].iter().zip(new).enumerate() {
            if known != given {
                return Err(KvError::InvalidArgument {
                    name: "tokens",
                    value: given.to_string(),
                    reason: format!(
                        "position {} of sequence {id} already has token id {known}",
                        start + i
                    ),
                });
            }
        }
        Ok(())
    }

    pub(crate) fn record_tokens(&mut self, id: SeqId, start: usize, new: &[u32]) {
        let s = self.seq_mut(id);
        let known = s.tokens.len() - start;
        if new.len() > known {
            s.tokens.extend_from_slice(&new[known..]);
        }
    }

    /// Commits `n` tokens of sequence `id` (every layer must already hold them), with
    /// their token ids when given; then caches the blocks they complete.
    pub fn advance(&mut self, id: SeqId, n: i64, tokens: Option<&[u32]>) -> Result<()> {
        let s = self.seq(id)?;
        let target = commit_target(s.seq_len, &s.layer_len, n)?;
        let n = target - s.seq_len;
        if let Some(t) = tokens {
            if t.len() != n {
                return Err(KvError::InvalidArgument {
                    name: "tokens",
                    value: format!("{} ids", t.len()),
                    reason: format!("needs one id per committed token ({n})"),
                });
            }
            Self::check_tokens(s, id, s.seq_len, t)?;
        }
        let start = s.seq_len;
        if let Some(t) = tokens {
            self.record_tokens(id, start, t);
        }
        self.seq_mut(id).seq_len = target;
        self.register_blocks(id);
        Ok(())
    }

    /// Caches every full, committed block of `id` whose token ids are known.
    fn register_blocks(&mut self, id: SeqId) {
        let bs = self.shape.block_size;
        let Some(p) = self.prefix.as_mut() else {
            return;
        };
        let s = self.seqs.get_mut(&id).expect("checked live");
        while s.hashes.len() < s.seq_len.min(s.tokens.len()).min(s.cache_limit) / bs {
            let i = s.hashes.len();
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            let toks = &s.tokens[i * bs..(i + 1) * bs];
            let h = p.kind.block(parent, toks, &s.extra);
            s.hashes.push(h);
            // A block already cached under another hash, or a hash already cached in
            // another block, stays as it is: the first copy wins.
            p.register(s.blocks[i], h, parent, i == 0, toks);
        }
    }

    /// Cuts sequence `id` to its first `len` positions in every layer (and the committed
    /// length), releasing the blocks past them; `cut_tokens` also forgets token ids there.
    pub(crate) fn cut_to(&mut self, id: SeqId, len: usize, cut_tokens: bool) {
        let bs = self.shape.block_size;
        let s = self.seq_mut(id);
        s.seq_len = s.seq_len.min(len);
        s.layer_len.iter_mut().for_each(|l| *l = (*l).min(len));
        s.hashes.truncate(s.seq_len / bs);
        if cut_tokens {
            s.tokens.truncate(len);
        }
        let keep = s.held().div_ceil(bs);
        let dropped: Vec<BlockId> = s.blocks.drain(keep..).collect();
        self.release_all(&dropped);
    }

    /// Drops positions `>= n`; a no-op when `n >= seq_len` (as [`crate::KVCache::truncate`]).
    pub fn truncate(&mut self, id: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        if n < self.seq(id)?.seq_len {
            self.cut_to(id, n, true);
        }
        Ok(())
    }

    /// llama.cpp's `seq_rm`: removes positions `[begin, end)` (`end = None`: to the end).
    /// Removing a tail cuts the sequence; removing a span in the middle needs positions
    /// to be shifted and keys re-rotated, which this pool cannot do: `NotSupported`.
    pub fn remove(&mut self, id: SeqId, begin: i64, end: Option<i64>) -> Result<()> {
        let begin = check_count("begin", begin)?;
        let end = match end {
            None => usize::MAX,
            Some(e) => check_count("end", e)?,
        };
        let held = self.seq(id)?.held();
        if begin >= end || begin >= held {
            return Ok(());
        }
        if end < held {
            let rope = self.rope.ok_or_else(|| {
                KvError::NotSupported(format!(
                    "removing positions [{begin}, {end}) from the middle of a sequence of {held} needs later \
                     keys re-rotated: give the pool its rotary embedding (BlockPool(..., rope=kvrs.RoPE(...))) \
                     or remove a tail (end=None)"
                ))
            })?;
            return self.remove_span(id, begin, end, rope);
        }
        self.cut_to(id, begin, true);
        Ok(())
    }

    /// Removes positions `[begin, end)` from the middle of sequence `id`: later positions
    /// move down by `end - begin` and their keys are re-rotated by that much (values are
    /// unchanged). Shared or cached blocks are copied before they change.
    fn remove_span(&mut self, id: SeqId, begin: usize, end: usize, rope: Rope) -> Result<()> {
        let sh = self.shape;
        let (bs, h, d) = (sh.block_size, sh.num_kv_heads, sh.head_dim);
        let shift = end - begin;
        let s = self.seq(id)?;
        let new_held = s.held() - shift;
        self.ensure_room(self.blocks_needed(s, begin, new_held), || {
            format!("removing positions [{begin}, {end}) of sequence {id}")
        })?;
        self.prepare_write(id, begin, new_held);
        let blocks = self.seq(id)?.blocks.clone();
        for layer in 0..sh.num_layers {
            let len = self.seq(id)?.layer_len[layer];
            if len <= end {
                continue;
            }
            // One layer's moved tail at a time, through float32.
            let n = len - end;
            let (mut k, mut v) = (vec![0f32; h * n * d], vec![0f32; h * n * d]);
            let kt = unsafe {
                TensorRef::contiguous(k.as_mut_ptr() as *const u8, DType::F32, &[h, n, d])?
            };
            let vt = unsafe {
                TensorRef::contiguous(v.as_mut_ptr() as *const u8, DType::F32, &[h, n, d])?
            };
            self.read_positions(&blocks, layer, end, n, &kt, &vt)?;
            rope.rotate(d, &mut k, -(shift as f64))?;
            self.write_positions(
                &blocks,
                layer,
                begin,
                &kt.transposed(0, 1),
                &vt.transposed(0, 1),
            )?;
        }
        let moved = |l: usize| if l > end { l - shift } else { l.min(begin) };
        let s = self.seq_mut(id);
        s.layer_len.iter_mut().for_each(|l| *l = moved(*l));
        s.seq_len = moved(s.seq_len);
        if s.tokens.len() > begin {
            let stop = end.min(s.tokens.len());
            s.tokens.drain(begin..stop);
        }
        s.hashes.truncate(begin / bs);
        s.cache_limit = s.cache_limit.min(begin);
        let keep = s.held().div_ceil(bs);
        let dropped: Vec<BlockId> = s.blocks.drain(keep..).collect();
        self.release_all(&dropped);
        Ok(())
    }

    /// Sets the committed length and every layer's length to `n`, growing or shrinking
    /// the block table (new positions hold whatever the blocks held); then caches the
    /// full blocks whose token ids are known. For callers that inject blocks kept elsewhere.
    pub fn set_seq_len(&mut self, id: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        let held = self.seq(id)?.held();
        if n < held {
            self.cut_to(id, n, true);
        } else {
            let s = self.seq(id)?;
            self.ensure_room(self.blocks_needed(s, held, n), || {
                format!("growing sequence {id} to {n} positions")
            })?;
            self.prepare_write(id, held, n);
        }
        let bs = self.shape.block_size;
        let s = self.seq_mut(id);
        s.layer_len.fill(n);
        s.seq_len = n;
        s.hashes.truncate(n / bs);
        self.register_blocks(id);
        Ok(())
    }

    /// Writes `[num_kv_heads, block_size, head_dim]` keys and values at positions
    /// `start_pos..start_pos + block_size` of `layer`, allocating blocks as needed; the
    /// layer then holds at least those positions. Commit with [`Self::set_seq_len`] or
    /// [`Self::advance`].
    pub fn inject_block(
        &mut self,
        id: SeqId,
        layer: i64,
        start_pos: i64,
        block_size: i64,
        keys: &TensorRef,
        values: &TensorRef,
    ) -> Result<()> {
        let (layer, start, n) = self.block_args(layer, start_pos, block_size, keys, values)?;
        let s = self.seq(id)?;
        self.ensure_room(self.blocks_needed(s, start, start + n), || {
            format!("injecting {n} positions at {start}")
        })?;
        self.prepare_write(id, start, start + n);
        self.write_seq(
            id,
            layer,
            start,
            &keys.transposed(0, 1),
            &values.transposed(0, 1),
        )?;
        let s = self.seq_mut(id);
        s.layer_len[layer] = s.layer_len[layer].max(start + n);
        Ok(())
    }

    /// Copies `[num_kv_heads, block_size, head_dim]` keys and values of `layer` from
    /// `start_pos` into `keys`/`values`; positions the layer does not hold read as zeros.
    pub fn extract_block(
        &self,
        id: SeqId,
        layer: i64,
        start_pos: i64,
        block_size: i64,
        keys: &TensorRef,
        values: &TensorRef,
    ) -> Result<()> {
        let (layer, start, n) = self.block_args(layer, start_pos, block_size, keys, values)?;
        let s = self.seq(id)?;
        let inside = s.layer_len[layer].saturating_sub(start).min(n);
        if inside > 0 {
            self.read_positions(&s.blocks, layer, start, inside, keys, values)?;
        }
        for out in [keys, values] {
            // SAFETY: the tail positions of the caller's [H, n, D] tensor.
            unsafe { out.slice(1, inside, n - inside).fill_zero() };
        }
        Ok(())
    }

    /// Fills empty sequence `id` with the content of `cache`: every layer's positions and
    /// lengths, and its committed length.
    pub fn copy_from_cache(&mut self, id: SeqId, cache: &KVCache) -> Result<()> {
        let sh = self.shape;
        check_same_shape(sh, cache)?;
        let s = self.seq(id)?;
        if s.held() > 0 {
            return Err(KvError::InvalidArgument {
                name: "seq",
                value: format!("sequence {id}"),
                reason: format!("must be empty, but holds {} positions", s.held()),
            });
        }
        let held = (0..sh.num_layers)
            .map(|l| cache.layer_len(l))
            .max()
            .unwrap_or(0);
        self.ensure_room(held.div_ceil(sh.block_size), || {
            format!("copying {held} positions from a KVCache")
        })?;
        self.prepare_write(id, 0, held);
        let blocks = self.seq(id)?.blocks.clone();
        for layer in 0..sh.num_layers {
            let len = cache.layer_len(layer);
            let (k, v) = (
                cache.host_tensor(layer, Kv::Key, len)?,
                cache.host_tensor(layer, Kv::Value, len)?,
            );
            self.write_positions(&blocks, layer, 0, &k.transposed(0, 1), &v.transposed(0, 1))?;
        }
        let s = self.seq_mut(id);
        for layer in 0..sh.num_layers {
            s.layer_len[layer] = cache.layer_len(layer);
        }
        s.seq_len = cache.seq_len();
        self.register_blocks(id);
        Ok(())
    }

    /// Copies sequence `id` into `cache`, replacing its content: every layer's positions
    /// and lengths, and the committed length.
    pub fn copy_to_cache(&self, id: SeqId, cache: &mut KVCache) -> Result<()> {
        let sh = self.shape;
        check_same_shape(sh, cache)?;
        let s = self.seq(id)?;
        let max = cache.shape().max_seq_len;
        if s.held() > max {
            return Err(KvError::CacheFull {
                what: format!("copying sequence {id} into a KVCache"),
                needed: s.held(),
                capacity: max,
            });
        }
        for layer in 0..sh.num_layers {
            let len = s.layer_len[layer];
            let (k, v) = (
                cache.host_tensor(layer, Kv::Key, len)?,
                cache.host_tensor(layer, Kv::Value, len)?,
            );
            self.read_positions(&s.blocks, layer, 0, len, &k, &v)?;
        }
        cache.set_lengths(s.seq_len, &s.layer_len);
        Ok(())
    }

    // ----- reading ----------------------------------------------------------------------

    /// Gathers sequence `id`'s `layer` into `k_out`, `v_out` (`[heads, >= len, head_dim]`)
    /// and returns `len`, the positions that layer holds.
    pub fn gather(
        &self,
        id: SeqId,
        layer: i64,
        k_out: &TensorRef,
        v_out: &TensorRef,
    ) -> Result<usize> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let s = self.seq(id)?;
        let len = s.layer_len[layer];
        for (name, out) in [("k_out", k_out), ("v_out", v_out)] {
            let o = out.shape();
            if o.len() != 3 || o[0] != sh.num_kv_heads || o[1] < len || o[2] != sh.head_dim {
                return Err(KvError::Shape {
                    name,
                    got: o.to_vec(),
                    expected: format!("[{}, >= {len}, {}]", sh.num_kv_heads, sh.head_dim),
                });
            }
        }
        self.read_positions(&s.blocks, layer, 0, len, k_out, v_out)?;
        Ok(len)
    }

    /// Reads positions `start..start + n` of a block table into `[H, >= n, D]` outputs.
    pub(crate) fn read_positions(
        &self,
        blocks: &[BlockId],
        layer: usize,
        start: usize,
        n: usize,
        k_out: &TensorRef,
        v_out: &TensorRef,
    ) -> Result<()> {
        let bs = self.shape.block_size;
        let mut t = 0;
        while t < n {
            let pos = start + t;
            let run = (bs - pos % bs).min(n - t);
            let block = blocks[pos / bs];
            for (kv, out) in [(Kv::Key, k_out), (Kv::Value, v_out)] {
                let dst = out.slice(1, t, run).transposed(0, 1);
                self.storage
                    .read(self.shape.positions(layer, kv, block, pos % bs, run), &dst)?;
            }
            t += run;
        }
        Ok(())
    }

    // ----- batches ----------------------------------------------------------------------

    /// Reserves positions for `counts[i]` new tokens at the end of each sequence, all or
    /// nothing, and returns their slots (`block * block_size + offset`), in order. The
    /// positions become part of every layer (fill them with [`Self::write`]) and are
    /// committed with [`Self::advance`].
    pub fn reserve(&mut self, ids: &[SeqId], counts: &[i64]) -> Result<Vec<i64>> {
        if ids.len() != counts.len() {
            return Err(KvError::InvalidArgument {
                name: "counts",
                value: format!("{} entries", counts.len()),
                reason: format!("needs one count per sequence ({})", ids.len()),
            });
        }
        let mut needed = 0;
        let mut plan = Vec::with_capacity(ids.len());
        let mut seen = FxHashSet::with_capacity_and_hasher(ids.len(), Default::default());
        for (&id, &c) in ids.iter().zip(counts) {
            let c = check_count("counts", c)?;
            if !seen.insert(id) {
                return Err(KvError::InvalidArgument {
                    name: "seqs",
                    value: format!("sequence {id}"),
                    reason: "appears twice; give each sequence once with its total count".into(),
                });
            }
            let s = self.seq(id)?;
            let start = s.uniform_len().ok_or_else(|| KvError::InvalidArgument {
                name: "seqs",
                value: format!("sequence {id}"),
                reason: format!("its layers hold different lengths {:?}; finish or truncate the partial append first", s.layer_len),
            })?;
            needed += self.blocks_needed(s, start, start + c);
            plan.push((id, start, c));
        }
        let total: usize = plan.iter().map(|p| p.2).sum();
        self.ensure_room(needed, || {
            format!("reserving {total} tokens for {} sequences", ids.len())
        })?;
        let bs = self.shape.block_size;
        let mut slots = Vec::with_capacity(total);
        for (id, start, c) in plan {
            self.prepare_write(id, start, start + c);
            let s = self.seq_mut(id);
            s.layer_len.fill(start + c);
            slots.extend(
                (start..start + c).map(|p| (s.blocks[p / bs] as usize * bs + p % bs) as i64),
            );
        }
        Ok(slots)
    }

    /// Scatters `k`, `v` (`[n_tokens, heads, head_dim]`) into `slots` (vLLM's
    /// `reshape_and_cache`; slot `-1` skips the token). Every slot must lie in a block
    /// that exactly one sequence holds and that is not cached (reserve positions first).
    pub fn write(&mut self, layer: i64, k: &TensorRef, v: &TensorRef, slots: &[i64]) -> Result<()> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let n = token_count("k", k, sh)?;
        v.expect_shape("v", &[n, sh.num_kv_heads, sh.head_dim])?;
        if slots.len() != n {
            return Err(KvError::Shape {
                name: "slot_mapping",
                got: vec![slots.len()],
                expected: format!("[{n}] (one per token)"),
            });
        }
        let limit = sh.num_blocks * sh.block_size;
        for &slot in slots {
            if slot == -1 {
                continue;
            }
            let b = (check_index("slot_mapping", slot, limit)? / sh.block_size) as BlockId;
            let refs = self.alloc.refcount(b);
            let reason = if refs == 0 {
                format!("block {b} is not held by any sequence; reserve() the positions first")
            } else if refs > 1 {
                format!("block {b} is shared by {refs} holders; reserve() the positions first (copy-on-write)")
            } else if self.is_cached(b) {
                format!(
                    "block {b} is in the prefix cache and immutable; reserve() the positions first"
                )
            } else {
                continue;
            };
            return Err(KvError::InvalidArgument {
                name: "slot_mapping",
                value: slot.to_string(),
                reason,
            });
        }
        let mut t = 0;
        while t < n {
            if slots[t] == -1 {
                t += 1;
                continue;
            }
            let (b, off) = (
                (slots[t] as usize / sh.block_size) as BlockId,
                slots[t] as usize % sh.block_size,
            );
            // Consecutive slots within one block are written as one run.
            let mut run = 1;
            while t + run < n
                && off + run < sh.block_size
                && slots[t + run] == slots[t] + run as i64
            {
                run += 1;
            }
            for (kv, src) in [(Kv::Key, k), (Kv::Value, v)] {
                self.storage
                    .write(sh.positions(layer, kv, b, off, run), &src.slice(0, t, run))?;
            }
            t += run;
        }
        Ok(())
    }

    /// FlashInfer's page table for `ids`: `(indptr [B+1], indices, last_page_len [B])`,
    /// over the positions each sequence holds (an empty sequence has no page and
    /// `last_page_len` 0).
    pub fn page_table(&self, ids: &[SeqId]) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let bs = self.shape.block_size;
        let mut indptr = Vec::with_capacity(ids.len() + 1);
        let mut indices = Vec::new();
        let mut last = Vec::with_capacity(ids.len());
        indptr.push(0);
        for &id in ids {
            let s = self.seq(id)?;
            indices.extend(s.blocks.iter().map(|&b| b as i32));
            indptr.push(indices.len() as i32);
            let held = s.held();
            last.push(if held == 0 { 0 } else { (held - 1) % bs + 1 } as i32);
        }
        Ok((indptr, indices, last))
    }

    /// Block tables of `ids` as rows of a `[batch, max_blocks]` matrix padded with `pad`.
    pub fn block_tables(&self, ids: &[SeqId], pad: i32) -> Result<(Vec<i32>, usize)> {
        let states: Vec<&SeqState> = ids.iter().map(|&id| self.seq(id)).collect::<Result<_>>()?;
        let width = states.iter().map(|s| s.blocks.len()).max().unwrap_or(0);
        let mut out = vec![pad; width * ids.len()];
        for (row, s) in states.iter().enumerate() {
            for (j, &b) in s.blocks.iter().enumerate() {
                out[row * width + j] = b as i32;
            }
        }
        Ok((out, width))
    }

    // ----- the prefix cache -------------------------------------------------------------

    fn prefix_or_err(&self) -> Result<&PrefixIndex> {
        self.prefix.as_ref().ok_or_else(|| {
            KvError::NotSupported(
                "prefix caching is off for this pool (prefix_caching=False)".into(),
            )
        })
    }

    /// The cached full blocks of `tokens` (in `namespace`, with `extra`), in order.
    fn cached_chain(&self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<Vec<BlockId>> {
        let p = self.prefix_or_err()?;
        let (full, _) = self.match_blocks(p.root(namespace), tokens, extra, tokens.len());
        Ok(full.into_iter().map(|(b, _)| b).collect())
    }

    /// Keeps the cached full blocks of `tokens` from eviction until [`Self::unpin`];
    /// returns the tokens pinned.
    pub fn pin(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        let chain = self.cached_chain(tokens, namespace, extra)?;
        for &b in &chain {
            self.hold_block(b);
            *self.pins.entry(b).or_insert(0) += 1;
        }
        Ok(chain.len() * self.shape.block_size)
    }

    /// Undoes one [`Self::pin`] of the same prefix; returns the tokens unpinned.
    pub fn unpin(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        let chain = self.cached_chain(tokens, namespace, extra)?;
        let pinned: Vec<BlockId> = chain
            .into_iter()
            .take_while(|b| self.pins.contains_key(b))
            .collect();
        for &b in pinned.iter().rev() {
            let c = self.pins.get_mut(&b).expect("checked");
            *c -= 1;
            if *c == 0 {
                self.pins.remove(&b);
            }
            self.release_block(b);
        }
        Ok(pinned.len() * self.shape.block_size)
    }

    /// Drops every cached block no sequence holds; returns how many.
    pub fn evict_all(&mut self) -> usize {
        let Some(p) = self.prefix.as_mut() else {
            return 0;
        };
        let mut n = 0;
        while let Some(b) = p.lru.pop_front() {
            p.unregister(b);
            p.counters.evictions += 1;
            self.alloc.push_free(b);
            n += 1;
        }
        n
    }

    /// Blocks stored in and removed from the prefix index since the last call.
    pub fn drain_events(&mut self) -> Result<Vec<PrefixEvent>> {
        self.prefix
            .as_mut()
            .and_then(PrefixIndex::drain_events)
            .ok_or_else(|| {
                KvError::NotSupported(
                    "events are not recorded: create the pool with events=True".into(),
                )
            })
    }

    /// Caches `tokens`' block `b` under `hash` (from a saved cache) as evictable, most
    /// recently used. For loading; `b` must be unreferenced and uncached.
    pub(crate) fn adopt_cached(
        &mut self,
        b: BlockId,
        hash: BlockHash,
        parent: BlockHash,
        first: bool,
        tokens: &[u32],
    ) -> bool {
        let p = self.prefix.as_mut().expect("prefix caching on");
        if !p.register(b, hash, parent, first, tokens) {
            return false;
        }
        p.lru.push_back(b);
        true
    }

    /// Takes a free block (not an evictable one) for loading, or `None`.
    pub(crate) fn take_free_block(&mut self) -> Option<BlockId> {
        let b = self.alloc.allocate()?;
        assert!(self.alloc.release(b));
        Some(b)
    }

    // ----- accounting -------------------------------------------------------------------

    /// Occupancy: blocks, bytes, exact token counts and prefix-cache counters.
    pub fn stats(&self) -> PoolStats {
        let bs = self.shape.block_size;
        // A block's filled positions: the most any sequence holding it has written there.
        let mut fill = vec![0usize; self.shape.num_blocks];
        for s in self.seqs.values() {
            let held = s.held();
            for (i, &b) in s.blocks.iter().enumerate() {
                fill[b as usize] = fill[b as usize].max(held.saturating_sub(i * bs).min(bs));
            }
        }
        for &b in self.pins.keys() {
            fill[b as usize] = bs;
        }
        let free = self.num_free_blocks();
        let used = self.shape.num_blocks - free;
        let tokens: usize = fill.iter().sum();
        PoolStats {
            num_blocks: self.shape.num_blocks,
            free_blocks: free,
            used_blocks: used,
            block_size: bs,
            bytes_total: self.storage.nbytes(),
            bytes_used: used * self.bytes_per_block(),
            tokens_stored: tokens,
            fragmentation_tokens: used * bs - tokens,
            utilization_ratio: tokens as f64 / (self.shape.num_blocks * bs) as f64,
            num_sequences: self.seqs.len(),
            cached_blocks: self.prefix.as_ref().map_or(0, PrefixIndex::len),
            evictable_blocks: self.prefix.as_ref().map_or(0, |p| p.lru.len()),
            prefix: self
                .prefix
                .as_ref()
                .map_or_else(PrefixCounters::default, |p| p.counters),
        }
    }

    /// Checks every invariant: reference counts equal block-table occurrences plus pins,
    /// the free list and the eviction order are exact, the prefix index is consistent,
    /// tables cover exactly the held positions, `seq_len` never exceeds a layer's length.
    /// For tests; O(blocks + sequences).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let evictable = self.prefix.as_ref().map_or(0, |p| p.lru.len());
        self.alloc.check(evictable)?;
        if let Some(p) = &self.prefix {
            p.check(|b| self.alloc.refcount(b))?;
        }
        let mut refs = vec![0u32; self.shape.num_blocks];
        for (&b, &c) in &self.pins {
            refs[b as usize] += c;
        }
        for (id, s) in &self.seqs {
            if s.blocks.len() != s.held().div_ceil(self.shape.block_size) {
                return Err(format!(
                    "sequence {id} holds {} positions in {} blocks",
                    s.held(),
                    s.blocks.len()
                ));
            }
            if s.layer_len.iter().any(|&l| l < s.seq_len) {
                return Err(format!(
                    "sequence {id} committed {} past a layer {:?}",
                    s.seq_len, s.layer_len
                ));
            }
            s.blocks.iter().for_each(|&b| refs[b as usize] += 1);
        }
        for (b, &r) in refs.iter().enumerate() {
            if r != self.alloc.refcount(b as BlockId) {
                return Err(format!(
                    "block {b} has {r} holders but counts {} references",
                    self.alloc.refcount(b as BlockId)
                ));
            }
        }
        Ok(())
    }
}

fn freed(id: SeqId) -> KvError {
    KvError::InvalidArgument {
        name: "seq",
        value: format!("sequence {id}"),
        reason: "was freed (or belongs to no pool)".into(),
    }
}

fn check_same_shape(sh: PagedShape, cache: &KVCache) -> Result<()> {
    let c = cache.shape();
    if (c.num_layers, c.num_kv_heads, c.head_dim) != (sh.num_layers, sh.num_kv_heads, sh.head_dim) {
        return Err(KvError::InvalidArgument {
            name: "cache",
            value: format!(
                "{} layers x {} heads x {}",
                c.num_layers, c.num_kv_heads, c.head_dim
            ),
            reason: format!(
                "must match the pool's {} layers x {} heads x {}",
                sh.num_layers, sh.num_kv_heads, sh.head_dim
            ),
        });
    }
    Ok(())
}

/// Checks that `t` is `[n, heads, head_dim]` and returns `n`.
pub(crate) fn token_count(name: &'static str, t: &TensorRef, sh: PagedShape) -> Result<usize> {
    let s = t.shape();
    if s.len() != 3 || s[1] != sh.num_kv_heads || s[2] != sh.head_dim {
        return Err(KvError::Shape {
            name,
            got: s.to_vec(),
            expected: format!("[n_tokens, {}, {}]", sh.num_kv_heads, sh.head_dim),
        });
    }
    Ok(s[0])
}
