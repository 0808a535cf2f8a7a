//! The paged block pool: one preallocated storage of fixed-size blocks shared by many
//! sequences, with reference counting, copy-on-write forks, per-group block tables
//! (sliding-window and chunked layers release what no window sees) and, optionally,
//! prefix caching with LRU eviction ([`super::caching`]).

use rayon::prelude::*;
use rustc_hash::{FxHashMap, FxHashSet};

use super::allocator::{BlockAllocator, BlockId};
use super::groups::{Attention, LayerGroups, LayerKind};
use super::layout::PagedShape;
use super::seq::{SeqState, Table, NO_BLOCK};
use crate::dtype::DType;
use crate::error::{check_count, check_index, check_positive, KvError, Result};
use crate::kv_cache::{commit_target, KVCache, Kv};
use crate::prefix::{PrefixCounters, PrefixIndex};
use crate::rope::Rope;
use crate::storage::{allocate, Device, PagedTensor, Storage};
use crate::tensor::{expect_block_pair, TensorRef};

/// Handle of a sequence in a pool (never reused within one pool).
pub type SeqId = u64;

/// How a pool caches prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Hash function of the chains.
    pub hash: crate::prefix::HashKind,
    /// Seed of every chain root.
    pub seed: u128,
    /// Whether prompts may match the beginning of a cached block.
    pub partial_hits: bool,
    /// Whether stored and removed blocks are recorded for [`BlockPool::drain_events`].
    pub events: bool,
}

/// Memory held by the layers of one kind (see [`BlockPool::stats`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindStats {
    /// The kind.
    pub kind: LayerKind,
    /// Layers of that kind.
    pub layers: usize,
    /// Blocks its groups' tables hold (a shared block counts once).
    pub used_blocks: usize,
    /// Bytes of those blocks.
    pub bytes_used: usize,
    /// Distinct positions those blocks hold.
    pub tokens_stored: usize,
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
    /// Blocks and positions held by sequences, per layer kind present.
    pub by_kind: Vec<KindStats>,
}

/// A pool of `num_blocks` blocks of `block_size` positions for every layer of a group,
/// shared by sequences.
#[derive(Debug)]
pub struct BlockPool {
    pub(crate) shape: PagedShape,
    pub(crate) groups: LayerGroups,
    pub(crate) storage: Box<dyn Storage>,
    pub(crate) alloc: BlockAllocator,
    pub(crate) prefix: Option<PrefixIndex>,
    pub(crate) pins: FxHashMap<BlockId, u32>,
    pub(crate) rope: Option<Rope>,
    pub(crate) seqs: FxHashMap<SeqId, SeqState>,
    next_id: SeqId,
}

impl BlockPool {
    /// Allocates the whole pool (every layer full attention), zero-filled, on `device`;
    /// caches prefixes when `prefix` is given.
    pub fn new(
        shape: PagedShape,
        dtype: DType,
        device: Device,
        prefix: Option<PrefixConfig>,
    ) -> Result<Self> {
        check_layer_count(shape.num_layers)?;
        Self::with_attention(
            shape,
            Attention::full(shape.num_layers),
            dtype,
            device,
            prefix,
        )
    }

    /// Allocates the whole pool for layers of the kinds in `attention`, zero-filled, on
    /// `device`; caches prefixes when `prefix` is given.
    pub fn with_attention(
        shape: PagedShape,
        attention: Attention,
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
        check_layer_count(shape.num_layers)?;
        attention.validate(shape.num_layers)?;
        let groups = LayerGroups::new(attention);
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
            .total_elems(groups.per_block)
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
        let partial_ok = groups.all_full();
        let prefix = prefix.map(|p| {
            PrefixIndex::new(
                p.hash,
                p.seed,
                p.partial_hits && partial_ok,
                p.events,
                shape.num_blocks,
                shape.block_size,
            )
        });
        Ok(BlockPool {
            shape,
            groups,
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

    /// The layer kinds and how layers are grouped.
    pub fn groups(&self) -> &LayerGroups {
        &self.groups
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

    /// Bytes of one block id: one block of each layer of a group.
    pub fn bytes_per_block(&self) -> usize {
        self.groups.per_block * self.shape.block_elems() * self.dtype().size()
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

    /// The storage tensor of `layer`.
    pub fn tensor_of(&self, layer: usize) -> usize {
        self.groups.tensor_of[layer]
    }

    /// The group (block table) of a layer; with `None`, the only group of a pool whose
    /// layers are all full attention.
    pub fn group_for(&self, layer: Option<i64>) -> Result<usize> {
        match layer {
            Some(l) => Ok(self.groups.group_of[check_index("layer", l, self.shape.num_layers)?]),
            None if self.groups.groups.len() == 1 => Ok(0),
            None => Err(KvError::InvalidArgument {
                name: "layer",
                value: "None".into(),
                reason: format!(
                    "this pool's layers have {} block tables (layer groups); name the layer",
                    self.groups.groups.len()
                ),
            }),
        }
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
    pub(crate) fn release_all(&mut self, blocks: impl DoubleEndedIterator<Item = BlockId>) {
        for b in blocks.rev() {
            if b != NO_BLOCK {
                self.release_block(b);
            }
        }
    }

    /// Copies block `src` onto block `dst` in every storage tensor. Both are the pool's
    /// own blocks, so this fails only when the device itself has failed (a CUDA context
    /// that can no longer launch), which no state of the pool can recover from.
    pub(crate) fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        self.storage
            .copy_blocks(self.shape, self.groups.per_block, &[(src, dst)])
            .expect("copying blocks within the pool's storage: the device failed");
    }

    // ----- sequences --------------------------------------------------------------------

    pub(crate) fn empty_state(
        &self,
        root: crate::prefix::BlockHash,
        extra: std::sync::Arc<[u8]>,
    ) -> SeqState {
        SeqState {
            tables: smallvec::smallvec![Table::default(); self.groups.groups.len()],
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

    pub(crate) fn insert(&mut self, s: SeqState) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, s);
        id
    }

    /// Starts an empty sequence that tracks no tokens.
    pub fn new_sequence(&mut self) -> SeqId {
        let root = self.prefix.as_ref().map_or(0, |p| p.root(b""));
        let s = self.empty_state(root, std::sync::Arc::from(&[][..]));
        self.insert(s)
    }

    /// The state of a live sequence.
    pub fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or_else(|| freed(id))
    }

    pub(crate) fn seq_mut(&mut self, id: SeqId) -> &mut SeqState {
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
        for t in &s.tables {
            self.release_all(t.blocks.iter().copied());
        }
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
        for b in s.all_blocks().collect::<Vec<_>>() {
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
        copy.hashes.truncate(n / bs);
        copy.tokens.truncate(n);
        copy.layer_len.fill(n);
        copy.seq_len = n;
        copy.num_cached_tokens = 0;
        for t in &mut copy.tables {
            t.start = t.start.min(n);
            let start = t.start;
            cut_table(t, start, n, bs);
        }
        for b in copy.all_blocks().collect::<Vec<_>>() {
            self.hold_block(b);
        }
        let old = std::mem::replace(self.seq_mut(dst), copy);
        for t in &old.tables {
            self.release_all(t.blocks.iter().copied());
        }
        self.trim(dst);
        Ok(())
    }

    /// Sets every entry of `g`'s table that covers none of its held positions to
    /// [`NO_BLOCK`] and drops entries past them, releasing those blocks.
    pub(crate) fn normalize_table(&mut self, id: SeqId, g: usize) {
        let bs = self.shape.block_size;
        let held = self
            .seq(id)
            .expect("checked live")
            .held_by(&self.groups.groups[g].layers);
        let t = &mut self.seq_mut(id).tables[g];
        t.start = t.start.min(held);
        let start = t.start;
        let dropped = cut_table(t, start, held, bs);
        self.release_all(dropped.into_iter());
    }

    /// Releases the blocks of sliding and chunked groups that no future token of `id`
    /// sees (and that lie behind the sliding layers' `swa_memory`).
    pub(crate) fn trim(&mut self, id: SeqId) {
        let bs = self.shape.block_size;
        for g in 0..self.groups.groups.len() {
            let kind = self.groups.groups[g].kind;
            if kind == LayerKind::Full {
                continue;
            }
            let keep = self
                .groups
                .attention
                .keep_from(kind, self.seq(id).expect("checked live").seq_len);
            let t = &mut self.seq_mut(id).tables[g];
            t.start = t.start.max(keep / bs * bs);
            self.normalize_table(id, g);
        }
    }

    /// Whether the cache holds everything needed to continue sequence `id` at `pos`
    /// (after dropping the positions from `pos` on), for every layer (ollama's `CanResume`).
    pub fn can_resume(&self, id: SeqId, pos: i64) -> Result<bool> {
        let pos = check_count("pos", pos)?;
        let s = self.seq(id)?;
        if pos > s.seq_len {
            return Ok(false);
        }
        Ok(self
            .groups
            .groups
            .iter()
            .zip(&s.tables)
            .all(|(g, t)| self.window_held(g.kind, t, pos)))
    }

    /// Whether a table starting at `t.start` holds what a token at `pos` of `kind` sees
    /// before itself.
    pub(crate) fn window_held(&self, kind: LayerKind, t: &Table, pos: usize) -> bool {
        let first = self.groups.attention.first_visible(kind, pos);
        first >= pos || t.start <= first
    }

    // ----- writing ----------------------------------------------------------------------

    /// Whether writing into block `b` needs a private copy first: it is shared, or it
    /// is cached (cached blocks are immutable).
    fn needs_copy(&self, b: BlockId) -> bool {
        self.alloc.refcount(b) > 1 || self.is_cached(b)
    }

    /// Blocks that writing positions `start..end` of group `g` of `s` would take: new
    /// blocks past the table or in released entries, plus copies of shared or cached
    /// blocks in the range.
    pub(crate) fn group_blocks_needed(
        &self,
        s: &SeqState,
        g: usize,
        start: usize,
        end: usize,
    ) -> usize {
        if start >= end {
            return 0;
        }
        let bs = self.shape.block_size;
        let t = &s.tables[g];
        let grow = end.div_ceil(bs).saturating_sub(t.blocks.len());
        let last_existing = end.div_ceil(bs).min(t.blocks.len());
        let fixes = (start / bs..last_existing)
            .filter(|&i| t.blocks[i] == NO_BLOCK || self.needs_copy(t.blocks[i]))
            .count();
        grow + fixes
    }

    /// [`Self::group_blocks_needed`] summed over every group.
    pub(crate) fn blocks_needed(&self, s: &SeqState, start: usize, end: usize) -> usize {
        (0..self.groups.groups.len())
            .map(|g| self.group_blocks_needed(s, g, start, end))
            .sum()
    }

    /// Makes positions `start..end` of group `g` of sequence `id` writable: copies shared
    /// or cached blocks (copy-on-write), fills released entries and appends new blocks.
    /// The caller has checked with [`Self::group_blocks_needed`] that blocks suffice.
    pub(crate) fn prepare_group(&mut self, id: SeqId, g: usize, start: usize, end: usize) {
        if start >= end {
            return;
        }
        let bs = self.shape.block_size;
        let mut blocks = std::mem::take(&mut self.seq_mut(id).tables[g].blocks);
        for i in start / bs..end.div_ceil(bs).min(blocks.len()) {
            let old = blocks[i];
            if old == NO_BLOCK {
                blocks[i] = self.take_block();
            } else if self.needs_copy(old) {
                let new = self.take_block();
                self.copy_block(old, new);
                self.release_block(old);
                blocks[i] = new;
            }
        }
        while blocks.len() < end.div_ceil(bs) {
            blocks.push(self.take_block());
        }
        self.seq_mut(id).tables[g].blocks = blocks;
    }

    /// [`Self::prepare_group`] for every group.
    pub(crate) fn prepare_write(&mut self, id: SeqId, start: usize, end: usize) {
        for g in 0..self.groups.groups.len() {
            self.prepare_group(id, g, start, end);
        }
    }

    pub(crate) fn ensure_room(&self, needed: usize, what: impl FnOnce() -> String) -> Result<()> {
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
        let g = self.groups.group_of[layer];
        let s = self.seq(id)?;
        let start = s.layer_len[layer];
        let needed = self.group_blocks_needed(s, g, start, start + n);
        self.ensure_room(needed, || {
            format!("appending {n} tokens to layer {layer} at position {start}")
        })?;
        if needed > 0 {
            // Otherwise the table already holds writable blocks there (most decode steps).
            self.prepare_group(id, g, start, start + n);
        }
        self.write_seq(id, layer, start, k, v)?;
        self.seq_mut(id).layer_len[layer] = start + n;
        Ok(start)
    }

    /// Writes `k`, `v` (`[n, H, D]`) at positions `start..start + n` of `layer` of sequence
    /// `id`, whose blocks there are writable ([`Self::prepare_group`]).
    fn write_seq(
        &mut self,
        id: SeqId,
        layer: usize,
        start: usize,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        let g = self.groups.group_of[layer];
        let blocks = std::mem::take(&mut self.seq_mut(id).tables[g].blocks);
        let written = self.write_positions(&blocks, layer, start, k, v);
        self.seq_mut(id).tables[g].blocks = blocks;
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
        let (layer, start, n) = self.check_block_args(layer, start_pos, block_size)?;
        let sh = self.shape;
        expect_block_pair(keys, values, [sh.num_kv_heads, n, sh.head_dim])?;
        Ok((layer, start, n))
    }

    /// Checks `extract_block`/`inject_block` arguments without touching any tensor (so
    /// callers can refuse bad ones before allocating outputs): a layer of the pool, and
    /// a block no longer than the pool holds (`num_blocks * block_size` positions).
    pub fn check_block_args(
        &self,
        layer: i64,
        start_pos: i64,
        block_size: i64,
    ) -> Result<(usize, usize, usize)> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let start = check_count("start_pos", start_pos)?;
        let n = check_count("block_size", block_size)?;
        let capacity = sh.num_blocks * sh.block_size;
        if n > capacity {
            return Err(KvError::InvalidArgument {
                name: "block_size",
                value: n.to_string(),
                reason: format!("must be <= {capacity} (the positions the pool holds)"),
            });
        }
        Ok((layer, start, n))
    }

    /// Writes `k`, `v` (`[n, H, D]`) at positions `start..start + n` of `layer` through
    /// its group's block table.
    pub(crate) fn write_positions(
        &mut self,
        blocks: &[BlockId],
        layer: usize,
        start: usize,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        let t = self.paged_tensor(layer);
        self.storage.write_positions(t, blocks, start, k, v)
    }

    /// Layer `layer`'s cache tensor, as the storage's paged operations take it.
    pub(crate) fn paged_tensor(&self, layer: usize) -> PagedTensor {
        PagedTensor {
            shape: self.shape,
            index: self.tensor_of(layer),
        }
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
    /// their token ids when given; then caches the blocks they complete and releases the
    /// blocks that sliding and chunked layers no longer need.
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
        self.trim(id);
        Ok(())
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
        for g in 0..self.groups.groups.len() {
            self.normalize_table(id, g);
        }
    }

    /// Drops positions `>= n`; a no-op when `n >= seq_len` (as [`crate::KVCache::truncate`]).
    pub fn truncate(&mut self, id: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        if n < self.seq(id)?.seq_len {
            self.cut_to(id, n, true);
        }
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
        self.trim(id);
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
        let g = self.groups.group_of[layer];
        let s = self.seq(id)?;
        let held_from = s.tables[g].start;
        if start + n < held_from {
            return Err(KvError::InvalidArgument {
                name: "start_pos",
                value: start.to_string(),
                reason: format!(
                    "layer {layer} holds positions from {held_from}; a block must reach them (end >= {held_from})"
                ),
            });
        }
        self.ensure_room(self.group_blocks_needed(s, g, start, start + n), || {
            format!("injecting {n} positions at {start}")
        })?;
        self.prepare_group(id, g, start, start + n);
        self.write_seq(
            id,
            layer,
            start,
            &keys.transposed(0, 1),
            &values.transposed(0, 1),
        )?;
        let s = self.seq_mut(id);
        s.layer_len[layer] = s.layer_len[layer].max(start + n);
        let t = &mut s.tables[g];
        t.start = t.start.min(start);
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
        let t = &s.tables[self.groups.group_of[layer]];
        let (lo, hi) = (t.start.max(start), s.layer_len[layer].min(start + n));
        for out in [keys, values] {
            // The caller's [H, n, D] tensor, zeroed before the held part is read.
            self.storage.zero(out)?;
        }
        if lo < hi {
            let at = |o: &TensorRef| o.slice(1, lo - start, hi - lo);
            self.read_positions(&t.blocks, layer, lo, hi - lo, &at(keys), &at(values))?;
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
        let held = |layers: &[usize]| {
            layers
                .iter()
                .map(|&l| cache.layer_len(l))
                .max()
                .unwrap_or(0)
        };
        let needed: usize = self
            .groups
            .groups
            .iter()
            .map(|g| held(&g.layers).div_ceil(sh.block_size))
            .sum();
        self.ensure_room(needed, || "copying a KVCache".to_string())?;
        for g in 0..self.groups.groups.len() {
            let end = held(&self.groups.groups[g].layers);
            self.prepare_group(id, g, 0, end);
        }
        for layer in 0..sh.num_layers {
            let len = cache.layer_len(layer);
            let (k, v) = (
                cache.host_tensor(layer, Kv::Key, len)?,
                cache.host_tensor(layer, Kv::Value, len)?,
            );
            self.write_seq(id, layer, 0, &k.transposed(0, 1), &v.transposed(0, 1))?;
        }
        let s = self.seq_mut(id);
        for layer in 0..sh.num_layers {
            s.layer_len[layer] = cache.layer_len(layer);
        }
        s.seq_len = cache.seq_len();
        self.register_blocks(id);
        self.trim(id);
        Ok(())
    }

    /// Copies sequence `id` into `cache`, replacing its content: every layer's positions
    /// and lengths, and the committed length. Every layer must still hold position 0.
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
        if let Some((g, t)) = s.tables.iter().enumerate().find(|(_, t)| t.start > 0) {
            return Err(KvError::NotSupported(format!(
                "sequence {id} no longer holds positions 0..{} of its {} layers {:?} (released \
                 out of the window); a KVCache needs every position",
                t.start, self.groups.groups[g].kind, self.groups.groups[g].layers
            )));
        }
        for layer in 0..sh.num_layers {
            let len = s.layer_len[layer];
            let (k, v) = (
                cache.host_tensor(layer, Kv::Key, len)?,
                cache.host_tensor(layer, Kv::Value, len)?,
            );
            let t = &s.tables[self.groups.group_of[layer]];
            self.read_positions(&t.blocks, layer, 0, len, &k, &v)?;
        }
        cache.set_lengths(s.seq_len, &s.layer_len);
        Ok(())
    }

    // ----- reading ----------------------------------------------------------------------

    /// Positions `layer` of sequence `id` holds: `(first, end)`.
    pub fn layer_span(&self, id: SeqId, layer: usize) -> Result<(usize, usize)> {
        let s = self.seq(id)?;
        Ok((
            s.tables[self.groups.group_of[layer]].start,
            s.layer_len[layer],
        ))
    }

    /// Gathers the positions sequence `id`'s `layer` holds into `k_out`, `v_out`
    /// (`[heads, >= n, head_dim]`) and returns `(first, n)`: positions `first..first + n`.
    pub fn gather(
        &self,
        id: SeqId,
        layer: i64,
        k_out: &TensorRef,
        v_out: &TensorRef,
    ) -> Result<(usize, usize)> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let (first, end) = self.layer_span(id, layer)?;
        let len = end - first;
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
        let blocks = &self.seq(id)?.tables[self.groups.group_of[layer]].blocks;
        let bytes = 2 * len * sh.num_kv_heads * sh.head_dim * self.storage.dtype().size();
        let on_host = self.device() == Device::Cpu;
        if !on_host || bytes < PARALLEL_GATHER_BYTES || rayon::current_num_threads() < 2 {
            self.read_positions(blocks, layer, first, len, k_out, v_out)?;
        } else {
            // Whole blocks per task, a few tasks per thread; each writes its own positions.
            let per_task = len.div_ceil(4 * rayon::current_num_threads());
            let chunk = per_task.div_ceil(sh.block_size) * sh.block_size;
            (0..len).into_par_iter().step_by(chunk).try_for_each(|t| {
                let n = chunk.min(len - t);
                let (k, v) = (k_out.slice(1, t, n), v_out.slice(1, t, n));
                self.read_positions(blocks, layer, first + t, n, &k, &v)
            })?;
        }
        Ok((first, len))
    }

    /// Reads positions `start..start + n` of `layer` through its group's block table into
    /// `[H, >= n, D]` outputs.
    pub(crate) fn read_positions(
        &self,
        blocks: &[BlockId],
        layer: usize,
        start: usize,
        n: usize,
        k_out: &TensorRef,
        v_out: &TensorRef,
    ) -> Result<()> {
        let t = self.paged_tensor(layer);
        self.storage
            .read_positions(t, blocks, start, n, k_out, v_out)
    }

    // ----- accounting -------------------------------------------------------------------

    /// Occupancy: blocks, bytes, exact token counts, prefix-cache counters, and the
    /// blocks each layer kind holds.
    pub fn stats(&self) -> PoolStats {
        let bs = self.shape.block_size;
        // A block's filled positions: the most any table holding it covers there.
        let mut fill = vec![0usize; self.shape.num_blocks];
        let mut kind_of = vec![None; self.shape.num_blocks];
        for s in self.seqs.values() {
            for (g, t) in self.groups.groups.iter().zip(&s.tables) {
                let held = s.held_by(&g.layers);
                for (i, &b) in t.blocks.iter().enumerate() {
                    if b == NO_BLOCK {
                        continue;
                    }
                    let lo = (i * bs).max(t.start);
                    let n = held.min((i + 1) * bs).saturating_sub(lo);
                    fill[b as usize] = fill[b as usize].max(n);
                    kind_of[b as usize] = Some(g.kind);
                }
            }
        }
        for &b in self.pins.keys() {
            fill[b as usize] = bs;
        }
        let free = self.num_free_blocks();
        let used = self.shape.num_blocks - free;
        let tokens: usize = fill.iter().sum();
        let by_kind = [LayerKind::Full, LayerKind::Sliding, LayerKind::Chunked]
            .into_iter()
            .filter(|k| self.groups.attention.kinds.contains(k))
            .map(|kind| {
                let mine = (0..self.shape.num_blocks).filter(|&b| kind_of[b] == Some(kind));
                let used_blocks = mine.clone().count();
                KindStats {
                    kind,
                    layers: self
                        .groups
                        .attention
                        .kinds
                        .iter()
                        .filter(|&&k| k == kind)
                        .count(),
                    used_blocks,
                    bytes_used: used_blocks * self.bytes_per_block(),
                    tokens_stored: mine.map(|b| fill[b]).sum(),
                }
            })
            .collect();
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
            by_kind,
        }
    }

    /// Checks every invariant: reference counts equal block-table occurrences plus pins,
    /// the free list and the eviction order are exact, the prefix index is consistent,
    /// each table holds a block exactly where it covers a held position, full groups
    /// start at 0, `seq_len` never exceeds a layer's length. For tests; O(blocks + sequences).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let bs = self.shape.block_size;
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
            for (g, (group, t)) in self.groups.groups.iter().zip(&s.tables).enumerate() {
                let held = s.held_by(&group.layers);
                if t.blocks.len() != held.div_ceil(bs) || t.start > held {
                    return Err(format!(
                        "sequence {id} group {g} holds {}..{held} in {} entries",
                        t.start,
                        t.blocks.len()
                    ));
                }
                if group.kind == LayerKind::Full && t.start != 0 {
                    return Err(format!(
                        "sequence {id} full group {g} starts at {}",
                        t.start
                    ));
                }
                for (i, &b) in t.blocks.iter().enumerate() {
                    let covers = (i * bs).max(t.start) < ((i + 1) * bs).min(held);
                    if covers != (b != NO_BLOCK) {
                        return Err(format!(
                            "sequence {id} group {g} entry {i} is {b} but covers held positions: {covers}"
                        ));
                    }
                }
            }
            if s.layer_len.iter().any(|&l| l < s.seq_len) {
                return Err(format!(
                    "sequence {id} committed {} past a layer {:?}",
                    s.seq_len, s.layer_len
                ));
            }
            s.all_blocks().for_each(|b| refs[b as usize] += 1);
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

/// Cuts table `t` to the entries covering held positions `start..held`: later entries are
/// dropped and earlier ones become [`NO_BLOCK`]; returns the blocks taken out.
pub(crate) fn cut_table(t: &mut Table, start: usize, held: usize, bs: usize) -> Vec<BlockId> {
    let mut out: Vec<BlockId> = t
        .blocks
        .drain(held.div_ceil(bs).min(t.blocks.len())..)
        .collect();
    for i in 0..t.blocks.len() {
        if (i * bs).max(start) >= ((i + 1) * bs).min(held) && t.blocks[i] != NO_BLOCK {
            out.push(std::mem::replace(&mut t.blocks[i], NO_BLOCK));
        }
    }
    out.retain(|&b| b != NO_BLOCK);
    out
}

/// Layers a pool may have: far more than any model, few enough that per-layer
/// bookkeeping is always allocatable.
pub const MAX_LAYERS: usize = 1 << 16;

/// Gathers of at least this many bytes are split across rayon's threads, as torch splits
/// its large copies: one thread rarely saturates memory bandwidth.
const PARALLEL_GATHER_BYTES: usize = 1 << 20;

/// Checks that `num_layers` is at most [`MAX_LAYERS`].
pub fn check_layer_count(num_layers: usize) -> Result<()> {
    if num_layers > MAX_LAYERS {
        return Err(KvError::InvalidArgument {
            name: "num_layers",
            value: num_layers.to_string(),
            reason: format!("must be <= {MAX_LAYERS}"),
        });
    }
    Ok(())
}

pub(crate) fn freed(id: SeqId) -> KvError {
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
