//! Tier lookups in three steps, so that no tier I/O runs under the pool's lock:
//!
//! 1. [`PoolCore::plan_tier_lookup`], under the lock: the prompt's chain hashes, the
//!    `(block, layer group)` entries the pool lacks from the chain's first gap, as many
//!    whole blocks as the pool has room for;
//! 2. [`TierLookup::fetch`], without the lock (and, from Python, without the GIL): the
//!    payloads a prefetch brought, then each tier in order for the rest, one batched
//!    request per tier; every payload is checked as it arrives;
//! 3. [`PoolCore::commit_tier_lookup`], under the lock again: what the pool lacks is
//!    planned afresh (other calls ran meanwhile), and the fetched payloads that fill it,
//!    consecutive from its first gap, are loaded into fresh blocks and cached, so the
//!    ordinary prefix match then attaches them.
//!
//! In a pool with state layers the same round trips also ask for the state checkpoints
//! at the ends of the chain's whole blocks past the pool's own hit
//! ([`super::checkpoint_tiers`]); the longest one whose blocks the pool then holds is
//! loaded, so the ordinary hit rule reaches it.
//!
//! Invariants: a block is loaded only after its payload passed every check (format,
//! configuration fingerprint, key, the MAC under its namespace's key) and its parent
//! key, chain root and token ids equal the prompt's, so a tier can never make a sequence
//! see K/V of another token prefix; a checkpoint likewise, its key, root and position
//! the prompt's, so it never restores the state of another prefix. Loads stop at the
//! first block some tier lacks (a chain must be whole). The chain's blocks already in
//! the pool are held while loading, so the room the loads take never evicts them. A
//! refused payload is counted and forgotten by the tier that served it.

use parking_lot::Mutex;
use rayon::prelude::*;
use rustc_hash::FxHashMap;

use super::caching::group_key;
use super::pool::PoolCore;
use super::tiering::{no_tiers, TierSet, TierTokens};
use crate::error::Result;
use crate::layout::BlockId;
use crate::prefix::{BlockHash, CachedBlock};
use crate::tier::checkpoint_payload;
use crate::tier::payload::{self, Checked, Refusal};
use crate::tier::TierCounters;

/// A `(block index in the chain, layer group)` entry of a lookup.
type Entry = (usize, usize);

/// A payload a tier served (the tier's index, the bytes) and what its checks read.
type Served = (usize, Vec<u8>, Checked);

/// A payload fetched for entry `.0` of a lookup from tier `.1`.
type Fetched = (usize, usize, Vec<u8>);

/// A fetched payload and the outcome of its checks (a block's fields, or `None` for a
/// checkpoint).
type CheckedFetch = (usize, usize, Vec<u8>, Result<Option<Checked>, Refusal>);

/// A checkpoint payload a tier served: the tier's index and the checked bytes.
pub(crate) type ServedCheckpoint = (usize, Vec<u8>);

/// A tier lookup planned under the pool's lock, to be fetched without it.
#[derive(Debug)]
pub struct TierLookup {
    tiers: TierSet,
    root: BlockHash,
    hashes: Vec<BlockHash>,
    /// The blocks' extra keys (e.g. multimodal inputs), recorded with them.
    extra: Vec<u8>,
    /// The prompt's tokens of the hashed blocks.
    tokens: Vec<u32>,
    block_size: usize,
    /// The entries to fetch, in chain order.
    wanted: Vec<Entry>,
    /// The chain's blocks at whose ends to fetch a state checkpoint (pools with state
    /// layers), and the digest of the extra key in their keys.
    checkpoints: Vec<usize>,
    digest: u128,
}

/// What [`TierLookup::fetch`] found: the checked payloads by entry.
#[derive(Debug)]
pub struct TierFetched {
    root: BlockHash,
    hashes: Vec<BlockHash>,
    extra: Vec<u8>,
    found: FxHashMap<Entry, Served>,
    /// Checked checkpoint payloads by the chain's block at whose end they are.
    checkpoints: FxHashMap<usize, ServedCheckpoint>,
    digest: u128,
}

impl PoolCore {
    /// Plans the tier lookup of the whole blocks of `tokens` (in `namespace`, with
    /// `extra`, up to `limit` tokens) that the pool lacks; `None` when there is nothing
    /// to ask (no tiers, or the pool holds the prefix, or has no room).
    pub fn plan_tier_lookup(
        &self,
        tokens: &[u32],
        namespace: &[u8],
        extra: &[u8],
        limit: usize,
    ) -> Option<TierLookup> {
        let (Some(ts), Some(p)) = (self.tiers(), self.prefix()) else {
            return None;
        };
        let root = p.root(namespace);
        let hashes = self.chain_hashes(root, tokens, extra, limit);
        let wanted = self.wanted_from_tiers(&hashes);
        let checkpoints = self.checkpoint_candidates(root, &hashes, tokens, extra, limit, &wanted);
        if wanted.is_empty() && checkpoints.is_empty() {
            return None;
        }
        let block_size = self.shape.block_size;
        Some(TierLookup {
            tiers: ts.clone(),
            root,
            extra: extra.to_vec(),
            tokens: tokens[..hashes.len() * block_size].to_vec(),
            hashes,
            block_size,
            wanted,
            checkpoints,
            digest: self.extra_digest(extra),
        })
    }

    /// The blocks of chain `hashes` the pool holds (for any layer group).
    fn held_of_chain(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let p = self.prefix().expect("prefix caching on");
        let ng = self.groups.groups.len();
        (0..hashes.len())
            .flat_map(|j| (0..ng).map(move |g| (j, g)))
            .filter_map(|(j, g)| p.lookup(group_key(hashes[j], g)))
            .collect()
    }

    /// The entries of chain `hashes` the pool lacks from its first gap: as many whole
    /// blocks as fit in the free and evictable blocks, less the chain's own evictable
    /// ones (they are held while loading).
    fn wanted_from_tiers(&self, hashes: &[BlockHash]) -> Vec<Entry> {
        let misses = self.misses_from_first_gap(hashes);
        if misses.is_empty() {
            return Vec::new();
        }
        let evictable_held = self
            .held_of_chain(hashes)
            .into_iter()
            .filter(|&b| self.blocks.refcount(b) == 0)
            .count();
        let room = self.num_free_blocks().saturating_sub(evictable_held);
        let mut wanted = Vec::new();
        for miss in misses {
            if wanted.len() + miss.len() > room {
                break;
            }
            wanted.extend(miss);
        }
        wanted
    }

    /// Loads and caches what `fetched` holds of what the pool still lacks of its chain,
    /// consecutive from the chain's first gap, then the longest fetched state checkpoint
    /// whose blocks the pool now holds; returns the tokens each tier served (blocks').
    pub fn commit_tier_lookup(&mut self, fetched: TierFetched) -> TierTokens {
        let Some(ts) = self.tiers() else {
            return TierTokens::new();
        };
        let mut served: TierTokens = smallvec::smallvec![0; ts.tiers.len()];
        let TierFetched {
            root,
            hashes,
            extra,
            found,
            checkpoints,
            digest,
        } = fetched;
        self.load_fetched_blocks(root, &hashes, &extra, found, &mut served);
        self.load_tier_checkpoint(root, &hashes, digest, checkpoints);
        served
    }

    /// The blocks of [`Self::commit_tier_lookup`]: loads and caches `found`'s payloads
    /// that fill what the pool lacks of chain `hashes`, consecutive from its first gap,
    /// adding the tokens each tier served to `served`.
    fn load_fetched_blocks(
        &mut self,
        root: BlockHash,
        hashes: &[BlockHash],
        extra: &[u8],
        mut found: FxHashMap<Entry, Served>,
        served: &mut TierTokens,
    ) {
        let shape = self.tiers().expect("tiers on").shape;
        let wanted = self.wanted_from_tiers(hashes);
        // The consecutive blocks whose every entry was fetched, up to the first gap.
        let mut end = 0;
        while end < wanted.len() {
            let j = wanted[end].0;
            let stop = wanted[end..]
                .iter()
                .position(|w| w.0 != j)
                .map_or(wanted.len(), |n| end + n);
            if wanted[end..stop].iter().any(|w| !found.contains_key(w)) {
                break;
            }
            end = stop;
        }
        if end == 0 {
            return;
        }
        let held = self.held_of_chain(hashes);
        for &b in &held {
            self.hold_block(b);
        }
        let entries: Vec<Served> = wanted[..end]
            .iter()
            .map(|w| found.remove(w).expect("checked above"))
            .collect();
        let mut loaded: Vec<BlockId> = (0..entries.len()).map(|_| self.take_block()).collect();
        let payloads: Vec<&[u8]> = entries.iter().map(|e| e.1.as_slice()).collect();
        if self.load_payloads(&shape, &loaded, &payloads).is_err() {
            // Unregistered: the blocks go back to the free list; nothing was cached.
            self.release_all(loaded.drain(..));
        } else {
            for (&b, (t, bytes, c)) in loaded.iter().zip(&entries) {
                let meta = CachedBlock {
                    hash: c.meta.key,
                    parent: c.meta.parent,
                    first: c.meta.first,
                    root,
                };
                let registered = self.blocks.register(b, meta, &c.tokens, extra);
                debug_assert!(registered, "only blocks the index lacks are loaded");
                // The tiers hold it: it is not written back to them.
                self.blocks.mark_stored(b);
                let tier = &self.tiers().expect("tiers on").tiers[*t];
                TierCounters::add(&tier.counters().hits, 1);
                TierCounters::add(&tier.counters().hit_bytes, bytes.len() as u64);
            }
            // A block's tokens count once, for the tier that served its first entry.
            let mut last = usize::MAX;
            for (i, &(j, _)) in wanted[..end].iter().enumerate() {
                if j != last {
                    served[entries[i].0] += self.shape.block_size;
                    last = j;
                }
            }
        }
        self.release_all(held.into_iter().chain(loaded));
    }

    /// Loads what the tiers hold of `tokens`' prefix (in `namespace`, with `extra`) into
    /// the pool's cache without starting a sequence; returns the tokens a sequence
    /// starting with `tokens` would now find cached.
    pub fn prefetch(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        if self.tiers().is_none() || self.prefix().is_none() {
            return Err(no_tiers());
        }
        let lookup = self.plan_tier_lookup(tokens, namespace, extra, tokens.len());
        self.prefetch_fetched(lookup.map(TierLookup::fetch), tokens, namespace, extra)
    }

    /// The commit of [`PoolCore::prefetch`] whose lookup was fetched without the lock.
    pub fn prefetch_fetched(
        &mut self,
        fetched: Option<TierFetched>,
        tokens: &[u32],
        namespace: &[u8],
        extra: &[u8],
    ) -> Result<usize> {
        if self.tiers().is_none() || self.prefix().is_none() {
            return Err(no_tiers());
        }
        if let Some(f) = fetched {
            self.commit_tier_lookup(f);
        }
        Ok(self.match_prefix(tokens, namespace, extra))
    }

    /// Starts fetching what the tiers hold of `tokens`' prefix (in `namespace`, with
    /// `extra`) into the prefetch buffer, and returns at once; the lookup of a sequence
    /// starting with `tokens` then loads from the buffer (waiting for the fetch if it is
    /// still under way). Returns the tokens of the prefix's whole blocks the pool lacks
    /// (0: nothing to fetch).
    pub fn prefetch_async(&self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        let (Some(ts), Some(p)) = (self.tiers(), self.prefix()) else {
            return Err(no_tiers());
        };
        let root = p.root(namespace);
        let hashes = self.chain_hashes(root, tokens, extra, tokens.len());
        let misses = self.misses_from_first_gap(&hashes);
        let lacking = misses.len() * self.shape.block_size;
        let wanted: Vec<Entry> = misses.into_iter().flatten().collect();
        let checkpoints =
            self.checkpoint_candidates(root, &hashes, tokens, extra, tokens.len(), &wanted);
        let digest = self.extra_digest(extra);
        let keys: Vec<String> = wanted
            .into_iter()
            .map(|(j, g)| payload::block_key(&ts.fingerprint, root, group_key(hashes[j], g)))
            .chain(checkpoints.into_iter().map(|j| {
                checkpoint_payload::checkpoint_key(&ts.fingerprint, root, hashes[j], digest, &[])
            }))
            .collect();
        ts.fetcher.request(keys);
        Ok(lacking)
    }

    /// For each block of the chain `hashes` from the first one some layer group lacks
    /// in the pool: its entries the pool lacks. Empty when the pool holds the whole
    /// chain.
    fn misses_from_first_gap(&self, hashes: &[BlockHash]) -> Vec<Vec<Entry>> {
        let p = self.prefix().expect("prefix caching on");
        let ng = self.groups.groups.len();
        let miss = |j: usize| -> Vec<Entry> {
            (0..ng)
                .filter(|&g| p.lookup(group_key(hashes[j], g)).is_none())
                .map(|g| (j, g))
                .collect()
        };
        let Some(start) = (0..hashes.len()).find(|&j| !miss(j).is_empty()) else {
            return Vec::new();
        };
        (start..hashes.len()).map(miss).collect()
    }

    /// The chained hashes of `tokens`' whole blocks (from `root`, with `extra`), up to
    /// `limit` tokens.
    fn chain_hashes(
        &self,
        root: BlockHash,
        tokens: &[u32],
        extra: &[u8],
        limit: usize,
    ) -> Vec<BlockHash> {
        let p = self.prefix().expect("prefix caching on");
        let bs = self.shape.block_size;
        let mut hashes = Vec::new();
        let mut parent = root;
        let mut buf = Vec::new();
        while (hashes.len() + 1) * bs <= limit.min(tokens.len()) {
            let at = hashes.len() * bs;
            let h = p
                .kind
                .block_with(&mut buf, parent, &tokens[at..at + bs], extra);
            hashes.push(h);
            parent = h;
        }
        hashes
    }
}

impl TierLookup {
    /// The tier keys of the items to fetch: the planned block entries, then the
    /// checkpoints.
    fn keys(&self) -> Vec<String> {
        let ts = &self.tiers;
        let blocks = self.wanted.iter().map(|&(j, g)| {
            payload::block_key(&ts.fingerprint, self.root, group_key(self.hashes[j], g))
        });
        let checkpoints = self.checkpoints.iter().map(|&j| {
            checkpoint_payload::checkpoint_key(
                &ts.fingerprint,
                self.root,
                self.hashes[j],
                self.digest,
                &[],
            )
        });
        blocks.chain(checkpoints).collect()
    }

    /// Fetches the planned entries and checkpoints without the pool's lock: first what
    /// a prefetch brought (waiting for its fetches under way), then each tier in order
    /// for the rest, one batched request per tier (blocks and checkpoints together).
    /// Payloads are checked (a MAC pass over their bytes) on the pool's threads batch by
    /// batch as they arrive, while this thread receives the next ones; a refused one is
    /// counted and forgotten by the tier that served it.
    pub fn fetch(self) -> TierFetched {
        let ts = &self.tiers;
        let mac = ts.config_key.namespace(self.root);
        let keys = self.keys();
        let mut found = Found::default();
        let prefetched: Vec<Fetched> = ts
            .fetcher
            .take(&keys)
            .into_iter()
            .enumerate()
            .filter_map(|(i, got)| got.map(|(t, b)| (i, t, b)))
            .collect();
        let checked = crate::parallel::install(|| self.check_all(prefetched, &mac));
        self.keep(&mut found, &keys, checked);
        let sizes = ts.sizes();
        for (t, tier) in ts.tiers.iter().enumerate() {
            let ask: Vec<usize> = (0..keys.len()).filter(|&i| !self.has(&found, i)).collect();
            if ask.is_empty() {
                break;
            }
            let ask_keys: Vec<String> = ask.iter().map(|&i| keys[i].clone()).collect();
            let checked = Mutex::new(Vec::new());
            let served = |batch: Vec<(usize, Vec<u8>)>| -> Vec<Fetched> {
                batch.into_iter().map(|(k, b)| (ask[k], t, b)).collect()
            };
            let streamed = crate::parallel::in_place_scope(|s| {
                tier.get_each(&ask_keys, sizes.clone(), &mut |batch| {
                    let (this, mac, checked, served) = (&self, &mac, &checked, &served);
                    s.spawn(move |_| {
                        let done = this.check_all(served(batch), mac);
                        checked.lock().extend(done);
                    });
                });
            });
            if streamed.is_none() {
                // No pool in this process: each batch is checked on this thread.
                tier.get_each(&ask_keys, sizes.clone(), &mut |batch| {
                    let done = self.check_all(served(batch), &mac);
                    checked.lock().extend(done);
                });
            }
            self.keep(&mut found, &keys, checked.into_inner());
        }
        TierFetched {
            root: self.root,
            hashes: self.hashes,
            extra: self.extra,
            found: found.blocks,
            checkpoints: found.checkpoints,
            digest: self.digest,
        }
    }

    /// Whether fetched item `i` (a block entry, then a checkpoint) is in `found`.
    fn has(&self, found: &Found, i: usize) -> bool {
        match self.wanted.get(i) {
            Some(w) => found.blocks.contains_key(w),
            None => found
                .checkpoints
                .contains_key(&self.checkpoints[i - self.wanted.len()]),
        }
    }

    /// Checks `served` payloads in parallel (on the current rayon pool).
    fn check_all(&self, served: Vec<Fetched>, mac: &payload::MacKey) -> Vec<CheckedFetch> {
        served
            .into_par_iter()
            .map(|(i, t, bytes)| {
                let c = self.check(i, &bytes, mac);
                (i, t, bytes, c)
            })
            .collect()
    }

    /// Keeps the payloads that passed their checks in `found`; the others are counted
    /// and forgotten by the tier that served them.
    fn keep(&self, found: &mut Found, keys: &[String], checked: Vec<CheckedFetch>) {
        let ts = &self.tiers;
        for (i, t, bytes, c) in checked {
            match c {
                Ok(Some(c)) => {
                    found.blocks.insert(self.wanted[i], (t, bytes, c));
                }
                Ok(None) => {
                    let j = self.checkpoints[i - self.wanted.len()];
                    found.checkpoints.insert(j, (t, bytes));
                }
                Err(_) => {
                    TierCounters::add(&ts.tiers[t].counters().rejected, 1);
                    ts.tiers[t].discard(&keys[i]);
                }
            }
        }
    }

    /// Checks the payload of item `i`: a block entry's every field, the MAC, and its
    /// chain (parent, root, first, token ids) against the prompt's; a checkpoint's every
    /// field, the MAC, its key, root and position against the prompt's.
    fn check(
        &self,
        i: usize,
        bytes: &[u8],
        mac: &payload::MacKey,
    ) -> Result<Option<Checked>, Refusal> {
        let ts = &self.tiers;
        let Some(&(j, g)) = self.wanted.get(i) else {
            let j = self.checkpoints[i - self.wanted.len()];
            let state_bytes = ts.state_bytes.ok_or(Refusal::Config)?;
            let key = (self.hashes[j], self.digest, &[][..]);
            let m = checkpoint_payload::decode(bytes, &ts.fingerprint, state_bytes, key, mac)?;
            let placed = m.root == self.root && m.position == (j + 1) * self.block_size;
            return if placed { Ok(None) } else { Err(Refusal::Key) };
        };
        let key = group_key(self.hashes[j], g);
        let c = payload::decode(bytes, &ts.fingerprint, &ts.shape, key, mac)?;
        let parent = if j == 0 {
            self.root
        } else {
            self.hashes[j - 1]
        };
        let bs = self.block_size;
        let chained = c.meta.parent == group_key(parent, g)
            && c.meta.root == self.root
            && c.meta.first == (j == 0)
            && c.tokens == self.tokens[j * bs..(j + 1) * bs];
        if chained {
            Ok(Some(c))
        } else {
            Err(Refusal::Key)
        }
    }
}

/// What a lookup's fetches found and checked so far.
#[derive(Default)]
struct Found {
    blocks: FxHashMap<Entry, Served>,
    checkpoints: FxHashMap<usize, ServedCheckpoint>,
}
