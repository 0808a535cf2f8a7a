//! Accounting and self-checks: exact occupancy per pool and per layer kind
//! ([`PoolStats`], [`KindStats`], [`StateStats`]), and the invariants tests verify after every step.

use super::groups::LayerKind;
use super::pool::PoolCore;
use super::seq::NO_BLOCK;
use crate::prefix::{PrefixCounters, PrefixIndex};

/// Memory held by the layers of one kind (see [`PoolCore::stats`]).
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

/// Occupancy of the pool (see [`PoolCore::stats`]).
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
    /// Elements each layer's writes saturated, K and V together, since the pool was
    /// made ([`PoolCore::saturated`]); `None` where nothing is counted (pools of
    /// other dtypes than fp8, device pools).
    pub fp8_saturated: Option<Vec<u64>>,
    /// The recurrent state slots of a pool with state layers.
    pub states: Option<StateStats>,
}

/// Recurrent state slots of a pool with state layers (see `paged::states`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateStats {
    /// State layers.
    pub layers: usize,
    /// Slots in all.
    pub slots: usize,
    /// Slots no sequence holds.
    pub free_slots: usize,
    /// Bytes of one slot (every state of every state layer).
    pub slot_bytes: usize,
    /// Checkpoint slots in all (0 without prefix caching).
    pub checkpoints: usize,
    /// Checkpoint slots in use: held by sequences, or cached.
    pub checkpoints_used: usize,
    /// Checkpoints cached (found by prefix hits).
    pub checkpoints_cached: usize,
    /// Checkpoints taken, skipped (every slot held), restored by hits, evicted.
    pub counters: super::checkpoints::CheckpointCounters,
}

impl StateStats {
    /// Bytes of every slot, checkpoint slots included (each as big as a state slot).
    pub fn bytes_total(&self) -> usize {
        (self.slots + self.checkpoints) * self.slot_bytes
    }

    /// Bytes of the slots sequences hold and the checkpoint slots in use.
    pub fn bytes_used(&self) -> usize {
        (self.slots - self.free_slots + self.checkpoints_used) * self.slot_bytes
    }
}

impl PoolCore {
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
        for (b, _) in self.blocks.pins() {
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
        let ck = self.checkpoints.as_ref();
        let states = self.states.as_ref().map(|a| StateStats {
            layers: a.config().layers,
            slots: a.config().slots,
            free_slots: a.free_slots(),
            slot_bytes: a.config().slot_bytes(),
            checkpoints: ck.map_or(0, |i| i.capacity()),
            checkpoints_used: ck.map_or(0, |i| i.capacity() - i.num_free()),
            checkpoints_cached: ck.map_or(0, |i| i.num_published()),
            counters: ck.map(|i| i.counters).unwrap_or_default(),
        });
        let (state_total, state_used) = states
            .as_ref()
            .map_or((0, 0), |s| (s.bytes_total(), s.bytes_used()));
        PoolStats {
            num_blocks: self.shape.num_blocks,
            free_blocks: free,
            used_blocks: used,
            block_size: bs,
            bytes_total: self.storage.nbytes() + state_total,
            bytes_used: used * self.bytes_per_block() + state_used,
            tokens_stored: tokens,
            fragmentation_tokens: used * bs - tokens,
            utilization_ratio: tokens as f64 / (self.shape.num_blocks * bs) as f64,
            num_sequences: self.seqs.len(),
            cached_blocks: self.prefix().map_or(0, PrefixIndex::len),
            evictable_blocks: self.blocks.num_evictable(),
            prefix: self.blocks.counters(),
            by_kind,
            fp8_saturated: self.saturated(),
            states,
        }
    }

    /// Checks every invariant: reference counts equal block-table occurrences plus pins,
    /// the free list and the eviction order are exact, the prefix index is consistent,
    /// each table holds a block exactly where it covers a held position, full groups
    /// start at 0, `seq_len` never exceeds a layer's length. For tests; O(blocks + sequences).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let bs = self.shape.block_size;
        let mut refs = vec![0u32; self.shape.num_blocks];
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
                    let end = ((i + 1) * bs).min(held) - i * bs;
                    if covers && end > self.blocks.written_end(b) {
                        return Err(format!(
                            "sequence {id} holds {end} positions of block {b}, whose written end is {}",
                            self.blocks.written_end(b)
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
        if let Some(a) = &self.states {
            let held: Vec<u32> = self.seqs.values().filter_map(|s| s.state_slot).collect();
            if held.len() != self.seqs.len() {
                return Err("a live sequence of a pool with state layers has no state slot".into());
            }
            a.check(&held)?;
        }
        if let Some(index) = &self.checkpoints {
            index.check(&self.checkpoint_holders())?;
            for (id, s) in &self.seqs {
                for &(p, c) in &s.checkpoints {
                    let at = index.entry(c).map(|e| e.position);
                    if at != Some(p) || p > s.seq_len {
                        return Err(format!(
                            "sequence {id} of {} positions holds checkpoint slot {c} at {p}, which holds {at:?}",
                            s.seq_len
                        ));
                    }
                }
            }
        }
        self.blocks.check(&refs)
    }
}
