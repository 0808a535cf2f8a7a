//! State checkpoints in the offload tiers: a pool with state layers that caches prefixes
//! writes its cached checkpoints at block ends to the tiers beside the blocks, and a
//! tier lookup brings them back ([`super::tier_lookup`]).
//!
//! **What travels.** Only checkpoints at a block's end (an empty run), filed under the
//! key of their anchor (the chain hash of the blocks before the position) and extra-key
//! digest ([`crate::tier::checkpoint_payload`]). Tiers are addressed by key, and a
//! prompt could continue a cached block at any of its positions: a checkpoint inside a
//! block has one candidate key per position, and the tiers hold whole blocks only, so
//! the K/V of a position inside a block never come from them. Token-granular
//! checkpoints stay in the pool and in prefix-cache files.
//!
//! **When.** A cached checkpoint at a block end is queued for the tiers when it leaves
//! the pool: evicted for another checkpoint's slot, freed when the block it is anchored
//! at leaves the cache, dropped by `evict_all`; and with its sequence's blocks by
//! [`PoolCore::store_to_tiers`]. The state is read under the pool's lock (like a
//! block's K/V); the write-back thread seals and writes it.
//!
//! **Lookups.** A tier lookup asks, in the same round trip as the blocks, for the
//! checkpoint at the end of each whole block of the prompt's chain past the pool's own
//! hit whose blocks the pool holds or the lookup fetches. Each passes the checks of a
//! block (format, fingerprint with the state layout, the namespace's MAC) and its key,
//! root and position must be the prompt's. The longest one whose blocks are then cached
//! is loaded into a checkpoint slot (the least recently used cached checkpoint no
//! sequence holds makes room, to the tiers) and published; the ordinary hit rule then
//! reaches it, so a tier hit counts only up to a position whose checkpoint the pool holds.

use super::caching::group_key;
use super::checkpoints::{CheckpointEntry, CheckpointSlot};
use super::pool::PoolCore;
use super::seq::SeqState;
use super::tier_lookup::ServedCheckpoint;
use crate::prefix::BlockHash;
use crate::tier::checkpoint_payload::{self, CheckpointMeta};
use crate::tier::TierCounters;
use rustc_hash::FxHashMap;

impl PoolCore {
    /// Queues cached checkpoint `c` (entry `e`, leaving the pool or stored with its
    /// sequence) for the tiers, if it sits at a block end; one that cannot be read is
    /// counted as unstored, never an error.
    pub(crate) fn write_back_checkpoint(&self, c: CheckpointSlot, e: &CheckpointEntry) {
        let (Some(ts), Some(arena)) = (self.tiers.as_ref(), self.states.as_ref()) else {
            return;
        };
        let Some(state_bytes) = ts.state_bytes.filter(|_| e.run.is_empty()) else {
            return;
        };
        let meta = CheckpointMeta {
            anchor: e.anchor,
            extra: e.extra,
            root: e.root,
            position: e.position,
            run: Vec::new(),
        };
        let mut p = checkpoint_payload::begin(&ts.fingerprint, &meta, state_bytes);
        let range = checkpoint_payload::state_range(0, state_bytes);
        if arena.read_checkpoint(c, &mut p[range]).is_ok() {
            let key =
                checkpoint_payload::checkpoint_key(&ts.fingerprint, e.root, e.anchor, e.extra, &[]);
            ts.writer.submit(key, p, ts.config_key.namespace(e.root));
        } else {
            let unstored = &ts.writer.counters().unstored;
            unstored.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Queues the cached checkpoints at the ends of `s`'s blocks for the tiers
    /// ([`Self::store_to_tiers`]).
    pub(crate) fn store_checkpoints_to_tiers(&self, s: &SeqState) {
        let Some(index) = self.checkpoints.as_ref() else {
            return;
        };
        let digest = self.extra_digest(&s.extra);
        for &h in &s.hashes {
            if let Some(c) = index.find(h, digest, &[]) {
                self.write_back_checkpoint(c, index.entry(c).expect("published"));
            }
        }
    }

    /// The blocks of chain `hashes` (of `tokens` from `root`, with `extra`, up to
    /// `limit` tokens) at whose ends a tier lookup asks for a checkpoint: past the
    /// pool's own hit, where the pool holds no checkpoint, and within the blocks the
    /// pool holds or the lookup fetches (`wanted`, `(block, layer group)` entries).
    /// Empty for a pool whose checkpoints do not travel.
    pub(crate) fn checkpoint_candidates(
        &self,
        root: BlockHash,
        hashes: &[BlockHash],
        tokens: &[u32],
        extra: &[u8],
        limit: usize,
        wanted: &[(usize, usize)],
    ) -> Vec<usize> {
        let (Some(index), Some(p)) = (self.checkpoints.as_ref(), self.prefix()) else {
            return Vec::new();
        };
        if self.tiers().and_then(|ts| ts.state_bytes).is_none() {
            return Vec::new();
        }
        let ng = self.groups.groups.len();
        let reach = (0..hashes.len())
            .find(|&j| {
                (0..ng).any(|g| {
                    p.lookup(group_key(hashes[j], g)).is_none() && !wanted.contains(&(j, g))
                })
            })
            .unwrap_or(hashes.len());
        let bs = self.shape.block_size;
        let hit = self.prompt_hit(root, tokens, extra, limit).0.tokens(bs);
        let digest = self.extra_digest(extra);
        (0..reach)
            .filter(|&j| (j + 1) * bs > hit && index.find(hashes[j], digest, &[]).is_none())
            .collect()
    }

    /// Loads the longest of the fetched `checkpoints` (by the block of chain `hashes`
    /// at whose end they sit; checked) whose blocks the pool holds, into a checkpoint
    /// slot, and publishes it; counts it as its tier's hit.
    pub(crate) fn load_tier_checkpoint(
        &mut self,
        root: BlockHash,
        hashes: &[BlockHash],
        digest: u128,
        checkpoints: FxHashMap<usize, ServedCheckpoint>,
    ) {
        let (Some(ts), Some(p)) = (self.tiers(), self.prefix()) else {
            return;
        };
        let Some(state_bytes) = ts.state_bytes else {
            return;
        };
        let cached = |j: usize| hashes[..=j].iter().all(|&h| p.lookup(h).is_some());
        let Some(j) = checkpoints.keys().copied().filter(|&j| cached(j)).max() else {
            return;
        };
        let (t, bytes) = &checkpoints[&j];
        let tier = ts.tiers[*t].clone();
        let Some(index) = self.checkpoints.as_mut() else {
            return;
        };
        if index.find(hashes[j], digest, &[]).is_some() {
            return;
        }
        let Some((slot, evicted)) = index.take_for_loading(true) else {
            return;
        };
        if let Some(e) = evicted {
            self.write_back_checkpoint(slot, &e);
        }
        let arena = self
            .states
            .as_mut()
            .expect("checkpoints live in the state arena");
        let range = checkpoint_payload::state_range(0, state_bytes);
        let index = self.checkpoints.as_mut().expect("checked");
        if arena.write_checkpoint(slot, &bytes[range]).is_err() {
            index.discard(slot);
            return;
        }
        let entry = CheckpointEntry {
            anchor: hashes[j],
            extra: digest,
            run: Default::default(),
            position: (j + 1) * self.shape.block_size,
            root,
            refs: 0,
            published: true,
        };
        if index.adopt_loaded(slot, entry) {
            TierCounters::add(&tier.counters().hits, 1);
            TierCounters::add(&tier.counters().hit_bytes, bytes.len() as u64);
        }
    }
}
