//! What a kernel needs from a pool: reserved slots (vLLM's slot mapping), the scatter
//! into slots, FlashInfer's page table and padded block tables, per layer group.

use rustc_hash::FxHashSet;

use super::edit::{token_count, value_count};
use super::pool::{PoolCore, SeqId};
use super::seq::{SeqState, NO_BLOCK};
use crate::error::{check_count, check_index, KvError, Result};
use crate::layout::BlockId;
use crate::layout::Kv;
use crate::scales::with_divided;
use crate::storage::LayerRows;
use crate::tensor::TensorRef;

impl PoolCore {
    /// Reserves positions for `counts[i]` new tokens at the end of each sequence, all or
    /// nothing, and returns their slots (`block * block_size + offset`): one run of
    /// `sum(counts)` slots per layer group, groups in order, tokens in sequence order.
    /// The positions become part of every layer (fill them with [`Self::write`], or a
    /// kernel writes them through the slots) and are committed with [`Self::advance`].
    /// They read as zeros until written: a block never shows what its previous holder
    /// left there.
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
            let blocks = self.blocks_needed(s, start, start + c);
            needed += blocks;
            plan.push((id, start, c, blocks));
        }
        let total: usize = plan.iter().map(|p| p.2).sum();
        self.ensure_room(needed, || {
            format!("reserving {total} tokens for {} sequences", ids.len())
        })?;
        let (ng, bs) = (self.groups.groups.len(), self.shape.block_size);
        let mut slots = vec![0i64; ng * total];
        // Every copy-on-write of every sequence in one batch (one launch on a CUDA pool),
        // made before the reserved slots are zeroed below.
        self.batch_copies(|pool| {
            let mut at = 0;
            for (id, start, c, blocks) in plan {
                if blocks > 0 {
                    // Otherwise the tables already hold writable blocks there (most decode steps).
                    pool.prepare_write(id, start, start + c);
                }
                let s = pool.seq_mut(id);
                s.layer_len.fill(start + c);
                if c > 0 {
                    s.claimed_from = s.claimed_from.min(start);
                }
                for (g, t) in s.tables.iter().enumerate() {
                    let row = &mut slots[g * total + at..g * total + at + c];
                    for (out, p) in row.iter_mut().zip(start..) {
                        *out = slot(t.blocks[p / bs], p, bs);
                    }
                }
                at += c;
            }
        });
        // Zero what the claimed positions may still hold (see BlockLedger: from the first
        // claimed position of each block to the end of what the block may hold).
        let mut zero: Vec<Vec<i64>> = vec![Vec::new(); ng];
        for (g, run) in slots.chunks_exact(total.max(1)).enumerate() {
            for claim in run.chunk_by(|a, b| a / bs as i64 == b / bs as i64) {
                let (first, last) = (claim[0] as usize, claim[claim.len() - 1] as usize);
                let b = first / bs;
                if let Some(r) = self.blocks.claim(b as BlockId, first % bs, last % bs + 1) {
                    zero[g].extend(r.map(|o| (b * bs + o) as i64));
                }
            }
        }
        for layer in 0..self.shape.num_layers {
            let g = self.groups.group_of[layer];
            if !zero[g].is_empty() {
                let t = self.paged_tensor(layer);
                self.storage.zero_slots(t, &zero[g])?;
            }
        }
        Ok(slots)
    }

    /// Zeroes positions `from..to` of `layer` of sequence `id` (held, writable): what a
    /// holder claims without writing it reads as zeros, never as an earlier holder's K/V.
    pub(crate) fn zero_positions(
        &mut self,
        id: SeqId,
        layer: usize,
        from: usize,
        to: usize,
    ) -> Result<()> {
        if from >= to {
            return Ok(());
        }
        let bs = self.shape.block_size;
        let t = &self.seq(id)?.tables[self.groups.group_of[layer]];
        let slots: Vec<i64> = (from..to)
            .map(|p| match t.blocks[p / bs] {
                NO_BLOCK => -1,
                b => slot(b, p, bs),
            })
            .collect();
        let tensor = self.paged_tensor(layer);
        self.storage.zero_slots(tensor, &slots)?;
        // The positions are the holder's now: what it writes there later is K/V.
        self.note_written(&slots);
        Ok(())
    }

    /// Records in the ledger that `slots` (`-1`: none) may hold K/V from now on.
    pub(crate) fn note_written(&mut self, slots: &[i64]) {
        let bs = self.shape.block_size;
        for &slot in slots.iter().filter(|&&s| s >= 0) {
            let slot = slot as usize;
            self.blocks.wrote((slot / bs) as BlockId, slot % bs + 1);
        }
    }

    /// Scatters `k`, `v` (`[n_tokens, heads, head_dim]`) into `slots` of `layer`'s group
    /// (vLLM's `reshape_and_cache`; slot `-1` skips the token). Every slot must lie in a
    /// block that exactly one sequence holds and that is not cached (reserve positions
    /// first).
    pub fn write(&mut self, layer: i64, k: &TensorRef, v: &TensorRef, slots: &[i64]) -> Result<()> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let n = token_count("k", k, sh)?;
        value_count(v, sh)?;
        v.expect_shape("v", &[n, sh.num_kv_heads, sh.v_head_dim])?;
        if slots.len() != n {
            return Err(KvError::Shape {
                name: "slot_mapping",
                got: vec![slots.len()],
                expected: format!("[{n}] (one per token)"),
            });
        }
        self.check_write_slots(slots)?;
        self.note_written(slots);
        let t = self.paged_tensor(layer);
        let (ks, vs) = (
            self.scales.heads(layer, Kv::Key),
            self.scales.heads(layer, Kv::Value),
        );
        let before = self.storage.saturated();
        let storage = &mut self.storage;
        let written = with_divided(storage.scaler(), [(k, ks), (v, vs)], 1, |[k, v]| {
            storage.write_slots(t, slots, k, v)
        });
        self.count_saturated(layer, before);
        written
    }

    /// [`Self::write`] of every layer at once: `k[l]`, `v[l]` are layer `l`'s rows
    /// (`[n_tokens, heads, head_dim]`, one entry per layer), written at `slots`: one run
    /// of `n_tokens` slots for every layer, or one run per layer group (a layer uses its
    /// group's), as [`Self::reserve`] returns them. Everything is checked before anything
    /// is written; a CUDA pool writes all layers in one launch (without fp8 scales).
    pub fn write_layers(&mut self, k: &[TensorRef], v: &[TensorRef], slots: &[i64]) -> Result<()> {
        let sh = self.shape;
        for (name, x) in [("k", k), ("v", v)] {
            if x.len() != sh.num_layers {
                return Err(KvError::Shape {
                    name,
                    got: vec![x.len()],
                    expected: format!(
                        "[{}, n_tokens, {}, {}] (every layer)",
                        sh.num_layers,
                        sh.num_kv_heads,
                        if name == "k" {
                            sh.head_dim
                        } else {
                            sh.v_head_dim
                        }
                    ),
                });
            }
        }
        let Some(first) = k.first() else {
            return Ok(());
        };
        let n = token_count("k", first, sh)?;
        for (name, x) in [("k", k), ("v", v)] {
            let d = if name == "k" {
                sh.head_dim
            } else {
                sh.v_head_dim
            };
            for t in x {
                t.expect_shape(name, &[n, sh.num_kv_heads, d])?;
            }
        }
        let ng = self.groups.groups.len();
        let rows = match slots.len() {
            len if len == n => 1,
            len if len == ng * n => ng,
            len => {
                return Err(KvError::Shape {
                    name: "slot_mapping",
                    got: vec![len],
                    expected: format!(
                        "[{n}] or [{ng}, {n}] (one per token, or one run per layer group)"
                    ),
                })
            }
        };
        self.check_write_slots(slots)?;
        self.note_written(slots);
        let row = |layer: usize| {
            let g = if rows == 1 {
                0
            } else {
                self.groups.group_of[layer]
            };
            &slots[g * n..(g + 1) * n]
        };
        if !self.scales.is_unit() || self.storage.saturated().is_some() {
            // Each layer divided by its own scales, then written, and its saturated
            // elements counted (what the storage's write_layers does on the host).
            for layer in 0..sh.num_layers {
                let t = self.paged_tensor(layer);
                let (ks, vs) = (
                    self.scales.heads(layer, Kv::Key),
                    self.scales.heads(layer, Kv::Value),
                );
                let slots = row(layer);
                let before = self.storage.saturated();
                let storage = &mut self.storage;
                let written = with_divided(
                    storage.scaler(),
                    [(&k[layer], ks), (&v[layer], vs)],
                    1,
                    |[k, v]| storage.write_slots(t, slots, k, v),
                );
                super::pool::add_saturated(&mut self.saturated, &*self.storage, layer, before);
                written?;
            }
            return Ok(());
        }
        let layers: Vec<LayerRows> = (0..sh.num_layers)
            .map(|layer| LayerRows {
                tensor: self.paged_tensor(layer),
                slots: row(layer),
                k: k[layer],
                v: v[layer],
            })
            .collect();
        self.storage.write_layers(&layers)
    }

    /// Fails unless every slot is -1 or lies in a block that exactly one sequence holds
    /// and that is not cached: what a write by slot may touch.
    fn check_write_slots(&self, slots: &[i64]) -> Result<()> {
        let sh = self.shape;
        let limit = sh.num_blocks * sh.block_size;
        for &slot in slots {
            if slot == -1 {
                continue;
            }
            let b = (check_index("slot_mapping", slot, limit)? / sh.block_size) as BlockId;
            let refs = self.blocks.refcount(b);
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
        Ok(())
    }

    /// FlashInfer's page table of group `g` for `ids`: `(indptr [B+1], indices,
    /// last_page_len [B])` over the blocks each sequence holds there (a sliding group's
    /// pages start at its first held block; a sequence with no page has `last_page_len` 0).
    pub fn page_table(&self, ids: &[SeqId], g: usize) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let bs = self.shape.block_size;
        let layers = &self.groups.groups[g].layers;
        let mut indptr = Vec::with_capacity(ids.len() + 1);
        let mut indices = Vec::new();
        let mut last = Vec::with_capacity(ids.len());
        indptr.push(0);
        for &id in ids {
            let s = self.seq(id)?;
            let t = &s.tables[g];
            let held = s.held_by(layers);
            // Every entry from the first held position's block on holds a block.
            if t.start < held {
                indices.extend(t.blocks[t.first_entry(bs)..].iter().map(|&b| b as i32));
                last.push(((held - 1) % bs + 1) as i32);
            } else {
                last.push(0);
            }
            indptr.push(indices.len() as i32);
        }
        Ok((indptr, indices, last))
    }

    /// Block tables of group `g` for `ids` as rows of a `[batch, max_blocks]` matrix,
    /// entry `i` covering positions `i * block_size..`, padded (and released entries
    /// filled) with `pad`.
    pub fn block_tables(&self, ids: &[SeqId], g: usize, pad: i32) -> Result<(Vec<i32>, usize)> {
        let states: Vec<&SeqState> = ids.iter().map(|&id| self.seq(id)).collect::<Result<_>>()?;
        let width = states
            .iter()
            .map(|s| s.tables[g].blocks.len())
            .max()
            .unwrap_or(0);
        let mut out = vec![pad; width * ids.len()];
        for (row, s) in states.iter().enumerate() {
            for (j, &b) in s.tables[g].blocks.iter().enumerate() {
                if b != NO_BLOCK {
                    out[row * width + j] = b as i32;
                }
            }
        }
        Ok((out, width))
    }
}

fn slot(block: BlockId, pos: usize, block_size: usize) -> i64 {
    (block as usize * block_size + pos % block_size) as i64
}
