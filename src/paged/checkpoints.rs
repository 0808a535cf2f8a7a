//! State checkpoints: copies of a sequence's recurrent state (every state of every state
//! layer) at a token position, kept in their own slots of the state arena and cached
//! beside the blocks, so that a hybrid model's prefix hit restores the state of exactly
//! the hit's length.
//!
//! A checkpoint at position `p` of a sequence is keyed by its *anchor*, the chain hash of
//! the whole blocks before `p` (the namespace's root before the first block) mixed with
//! the extra key, and its *run*, the token ids from the last block boundary to `p`
//! (`p % block_size` of them; none at a boundary). Anchor and run name the same token
//! prefix in the same namespace with the same extra key and pool seed as a block chain
//! does, at any token position.
//!
//! This module keeps who holds each checkpoint slot and which are cached; the pool
//! ([`super::checkpointing`]) decides when to take, publish, restore and drop them.
//!
//! Invariants (checked by [`CheckpointIndex::check`]):
//! - a slot is free (in the free list, no entry), or it has an entry: held by
//!   sequences (`refs > 0`) or published, and in the LRU order exactly when published
//!   and unreferenced;
//! - a published entry is filed under its anchor once, with a run no other published
//!   entry of that anchor has; an unpublished entry is filed nowhere;
//! - a published checkpoint is immutable: the pool writes a slot only while its entry
//!   is unpublished and held by the one sequence that took it.

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::prefix::lru::Lru;
use crate::prefix::BlockHash;

/// A checkpoint slot (0-based among the checkpoint slots).
pub type CheckpointSlot = u32;

/// What the index knows of a checkpoint slot in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointEntry {
    /// The chain hash of the whole blocks before the position (the chain's root before
    /// the first block).
    pub anchor: BlockHash,
    /// The digest of the sequence's extra key (0 for none): part of the key, since a
    /// root does not carry it.
    pub extra: u128,
    /// The token ids from the last block boundary to the position.
    pub run: SmallVec<[u32; 16]>,
    /// The token position whose state the slot holds.
    pub position: usize,
    /// The chain root (namespace) it belongs to: where the tiers file it.
    pub root: BlockHash,
    /// References from sequences (the one that took it, until it publishes it or lets
    /// it go).
    pub refs: u32,
    /// Whether it is cached: filed under its anchor, found by prefix hits.
    pub published: bool,
}

/// Counters of checkpoints (see the pool's `stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckpointCounters {
    /// Checkpoints taken.
    pub taken: u64,
    /// Checkpoints not taken because every slot was held.
    pub skipped: u64,
    /// Prefix hits that restored a checkpoint.
    pub hits: u64,
    /// Published checkpoints dropped to make room, or because a block they need left
    /// the cache.
    pub evictions: u64,
}

/// The checkpoint slots of a pool: their entries, the published ones by anchor, and the
/// eviction order of those no sequence holds.
#[derive(Debug)]
pub struct CheckpointIndex {
    entries: Vec<Option<CheckpointEntry>>,
    free: Vec<CheckpointSlot>,
    by_anchor: FxHashMap<BlockHash, SmallVec<[CheckpointSlot; 2]>>,
    lru: Lru,
    /// Taken, skipped, hit and evicted counts.
    pub counters: CheckpointCounters,
}

impl CheckpointIndex {
    /// `slots` free checkpoint slots.
    pub fn new(slots: usize) -> crate::error::Result<Self> {
        let mut free = crate::sizes::with_capacity("the checkpoint slots", slots)?;
        free.extend((0..slots as CheckpointSlot).rev());
        Ok(CheckpointIndex {
            entries: crate::sizes::filled("the checkpoint entries", slots, None)?,
            free,
            by_anchor: FxHashMap::default(),
            lru: Lru::new(slots)?,
            counters: CheckpointCounters::default(),
        })
    }

    /// Checkpoint slots in all.
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// Slots with no entry.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Published checkpoints (cached, held or not).
    pub fn num_published(&self) -> usize {
        self.by_anchor.values().map(SmallVec::len).sum()
    }

    /// The entry of `slot`, if in use.
    pub fn entry(&self, slot: CheckpointSlot) -> Option<&CheckpointEntry> {
        self.entries[slot as usize].as_ref()
    }

    /// The published checkpoint under `anchor` and `extra` whose run is the longest
    /// beginning of `tokens` no longer than `max` tokens, and that run's length.
    pub fn best(
        &self,
        anchor: BlockHash,
        extra: u128,
        tokens: &[u32],
        max: usize,
    ) -> Option<(CheckpointSlot, usize)> {
        self.by_anchor
            .get(&anchor)?
            .iter()
            .filter_map(|&c| {
                let e = self.entries[c as usize].as_ref()?;
                (e.extra == extra && e.run.len() <= max && tokens.starts_with(&e.run))
                    .then_some((c, e.run.len()))
            })
            .max_by_key(|&(_, n)| n)
    }

    /// The published checkpoint with exactly this key.
    pub fn find(&self, anchor: BlockHash, extra: u128, run: &[u32]) -> Option<CheckpointSlot> {
        self.by_anchor.get(&anchor)?.iter().copied().find(|&c| {
            self.entries[c as usize]
                .as_ref()
                .is_some_and(|e| e.extra == extra && *e.run == *run)
        })
    }

    /// Takes a free slot for `entry` (held once, unpublished); without a free slot,
    /// the least recently used published checkpoint no sequence holds leaves the cache
    /// for it (returned, with its slot, for the tiers). `None` (counted as skipped)
    /// when every slot is held.
    pub fn take(
        &mut self,
        entry: CheckpointEntry,
    ) -> Option<(CheckpointSlot, Option<CheckpointEntry>)> {
        let (slot, evicted) = match self.free.pop() {
            Some(s) => (s, None),
            None => match self.pop_evictable() {
                Some((s, e)) => (s, Some(e)),
                None => {
                    self.counters.skipped += 1;
                    return None;
                }
            },
        };
        self.entries[slot as usize] = Some(CheckpointEntry {
            refs: 1,
            published: false,
            ..entry
        });
        self.counters.taken += 1;
        Some((slot, evicted))
    }

    /// Removes the least recently used published, unreferenced checkpoint from the
    /// cache; its slot is the caller's (no entry, in no list).
    fn pop_evictable(&mut self) -> Option<(CheckpointSlot, CheckpointEntry)> {
        let slot = self.lru.pop_front()?;
        let e = self.unfile(slot);
        self.counters.evictions += 1;
        Some((slot, e))
    }

    /// Takes `slot`'s entry out of its anchor's list and the entries.
    fn unfile(&mut self, slot: CheckpointSlot) -> CheckpointEntry {
        let e = self.entries[slot as usize]
            .take()
            .expect("unfiling a slot in use");
        if e.published {
            let list = self.by_anchor.get_mut(&e.anchor).expect("filed");
            list.retain(|&mut c| c != slot);
            if list.is_empty() {
                self.by_anchor.remove(&e.anchor);
            }
        }
        e
    }

    /// Publishes held `slot`: filed under its anchor, found by later hits. False (and
    /// nothing changes) when a checkpoint of the same key is published already: the
    /// caller keeps holding its own, unpublished.
    pub fn publish(&mut self, slot: CheckpointSlot) -> bool {
        let e = self.entries[slot as usize].as_ref().expect("a slot in use");
        debug_assert!(e.refs > 0 && !e.published);
        if self.find(e.anchor, e.extra, &e.run).is_some() {
            return false;
        }
        let anchor = e.anchor;
        self.entries[slot as usize]
            .as_mut()
            .expect("in use")
            .published = true;
        self.by_anchor.entry(anchor).or_default().push(slot);
        true
    }

    /// Adds a reference to `slot` (a published one leaves the eviction order).
    pub fn hold(&mut self, slot: CheckpointSlot) {
        let e = self.entries[slot as usize].as_mut().expect("a slot in use");
        if e.refs == 0 {
            self.lru.remove(slot);
        }
        e.refs += 1;
    }

    /// Marks published `slot` as just used (a hit): last in the eviction order.
    pub fn touch(&mut self, slot: CheckpointSlot) {
        if self.lru.contains(slot) {
            self.lru.remove(slot);
            self.lru.push_back(slot);
        }
    }

    /// Drops a reference to `slot`: an unreferenced published checkpoint becomes
    /// evictable (most recently used), an unpublished one is freed.
    pub fn release(&mut self, slot: CheckpointSlot) {
        let e = self.entries[slot as usize].as_mut().expect("a slot in use");
        assert!(
            e.refs > 0,
            "releasing checkpoint slot {slot} with no reference"
        );
        e.refs -= 1;
        if e.refs == 0 {
            if e.published {
                self.lru.push_back(slot);
            } else {
                self.unfile(slot);
                self.free.push(slot);
            }
        }
    }

    /// Frees every published checkpoint under `anchor` that no sequence holds (a block
    /// they need left the cache); returns them, with their entries, for the tiers. Held
    /// ones stay published and go when released.
    pub fn drop_anchor(&mut self, anchor: BlockHash) -> Vec<(CheckpointSlot, CheckpointEntry)> {
        let Some(list) = self.by_anchor.get(&anchor) else {
            return Vec::new();
        };
        let idle: SmallVec<[CheckpointSlot; 2]> = list
            .iter()
            .copied()
            .filter(|&c| self.lru.contains(c))
            .collect();
        idle.into_iter()
            .map(|c| {
                self.lru.remove(c);
                let e = self.unfile(c);
                self.free.push(c);
                self.counters.evictions += 1;
                (c, e)
            })
            .collect()
    }

    /// Frees every published checkpoint no sequence holds; returns them for the tiers.
    pub fn evict_all(&mut self) -> Vec<(CheckpointSlot, CheckpointEntry)> {
        let mut out = Vec::new();
        while let Some((c, e)) = self.pop_evictable() {
            self.free.push(c);
            out.push((c, e));
        }
        out
    }

    /// Takes a slot to load a cached checkpoint into: a free one, else (with `evict`)
    /// the least recently used published checkpoint no sequence holds leaves the cache
    /// for it (returned, with its entry, for the tiers). The slot has no entry until
    /// [`Self::adopt_loaded`] (or goes back with [`Self::discard`]).
    pub fn take_for_loading(
        &mut self,
        evict: bool,
    ) -> Option<(CheckpointSlot, Option<CheckpointEntry>)> {
        match self.free.pop() {
            Some(s) => Some((s, None)),
            None if evict => self.pop_evictable().map(|(s, e)| (s, Some(e))),
            None => None,
        }
    }

    /// Publishes loaded `slot` as `entry`, unreferenced (evictable, most recently used);
    /// false (and the slot is freed) when its key is published already.
    pub fn adopt_loaded(&mut self, slot: CheckpointSlot, entry: CheckpointEntry) -> bool {
        if self.find(entry.anchor, entry.extra, &entry.run).is_some() {
            self.free.push(slot);
            return false;
        }
        let anchor = entry.anchor;
        self.entries[slot as usize] = Some(CheckpointEntry {
            refs: 0,
            published: true,
            ..entry
        });
        self.by_anchor.entry(anchor).or_default().push(slot);
        self.lru.push_back(slot);
        true
    }

    /// Returns a slot taken for loading to the free list.
    pub fn discard(&mut self, slot: CheckpointSlot) {
        self.free.push(slot);
    }

    /// Every published checkpoint: slots and entries (for saving and the tiers).
    pub fn published(&self) -> impl Iterator<Item = (CheckpointSlot, &CheckpointEntry)> + '_ {
        self.by_anchor.values().flatten().map(|&c| {
            (
                c,
                self.entries[c as usize]
                    .as_ref()
                    .expect("filed slots are in use"),
            )
        })
    }

    /// Every published checkpoint, least recently used first (those no sequence holds,
    /// in their eviction order, then the held ones): what a file saves.
    pub fn published_lru_first(&self) -> Vec<CheckpointSlot> {
        let mut out: Vec<CheckpointSlot> = self.lru.iter().collect();
        out.extend(
            self.published()
                .filter(|(c, _)| !self.lru.contains(*c))
                .map(|(c, _)| c),
        );
        out
    }

    /// Checks the entries against `held[c]`, the references the pool's sequences hold
    /// to each slot.
    pub fn check(&self, held: &[u32]) -> Result<(), String> {
        let mut free = vec![false; self.entries.len()];
        for &c in &self.free {
            if free[c as usize] || self.entries[c as usize].is_some() {
                return Err(format!("checkpoint slot {c} is free twice or in use"));
            }
            free[c as usize] = true;
        }
        let mut filed = 0;
        for (anchor, list) in &self.by_anchor {
            for (i, &c) in list.iter().enumerate() {
                let Some(e) = self.entries[c as usize].as_ref().filter(|e| e.published) else {
                    return Err(format!("checkpoint slot {c} is filed but not published"));
                };
                if e.anchor != *anchor
                    || list[..i].iter().any(|&o| {
                        self.entries[o as usize]
                            .as_ref()
                            .is_some_and(|x| x.run == e.run && x.extra == e.extra)
                    })
                {
                    return Err(format!("checkpoint slot {c} is filed under the wrong key"));
                }
                filed += 1;
            }
        }
        for (c, e) in self.entries.iter().enumerate() {
            let Some(e) = e else {
                if !free[c] {
                    return Err(format!("checkpoint slot {c} is neither free nor in use"));
                }
                continue;
            };
            if e.refs != held[c] {
                return Err(format!(
                    "checkpoint slot {c} counts {} references but sequences hold {}",
                    e.refs, held[c]
                ));
            }
            if e.refs == 0 && !e.published {
                return Err(format!("checkpoint slot {c} is unpublished and unheld"));
            }
            let evictable = e.published && e.refs == 0;
            if self.lru.contains(c as CheckpointSlot) != evictable {
                return Err(format!(
                    "checkpoint slot {c}: evictable {evictable} but not in the order"
                ));
            }
        }
        if filed
            != self
                .entries
                .iter()
                .flatten()
                .filter(|e| e.published)
                .count()
        {
            return Err("a published checkpoint is not filed".into());
        }
        Ok(())
    }
}
