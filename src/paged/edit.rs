//! Writing a sequence: appends with copy-on-write, commits (`advance`), cuts
//! (`truncate`, `set_seq_len`), the `CacheCore` block layout (`inject_block`,
//! `extract_block`) and copies to and from a contiguous cache.

use super::pool::{PoolCore, SeqId};
use super::seq::{SeqState, NO_BLOCK};
use crate::error::{check_count, check_index, check_tokens, KvError, Result, Unit};
use crate::kv_cache::{commit_target, CacheCore, Kv};
use crate::layout::{BlockId, PagedShape};
use crate::scales::with_divided;
use crate::storage::PagedTensor;
use crate::tensor::{check_disjoint, expect_block_pair, TensorMut, TensorRef};

impl PoolCore {
    /// Whether writing into block `b` needs a private copy first: it is shared, or it
    /// is cached (cached blocks are immutable).
    fn needs_copy(&self, b: BlockId) -> bool {
        !self.blocks.is_private(b)
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
    /// or cached blocks (copy-on-write; every copy of the call in one
    /// [`Self::batch_copies`]), fills released entries and appends new blocks. The caller
    /// has checked with [`Self::group_blocks_needed`] that blocks suffice.
    pub(crate) fn prepare_group(&mut self, id: SeqId, g: usize, start: usize, end: usize) {
        if start >= end {
            return;
        }
        self.batch_copies(|pool| {
            let bs = pool.shape.block_size;
            let mut blocks = std::mem::take(&mut pool.seq_mut(id).tables[g].blocks);
            for i in start / bs..end.div_ceil(bs).min(blocks.len()) {
                let old = blocks[i];
                if old == NO_BLOCK {
                    blocks[i] = pool.take_block();
                } else if pool.needs_copy(old) {
                    let new = pool.take_block();
                    pool.copy_block(old, new);
                    pool.release_block(old);
                    blocks[i] = new;
                }
            }
            while blocks.len() < end.div_ceil(bs) {
                blocks.push(pool.take_block());
            }
            pool.seq_mut(id).tables[g].blocks = blocks;
        })
    }

    /// [`Self::prepare_group`] for every group, the copies of all in one batch.
    pub(crate) fn prepare_write(&mut self, id: SeqId, start: usize, end: usize) {
        self.batch_copies(|pool| {
            for g in 0..pool.groups.groups.len() {
                pool.prepare_group(id, g, start, end);
            }
        })
    }

    pub(crate) fn ensure_room(&self, needed: usize, what: impl FnOnce() -> String) -> Result<()> {
        if needed > self.num_free_blocks() {
            return Err(KvError::CacheFull {
                what: what(),
                needed,
                free: self.num_free_blocks(),
                capacity: self.shape.num_blocks,
                unit: Unit::Blocks,
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
        value_count(v, sh)?;
        v.expect_shape("v", &[n, sh.num_kv_heads, sh.v_head_dim])?;
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
        keys: &[usize],
        values: &[usize],
    ) -> Result<(usize, usize, usize)> {
        let (layer, start, n) = self.check_block_args(layer, start_pos, block_size)?;
        let sh = self.shape;
        expect_block_pair(
            keys,
            values,
            [
                [sh.num_kv_heads, n, sh.head_dim],
                [sh.num_kv_heads, n, sh.v_head_dim],
            ],
        )?;
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
        let (ks, vs) = (
            self.scales.heads(layer, Kv::Key),
            self.scales.heads(layer, Kv::Value),
        );
        let (bs, end) = (self.shape.block_size, start + k.shape()[0]);
        for i in start / bs..end.div_ceil(bs) {
            if let Some(&b) = blocks.get(i).filter(|&&b| b != NO_BLOCK) {
                self.blocks.wrote(b, end.min((i + 1) * bs) - i * bs);
            }
        }
        let before = self.storage.saturated();
        let storage = &mut self.storage;
        let written = with_divided(storage.scaler(), [(k, ks), (v, vs)], 1, |[k, v]| {
            storage.write_positions(t, blocks, start, k, v)
        });
        self.count_saturated(layer, before);
        written
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
        let s = self.seq_mut(id);
        s.seq_len = target;
        // Committed by a statement that the K/V are there: claims below are written.
        if s.claimed_from < target {
            s.claimed_from = if s.held() > target {
                target
            } else {
                usize::MAX
            };
        }
        self.register_blocks(id);
        self.trim(id);
        self.checkpoint_commit(id, start);
        Ok(())
    }

    /// Cuts sequence `id` to its first `len` positions in every layer (and the committed
    /// length), releasing the blocks past them; `cut_tokens` also forgets token ids there.
    pub(crate) fn cut_to(&mut self, id: SeqId, len: usize, cut_tokens: bool) {
        let bs = self.shape.block_size;
        let s = self.seq_mut(id);
        s.edited();
        s.seq_len = s.seq_len.min(len);
        s.layer_len.iter_mut().for_each(|l| *l = (*l).min(len));
        s.hashes.truncate(s.seq_len / bs);
        if s.cache_limit >= len {
            // The positions that could not be cached are gone; what comes next is written.
            s.cache_limit = usize::MAX;
        }
        if s.claimed_from >= len {
            s.claimed_from = usize::MAX;
        }
        if cut_tokens {
            s.tokens.truncate(len);
        }
        for g in 0..self.groups.groups.len() {
            self.normalize_table(id, g);
        }
    }

    /// Drops positions `>= n`; a no-op when `n >= seq_len` (as [`crate::kv_cache::CacheCore::truncate`]).
    pub fn truncate(&mut self, id: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        if n < self.seq(id)?.seq_len {
            let restore = self.restore_for(id, n, "truncate")?;
            self.cut_to(id, n, true);
            self.apply_restore(id, restore);
        }
        Ok(())
    }

    /// Sets the committed length and every layer's length to `n`, growing or shrinking
    /// the block table; then caches the full blocks whose token ids are known. For
    /// callers that inject blocks kept elsewhere ([`Self::inject_block`] every layer, then
    /// this). Positions a layer gains without a write read as zeros, and the blocks they
    /// lie in are never cached: only K/V a holder wrote joins the prefix cache.
    pub fn set_seq_len(&mut self, id: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        let restore = self.restore_for(id, n, "set_seq_len")?;
        let s = self.seq(id)?;
        // Positions some layer gains: from its shortest layer's end (after a cut to n).
        let low = s.layer_len.iter().copied().min().unwrap_or(0).min(n);
        if low < n {
            self.ensure_room(self.blocks_needed(s, low, n), || {
                format!("growing sequence {id} to {n} positions")
            })?;
        }
        if n < s.held() {
            self.cut_to(id, n, true);
        }
        if low < n {
            // Private blocks first (copy-on-write), then zero what no write reached.
            self.prepare_write(id, low, n);
            let lens = self.seq(id)?.layer_len.clone();
            for (layer, &len) in lens.iter().enumerate() {
                self.zero_positions(id, layer, len, n)?;
            }
            let s = self.seq_mut(id);
            s.cache_limit = s.cache_limit.min(low);
        }
        let bs = self.shape.block_size;
        let s = self.seq_mut(id);
        s.edited();
        // Reserved positions committed here were never stated written (as `advance`
        // does): they stay out of the prefix cache.
        if s.claimed_from < n {
            s.cache_limit = s.cache_limit.min(s.claimed_from);
        }
        s.claimed_from = usize::MAX;
        s.layer_len.fill(n);
        s.seq_len = n;
        s.hashes.truncate(n / bs);
        self.apply_restore(id, restore);
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
        let (layer, start, n) =
            self.block_args(layer, start_pos, block_size, keys.shape(), values.shape())?;
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
        // Positions between the layer's end and the block are claimed unwritten: they
        // are made private and zeroed with it.
        let len = s.layer_len[layer];
        let from = start.min(len.max(held_from));
        self.ensure_room(self.group_blocks_needed(s, g, from, start + n), || {
            format!("injecting {n} positions at {start}")
        })?;
        self.prepare_group(id, g, from, start + n);
        self.write_seq(
            id,
            layer,
            start,
            &keys.transposed(0, 1),
            &values.transposed(0, 1),
        )?;
        if from < start {
            self.zero_positions(id, layer, from, start)?;
            let s = self.seq_mut(id);
            s.cache_limit = s.cache_limit.min(from);
        }
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
        keys: &mut TensorMut,
        values: &mut TensorMut,
    ) -> Result<()> {
        let (layer, start, n) =
            self.block_args(layer, start_pos, block_size, keys.shape(), values.shape())?;
        check_disjoint(("keys", keys), ("values", values))?;
        let s = self.seq(id)?;
        let t = &s.tables[self.groups.group_of[layer]];
        let (lo, hi) = (t.start.max(start), s.layer_len[layer].min(start + n));
        for mut out in [keys.reborrow(), values.reborrow()] {
            // The caller's [H, n, D] tensor, zeroed before the held part is read.
            self.storage.zero(&mut out)?;
        }
        if lo < hi {
            let (mut k, mut v) = (
                keys.slice(1, lo - start, hi - lo),
                values.slice(1, lo - start, hi - lo),
            );
            self.read_positions(&t.blocks, layer, lo, hi - lo, &mut k, &mut v)?;
        }
        Ok(())
    }

    /// Fills empty sequence `id` with the content of `cache`: every layer's positions and
    /// lengths, and its committed length.
    pub fn copy_from_cache(&mut self, id: SeqId, cache: &CacheCore) -> Result<()> {
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
    pub fn copy_to_cache(&self, id: SeqId, cache: &mut CacheCore) -> Result<()> {
        let sh = self.shape;
        check_same_shape(sh, cache)?;
        let s = self.seq(id)?;
        let max = cache.shape().max_seq_len;
        if s.held() > max {
            return Err(KvError::CacheFull {
                what: format!("copying sequence {id} into a KVCache"),
                needed: s.held(),
                free: max,
                capacity: max,
                unit: Unit::Positions,
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
            let (mut k, mut v) = cache.host_tensors_mut(layer, len)?;
            let t = &s.tables[self.groups.group_of[layer]];
            self.read_positions(&t.blocks, layer, 0, len, &mut k, &mut v)?;
        }
        cache.set_lengths(s.seq_len, &s.layer_len);
        Ok(())
    }
}

fn check_same_shape(sh: PagedShape, cache: &CacheCore) -> Result<()> {
    let c = cache.shape();
    let of_cache = (c.num_layers, c.num_kv_heads, c.head_dim, c.v_head_dim);
    if of_cache != (sh.num_layers, sh.num_kv_heads, sh.head_dim, sh.v_head_dim) {
        return Err(KvError::InvalidArgument {
            name: "cache",
            value: format!(
                "{} layers x {} heads x {} (values {})",
                c.num_layers, c.num_kv_heads, c.head_dim, c.v_head_dim
            ),
            reason: format!(
                "must match the pool's {} layers x {} heads x {} (values {})",
                sh.num_layers, sh.num_kv_heads, sh.head_dim, sh.v_head_dim
            ),
        });
    }
    Ok(())
}

/// Checks that `t` is `[n, heads, head_dim]` and returns `n`.
pub(crate) fn token_count(name: &'static str, t: &TensorRef, sh: PagedShape) -> Result<usize> {
    check_tokens(name, t.shape(), sh.num_kv_heads, sh.head_dim)
}

/// Checks that `v` is `[n, heads, v_head_dim]` and returns `n`.
pub(crate) fn value_count(v: &TensorRef, sh: PagedShape) -> Result<usize> {
    check_tokens("v", v.shape(), sh.num_kv_heads, sh.v_head_dim)
}
