//! The paged block pool: one preallocated storage of fixed-size blocks shared by many
//! sequences, with reference counting, copy-on-write forks, slot reservation and page
//! tables.

use rustc_hash::{FxHashMap, FxHashSet};

use super::allocator::{BlockAllocator, BlockId};
use super::layout::PagedShape;
use crate::dtype::DType;
use crate::error::{check_count, check_index, KvError, Result};
use crate::kv_cache::Kv;
use crate::storage::{allocate, Device, Storage};
use crate::tensor::TensorRef;

/// Handle of a sequence in a pool (never reused within one pool).
pub type SeqId = u64;

/// What one sequence holds: its block table and fill lengths.
///
/// Positions `0..held()` live in `blocks` (`blocks.len() == ceil(held / block_size)`);
/// each layer has its own fill length, and `seq_len` is the committed length, never above
/// any layer's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqState {
    /// Block ids, in position order.
    pub blocks: Vec<BlockId>,
    /// Positions written per layer.
    pub layer_len: Vec<usize>,
    /// Committed positions.
    pub seq_len: usize,
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

/// Occupancy of the pool (see [`BlockPool::stats`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolStats {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Blocks with no reference.
    pub free_blocks: usize,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Bytes of the whole pool.
    pub bytes_total: usize,
    /// Bytes of the used blocks.
    pub bytes_used: usize,
    /// Distinct positions held in used blocks (a shared block counts once).
    pub tokens_stored: usize,
    /// Reserved but unfilled positions of used blocks: `used_blocks * block_size - tokens_stored`.
    pub fragmentation_tokens: usize,
    /// `tokens_stored / (num_blocks * block_size)`.
    pub utilization_ratio: f64,
    /// Live sequences.
    pub num_sequences: usize,
}

/// A pool of `num_blocks` blocks of `block_size` positions for every layer, shared by
/// sequences.
#[derive(Debug)]
pub struct BlockPool {
    shape: PagedShape,
    storage: Box<dyn Storage>,
    alloc: BlockAllocator,
    seqs: FxHashMap<SeqId, SeqState>,
    next_id: SeqId,
}

impl BlockPool {
    /// Allocates the whole pool, zero-filled, on `device`.
    pub fn new(shape: PagedShape, dtype: DType, device: Device) -> Result<Self> {
        for (name, v) in [
            ("num_layers", shape.num_layers),
            ("num_kv_heads", shape.num_kv_heads),
            ("head_dim", shape.head_dim),
            ("block_size", shape.block_size),
            ("num_blocks", shape.num_blocks),
        ] {
            if v == 0 {
                return Err(KvError::InvalidArgument {
                    name,
                    value: "0".into(),
                    reason: "must be >= 1".into(),
                });
            }
        }
        if shape.num_blocks > BlockId::MAX as usize / shape.block_size {
            return Err(KvError::InvalidArgument {
                name: "num_blocks",
                value: shape.num_blocks.to_string(),
                reason: format!(
                    "slots must fit in int32: at most {} blocks",
                    BlockId::MAX as usize / shape.block_size
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
        Ok(BlockPool {
            shape,
            storage,
            alloc: BlockAllocator::new(shape.num_blocks),
            seqs: FxHashMap::default(),
            next_id: 0,
        })
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

    /// Bytes of one block across all layers.
    pub fn bytes_per_block(&self) -> usize {
        self.shape.num_layers * self.shape.block_elems() * self.dtype().size()
    }

    /// Free blocks.
    pub fn num_free_blocks(&self) -> usize {
        self.alloc.num_free()
    }

    /// References to `block`.
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.alloc.refcount(block)
    }

    /// Starts an empty sequence.
    pub fn new_sequence(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            SeqState {
                blocks: Vec::new(),
                layer_len: vec![0; self.shape.num_layers],
                seq_len: 0,
            },
        );
        id
    }

    /// The state of a live sequence.
    pub fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or_else(|| freed(id))
    }

    /// Whether `id` is a live sequence.
    pub fn is_live(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Ids of every live sequence.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Releases a sequence's blocks and forgets it.
    pub fn free_sequence(&mut self, id: SeqId) -> Result<()> {
        let s = self.seqs.remove(&id).ok_or_else(|| freed(id))?;
        s.blocks.iter().for_each(|&b| self.alloc.release(b));
        Ok(())
    }

    /// Frees every live sequence not in `keep`.
    pub fn keep(&mut self, keep: &[SeqId]) -> Result<()> {
        for &id in keep {
            self.seq(id)?;
        }
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
        let s = self.seq(id)?.clone();
        s.blocks.iter().for_each(|&b| self.alloc.share(b));
        let new = self.new_sequence();
        self.seqs.insert(new, s);
        Ok(new)
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
        let shared: Vec<BlockId> = s.blocks[..n.div_ceil(self.shape.block_size)].to_vec();
        shared.iter().for_each(|&b| self.alloc.share(b));
        let d = self.seqs.get_mut(&dst).expect("checked above");
        let old = std::mem::replace(&mut d.blocks, shared);
        d.layer_len.fill(n);
        d.seq_len = n;
        old.iter().for_each(|&b| self.alloc.release(b));
        Ok(())
    }

    /// Blocks that writing positions `start..end` of `s` would take from the free list:
    /// new blocks past the table, plus copies of shared blocks in the range.
    fn blocks_needed(&self, s: &SeqState, start: usize, end: usize) -> usize {
        if start >= end {
            return 0;
        }
        let bs = self.shape.block_size;
        let grow = end.div_ceil(bs).saturating_sub(s.blocks.len());
        let last_existing = (end.div_ceil(bs)).min(s.blocks.len());
        let shared = (start / bs..last_existing)
            .filter(|&i| self.alloc.refcount(s.blocks[i]) > 1)
            .count();
        grow + shared
    }

    /// Makes positions `start..end` of sequence `id` writable: copies shared blocks in
    /// the range (copy-on-write, all layers) and appends new blocks. The caller has
    /// checked with [`Self::blocks_needed`] that the free list suffices.
    fn prepare_write(&mut self, id: SeqId, start: usize, end: usize) -> Result<()> {
        if start >= end {
            return Ok(());
        }
        let bs = self.shape.block_size;
        let mut blocks = std::mem::take(&mut self.seqs.get_mut(&id).expect("live").blocks);
        for i in start / bs..end.div_ceil(bs).min(blocks.len()) {
            let old = blocks[i];
            if self.alloc.refcount(old) > 1 {
                let new = self
                    .alloc
                    .allocate()
                    .expect("free blocks checked by the caller");
                for layer in 0..self.shape.num_layers {
                    self.storage.copy_within(
                        self.shape.whole_block(layer, old),
                        self.shape.whole_block(layer, new),
                    )?;
                }
                self.alloc.release(old);
                blocks[i] = new;
            }
        }
        while blocks.len() < end.div_ceil(bs) {
            blocks.push(
                self.alloc
                    .allocate()
                    .expect("free blocks checked by the caller"),
            );
        }
        self.seqs.get_mut(&id).expect("live").blocks = blocks;
        Ok(())
    }

    fn cache_full(&self, what: String, needed: usize) -> KvError {
        KvError::CacheFull {
            what: format!("{what} (blocks)"),
            needed,
            capacity: self.alloc.num_free(),
        }
    }

    /// Appends `k`, `v` (`[n_tokens, num_kv_heads, head_dim]`) at `layer`'s next free
    /// position of sequence `id`, allocating and copying blocks as needed; returns the
    /// start position. All or nothing: `CacheFull` when the free blocks do not suffice.
    pub fn append(&mut self, id: SeqId, layer: i64, k: &TensorRef, v: &TensorRef) -> Result<usize> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let n = token_count("k", k, sh)?;
        v.expect_shape("v", &[n, sh.num_kv_heads, sh.head_dim])?;
        let s = self.seq(id)?;
        let start = s.layer_len[layer];
        let end = start + n;
        let needed = self.blocks_needed(s, start, end);
        if needed > self.alloc.num_free() {
            return Err(self.cache_full(
                format!("appending {n} tokens to layer {layer} at position {start}"),
                needed,
            ));
        }
        self.prepare_write(id, start, end)?;
        let blocks = self.seqs[&id].blocks.clone();
        self.write_positions(&blocks, layer, start, k, v)?;
        self.seqs.get_mut(&id).expect("live").layer_len[layer] = end;
        Ok(start)
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

    /// Commits `n` tokens of sequence `id`; every layer must already hold them.
    pub fn advance(&mut self, id: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        let s = self.seq(id)?;
        let target = s.seq_len + n;
        if let Some((layer, &held)) = s.layer_len.iter().enumerate().find(|(_, &l)| l < target) {
            return Err(KvError::InvalidArgument {
                name: "n",
                value: n.to_string(),
                reason: format!(
                    "committing to seq_len {target} needs every layer to hold {target} positions, \
                     but layer {layer} holds {held}; append to it first"
                ),
            });
        }
        self.seqs.get_mut(&id).expect("live").seq_len = target;
        Ok(())
    }

    /// Cuts sequence `id` to its first `len` positions in every layer (and the committed
    /// length), releasing the blocks past them.
    pub(crate) fn cut_to(&mut self, id: SeqId, len: usize) {
        let bs = self.shape.block_size;
        let s = self.seqs.get_mut(&id).expect("live");
        s.seq_len = s.seq_len.min(len);
        s.layer_len.iter_mut().for_each(|l| *l = (*l).min(len));
        let keep = s.held().div_ceil(bs);
        let dropped: Vec<BlockId> = s.blocks.drain(keep..).collect();
        dropped.iter().for_each(|&b| self.alloc.release(b));
    }

    /// Drops positions `>= n`; a no-op when `n >= seq_len` (as [`crate::KVCache::truncate`]).
    pub fn truncate(&mut self, id: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        if n < self.seq(id)?.seq_len {
            self.cut_to(id, n);
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
            return Err(KvError::NotSupported(format!(
                "removing positions [{begin}, {end}) from the middle of a sequence of {held} needs later \
                 positions shifted and their keys re-rotated; give the pool a RoPE description (not yet available) \
                 or remove a tail (end=None)"
            )));
        }
        self.cut_to(id, begin);
        Ok(())
    }

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
        if needed > self.alloc.num_free() {
            let total: usize = plan.iter().map(|p| p.2).sum();
            return Err(self.cache_full(
                format!("reserving {total} tokens for {} sequences", ids.len()),
                needed,
            ));
        }
        let bs = self.shape.block_size;
        let mut slots = Vec::with_capacity(plan.iter().map(|p| p.2).sum());
        for (id, start, c) in plan {
            self.prepare_write(id, start, start + c)?;
            let s = self.seqs.get_mut(&id).expect("live");
            s.layer_len.fill(start + c);
            slots.extend(
                (start..start + c).map(|p| (s.blocks[p / bs] as usize * bs + p % bs) as i64),
            );
        }
        Ok(slots)
    }

    /// Scatters `k`, `v` (`[n_tokens, heads, head_dim]`) into `slots` (vLLM's
    /// `reshape_and_cache`; slot `-1` skips the token). Every slot must lie in a block
    /// that exactly one sequence holds (reserve positions first).
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
            let b = check_index("slot_mapping", slot, limit)? / sh.block_size;
            let refs = self.alloc.refcount(b as BlockId);
            if refs != 1 {
                return Err(KvError::InvalidArgument {
                    name: "slot_mapping",
                    value: slot.to_string(),
                    reason: if refs == 0 {
                        format!("block {b} is free; reserve() the positions first")
                    } else {
                        format!("block {b} is shared by {refs} sequences; reserve() the positions first (copy-on-write)")
                    },
                });
            }
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

    /// Occupancy: blocks, bytes and exact token counts.
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
        let used = self.shape.num_blocks - self.alloc.num_free();
        let tokens: usize = fill.iter().sum();
        PoolStats {
            num_blocks: self.shape.num_blocks,
            free_blocks: self.alloc.num_free(),
            used_blocks: used,
            block_size: bs,
            bytes_total: self.storage.nbytes(),
            bytes_used: used * self.bytes_per_block(),
            tokens_stored: tokens,
            fragmentation_tokens: used * bs - tokens,
            utilization_ratio: tokens as f64 / (self.shape.num_blocks * bs) as f64,
            num_sequences: self.seqs.len(),
        }
    }

    /// Checks every invariant: reference counts equal block-table occurrences, the free
    /// list is exact, tables cover exactly the held positions, `seq_len` never exceeds a
    /// layer's length. For tests; O(blocks + sequences).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.alloc.check()?;
        let mut refs = vec![0u32; self.shape.num_blocks];
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
                    "block {b} is in {r} tables but counts {} references",
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
