//! Offload tiers on a pool ([`crate::tier`]): evicted cached blocks are written back to
//! the first tier that takes them (through the write-back thread), and a prompt whose
//! prefix misses in the pool asks the tiers for the blocks that follow, loads the
//! checked hits into fresh blocks and caches them, so the ordinary prefix match then
//! attaches them.
//!
//! Invariants: a block is loaded only after its payload passed every check (format,
//! configuration fingerprint, key, the MAC under its namespace's key) and its parent
//! key, chain root and token
//! ids equal the prompt's, so a tier can never make a sequence see K/V of another token
//! prefix. Loads stop at the first block some tier lacks (a chain must be whole). The
//! blocks of the chain already in the pool are held while loading, so the room the
//! loads take never evicts them. A prefetch in the background ([`PoolCore::prefetch_async`])
//! only fills the fetcher's buffer; its payloads pass the same checks when a lookup uses
//! them.

use std::sync::Arc;

use rayon::prelude::*;
use smallvec::SmallVec;

use super::caching::group_key;
use super::pool::{PoolCore, SeqId};
use crate::error::{KvError, Result};
use crate::layout::BlockId;
use crate::prefix::persist::expected_metadata;
use crate::prefix::{BlockHash, CachedBlock};
use crate::tier::fetcher::Fetcher;
use crate::tier::payload::{
    self, BlockMeta, Checked, ConfigKey, Fingerprint, PayloadShape, Refusal, TierKey,
};
use crate::tier::writer::{WritePolicy, Writer};
use crate::tier::{Tier, TierCounters};

/// Tokens of a prompt that each tier served (by the tier's index).
pub type TierTokens = SmallVec<[usize; 2]>;

/// A pool's tiers, the fingerprint its payloads carry and the write-back thread.
#[derive(Debug)]
pub struct TierSet {
    /// The tiers, fastest first: write-back goes to the first that takes a block, and
    /// lookups ask them in order.
    pub tiers: Vec<Arc<dyn Tier>>,
    /// The pool-configuration fingerprint, prefixed to every key.
    pub fingerprint: Fingerprint,
    /// The root of this configuration's payload MAC keys (one key per namespace).
    pub config_key: ConfigKey,
    /// Whether the MAC keys derive from a secret (false: whoever can write to a tier is
    /// trusted).
    pub keyed: bool,
    /// The shape of this pool's payloads.
    pub shape: PayloadShape,
    /// The write-back queue and thread.
    pub writer: Writer,
    /// The prefetch buffer and thread ([`PoolCore::prefetch_async`]).
    pub fetcher: Fetcher,
}

/// How a pool uses its tiers ([`PoolCore::with_tiers`]).
#[derive(Clone, PartialEq, Eq)]
pub struct TierOptions {
    /// The secret shared by the processes whose pools share the tiers (at least
    /// [`payload::MIN_SECRET`] bytes): payloads are MACed under keys derived from it.
    /// `None`: the keys are public, and whoever can write to a tier is trusted.
    pub secret: Option<Vec<u8>>,
    /// Most payloads in the write-back queue.
    pub queue: usize,
    /// Most bytes in the write-back queue.
    pub queue_bytes: usize,
    /// Which tiers an evicted block is written to.
    pub policy: WritePolicy,
}

impl std::fmt::Debug for TierOptions {
    /// Shows whether a secret is set, never the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierOptions")
            .field("secret", &self.secret.as_ref().map(|_| "***"))
            .field("queue", &self.queue)
            .field("queue_bytes", &self.queue_bytes)
            .field("policy", &self.policy)
            .finish()
    }
}

impl Default for TierOptions {
    fn default() -> Self {
        TierOptions {
            secret: None,
            queue: 1024,
            queue_bytes: crate::tier::writer::DEFAULT_QUEUE_BYTES,
            policy: WritePolicy::First,
        }
    }
}

/// Most bytes of payloads the prefetch buffer holds (besides at most the pool's number
/// of blocks).
pub const PREFETCH_BYTES: usize = 1 << 30;

/// A payload a tier served (the tier's index, the bytes) and what its checks read.
type Served = (usize, Vec<u8>, Checked);

/// The bytes of a payload that hold the K/V of every cache tensor (contiguous).
fn kv_span(shape: &PayloadShape) -> std::ops::Range<usize> {
    shape.kv_range(0).start..shape.kv_range(shape.tensors - 1).end
}

impl PoolCore {
    /// Attaches offload `tiers` (fastest first) to this pool, which must cache prefixes.
    /// `model_id` joins the configuration fingerprint, so pools of different models
    /// sharing a store never read each other's blocks, and becomes the pool's model id
    /// ([`PoolCore::with_model_id`]). `options` holds the secret that authenticates
    /// payloads, the write-back queue's bounds and which tiers an evicted block is
    /// written to.
    pub fn with_tiers(
        mut self,
        tiers: Vec<Arc<dyn Tier>>,
        model_id: &str,
        options: &TierOptions,
    ) -> Result<Self> {
        if self.prefix().is_none() {
            return Err(KvError::InvalidArgument {
                name: "tiers",
                value: format!("{} tiers", tiers.len()),
                reason: "offload tiers hold cached prefixes: turn prefix caching on".into(),
            });
        }
        self = self.with_model_id(model_id);
        if tiers.is_empty() {
            return Ok(self);
        }
        let key = match options.secret.as_deref() {
            Some(s) if s.len() < payload::MIN_SECRET => {
                return Err(KvError::InvalidArgument {
                    name: "tier_key",
                    value: format!("{} bytes", s.len()),
                    reason: format!(
                        "must be at least {} bytes (e.g. secrets.token_bytes(32))",
                        payload::MIN_SECRET
                    ),
                })
            }
            secret => TierKey::new(secret),
        };
        let meta = expected_metadata(&self);
        let tag = key.tag();
        let fingerprint = payload::fingerprint(meta.iter().map(|(k, v)| (*k, v.as_str())).chain([
            ("model_id", model_id),
            ("payload", "2"),
            ("tier_key", tag.as_str()),
        ]));
        let sh = self.shape;
        let tensor_bytes = sh.block_elems() * self.dtype().size();
        let scale_bytes = if self.storage.row_scales().is_some() {
            4 * sh.block_elems() / sh.head_dim
        } else {
            0
        };
        let shape = PayloadShape {
            block_size: sh.block_size,
            tensors: self.groups.per_block,
            tensor_bytes,
            scale_bytes,
        };
        crate::tier::writer::check_queue(options.queue, options.queue_bytes, shape.len())?;
        let thread_error = |what: &str, e: std::io::Error| KvError::Io {
            path: format!("(tier {what} thread)"),
            reason: e.to_string(),
        };
        let writer = Writer::start(
            tiers.clone(),
            options.queue,
            options.queue_bytes,
            options.policy,
        )
        .map_err(|e| thread_error("writer", e))?;
        // A prefetch is useful up to the pool's size; host memory bounds it too (every
        // buffered payload has exactly the shape's length).
        let buffered = sh.num_blocks.min(PREFETCH_BYTES / shape.len()).max(1);
        let fetcher = Fetcher::start(tiers.clone(), shape.len(), buffered)
            .map_err(|e| thread_error("fetcher", e))?;
        self.tiers = Some(TierSet {
            tiers,
            fingerprint,
            config_key: key.config(&fingerprint),
            keyed: key.is_secret(),
            shape,
            writer,
            fetcher,
        });
        Ok(self)
    }

    /// The attached tiers, if any.
    pub fn tiers(&self) -> Option<&TierSet> {
        self.tiers.as_ref()
    }

    /// The payload of cached block `b` (its index entry `meta`, token ids `tokens`),
    /// not yet sealed: the write-back thread computes its checksum.
    fn payload_of(
        &self,
        ts: &TierSet,
        b: BlockId,
        meta: &CachedBlock,
        tokens: &[u32],
    ) -> Result<Vec<u8>> {
        let sh = self.shape;
        let bm = BlockMeta {
            key: meta.hash,
            parent: meta.parent,
            root: meta.root,
            first: meta.first,
        };
        let mut out = payload::begin(&ts.fingerprint, &ts.shape, &bm, tokens);
        // Every tensor's block in one swap (one transfer from a device).
        self.storage
            .read_blocks(sh, ts.shape.tensors, &[b], &mut out[kv_span(&ts.shape)])?;
        if ts.shape.scale_bytes > 0 {
            let mut scales = vec![0f32; ts.shape.scale_bytes / 4];
            for t in 0..ts.shape.tensors {
                self.storage
                    .read_row_scales(sh.whole_block(t, b), &mut scales)?;
                let r = ts.shape.scale_range(t);
                for (dst, s) in out[r].chunks_exact_mut(4).zip(&scales) {
                    dst.copy_from_slice(&s.to_le_bytes());
                }
            }
        }
        Ok(out)
    }

    /// Queues cached block `b` (about to leave the pool) for the tiers; a block that
    /// cannot be read is counted as unstored, never an error.
    pub(crate) fn write_back(&self, b: BlockId, meta: &CachedBlock, tokens: &[u32]) {
        let Some(ts) = self.tiers.as_ref() else {
            return;
        };
        match self.payload_of(ts, b, meta, tokens) {
            Ok(p) => {
                let key = payload::block_key(&ts.fingerprint, meta.root, meta.hash);
                ts.writer.submit(key, p, ts.config_key.namespace(meta.root));
            }
            Err(_) => {
                let c = &ts.writer.counters().unstored;
                c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Writes checked payloads' K/V into `blocks` straight from the payloads (on a
    /// device in one swap: one transfer and one launch per chunk), then their int8
    /// scales.
    fn load_payloads(
        &mut self,
        shape: &PayloadShape,
        blocks: &[BlockId],
        payloads: &[&[u8]],
    ) -> Result<()> {
        let sh = self.shape;
        let kv = kv_span(shape);
        let data: Vec<&[u8]> = payloads.iter().map(|p| &p[kv.clone()]).collect();
        self.storage
            .write_blocks(sh, shape.tensors, blocks, &data)?;
        if shape.scale_bytes > 0 {
            for (&b, p) in blocks.iter().zip(payloads) {
                for t in 0..shape.tensors {
                    let scales: Vec<f32> = p[shape.scale_range(t)]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                        .collect();
                    self.storage
                        .write_row_scales(sh.whole_block(t, b), &scales)?;
                }
            }
        }
        Ok(())
    }

    /// Asks the tiers for the whole blocks of `tokens` (from `root`, with `extra`, up to
    /// `limit` tokens) that follow what the pool caches, and caches the consecutive ones
    /// found; returns the tokens each tier served.
    pub(crate) fn promote(
        &mut self,
        root: BlockHash,
        tokens: &[u32],
        extra: &[u8],
        limit: usize,
    ) -> TierTokens {
        let (Some(ts), Some(p)) = (self.tiers.as_ref(), self.prefix()) else {
            return TierTokens::new();
        };
        let mut served: TierTokens = smallvec::smallvec![0; ts.tiers.len()];
        let (bs, ng) = (self.shape.block_size, self.groups.groups.len());
        let hashes = self.chain_hashes(root, tokens, extra, limit);
        let misses = self.misses_from_first_gap(&hashes);
        if misses.is_empty() {
            return served;
        }
        let held: Vec<BlockId> = (0..hashes.len())
            .flat_map(|j| (0..ng).map(move |g| (j, g)))
            .filter_map(|(j, g)| p.lookup(group_key(hashes[j], g)))
            .collect();
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        // Room: free and evictable blocks, less the chain's own (held while loading).
        let evictable_held = held
            .iter()
            .filter(|&&b| self.blocks.refcount(b) == 0)
            .count();
        let room = self.num_free_blocks().saturating_sub(evictable_held);
        for miss in misses {
            if wanted.len() + miss.len() > room {
                break;
            }
            wanted.extend(miss);
        }
        if wanted.is_empty() {
            return served;
        }
        let keys: Vec<String> = wanted
            .iter()
            .map(|&(j, g)| payload::block_key(&ts.fingerprint, root, group_key(hashes[j], g)))
            .collect();
        let chain = |j: usize, g: usize, c: &Checked| -> bool {
            let parent = if j == 0 { root } else { hashes[j - 1] };
            c.meta.parent == group_key(parent, g)
                && c.meta.root == root
                && c.meta.first == (j == 0)
                && c.tokens == tokens[j * bs..(j + 1) * bs]
        };
        let mut found: Vec<Option<Served>> = (0..wanted.len()).map(|_| None).collect();
        let mac = ts.config_key.namespace(root);
        // Checks (a BLAKE3 pass over each payload) run in parallel; a refused payload is
        // counted and forgotten by the tier that served it.
        let check = |found: &mut Vec<Option<Served>>, served: Vec<(usize, usize, Vec<u8>)>| {
            let checked: Vec<_> = crate::parallel::install(|| {
                served
                    .into_par_iter()
                    .map(|(i, t, bytes)| {
                        let (j, g) = wanted[i];
                        let key = group_key(hashes[j], g);
                        let c = payload::decode(&bytes, &ts.fingerprint, &ts.shape, key, &mac)
                            .and_then(|c| {
                                if chain(j, g, &c) {
                                    Ok(c)
                                } else {
                                    Err(Refusal::Key)
                                }
                            });
                        (i, t, bytes, c)
                    })
                    .collect()
            });
            for (i, t, bytes, c) in checked {
                match c {
                    Ok(c) => found[i] = Some((t, bytes, c)),
                    Err(_) => {
                        TierCounters::add(&ts.tiers[t].counters().rejected, 1);
                        ts.tiers[t].discard(&keys[i]);
                    }
                }
            }
        };
        // What a prefetch brought first (waiting for its fetches under way), then the
        // tiers in order for the rest.
        let prefetched = ts.fetcher.take(&keys);
        check(
            &mut found,
            prefetched
                .into_iter()
                .enumerate()
                .filter_map(|(i, got)| got.map(|(t, b)| (i, t, b)))
                .collect(),
        );
        for (t, tier) in ts.tiers.iter().enumerate() {
            let ask: Vec<usize> = (0..wanted.len()).filter(|&i| found[i].is_none()).collect();
            if ask.is_empty() {
                break;
            }
            let len = ts.shape.len();
            let got = tier.get_many(
                &ask.iter().map(|&i| keys[i].clone()).collect::<Vec<_>>(),
                len..=len,
            );
            check(
                &mut found,
                ask.iter()
                    .zip(got)
                    .filter_map(|(&i, bytes)| bytes.map(|b| (i, t, b)))
                    .collect(),
            );
        }
        let shape = ts.shape;
        for &b in &held {
            self.hold_block(b);
        }
        // The consecutive blocks every tier lookup found, up to the first gap: their
        // entries are wanted[..end].
        let mut end = 0;
        let mut blocks_found = 0;
        while end < wanted.len() {
            let j = wanted[end].0;
            let stop = wanted[end..]
                .iter()
                .position(|w| w.0 != j)
                .map_or(wanted.len(), |n| end + n);
            if found[end..stop].iter().any(Option::is_none) {
                break;
            }
            end = stop;
            blocks_found += 1;
        }
        let entries: Vec<Served> = found[..end]
            .iter_mut()
            .map(|e| e.take().expect("checked found"))
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
                let tier = &self.tiers.as_ref().expect("tiers on").tiers[*t];
                TierCounters::add(&tier.counters().hits, 1);
                TierCounters::add(&tier.counters().hit_bytes, bytes.len() as u64);
            }
            // A block's tokens count once, for the tier that served its first entry.
            let mut last = usize::MAX;
            for (i, &(j, _)) in wanted[..end].iter().enumerate() {
                if j != last {
                    served[entries[i].0] += bs;
                    last = j;
                }
            }
            debug_assert_eq!(served.iter().sum::<usize>(), blocks_found * bs);
        }
        self.release_all(held.into_iter().chain(loaded));
        served
    }

    /// Queues every cached block sequence `id` holds for the tiers now (write-back
    /// without eviction); returns how many were queued.
    pub fn store_to_tiers(&self, id: SeqId) -> Result<usize> {
        let s = self.seq(id)?;
        let (Some(_), Some(p)) = (self.tiers.as_ref(), self.prefix()) else {
            return Err(no_tiers());
        };
        let mut n = 0;
        for t in &s.tables {
            for &b in t.held_blocks().collect::<Vec<_>>().iter() {
                if let Some(meta) = p.meta(b) {
                    self.write_back(b, &meta, p.block_tokens(b));
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// Loads what the tiers hold of `tokens`' prefix (in `namespace`, with `extra`) into
    /// the pool's cache without starting a sequence; returns the tokens a sequence
    /// starting with `tokens` would now find cached.
    pub fn prefetch(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        let root = self.prefix().ok_or_else(no_tiers)?.root(namespace);
        if self.tiers.is_none() {
            return Err(no_tiers());
        }
        self.promote(root, tokens, extra, tokens.len());
        Ok(self.match_prefix(tokens, namespace, extra))
    }

    /// Starts fetching what the tiers hold of `tokens`' prefix (in `namespace`, with
    /// `extra`) into the prefetch buffer, and returns at once; the lookup of a sequence
    /// starting with `tokens` then loads from the buffer (waiting for the fetch if it is
    /// still under way). Returns the tokens of the prefix's whole blocks the pool lacks
    /// (0: nothing to fetch).
    pub fn prefetch_async(&self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        let (Some(ts), Some(p)) = (self.tiers.as_ref(), self.prefix()) else {
            return Err(no_tiers());
        };
        let root = p.root(namespace);
        let hashes = self.chain_hashes(root, tokens, extra, tokens.len());
        let misses = self.misses_from_first_gap(&hashes);
        let lacking = misses.len() * self.shape.block_size;
        let keys: Vec<String> = misses
            .into_iter()
            .flatten()
            .map(|(j, g)| payload::block_key(&ts.fingerprint, root, group_key(hashes[j], g)))
            .collect();
        ts.fetcher.request(keys);
        Ok(lacking)
    }

    /// For each block of the chain `hashes` from the first one some layer group lacks
    /// in the pool: its `(block, group)` pairs the pool lacks. Empty when the pool holds
    /// the whole chain.
    fn misses_from_first_gap(&self, hashes: &[BlockHash]) -> Vec<Vec<(usize, usize)>> {
        let p = self.prefix().expect("prefix caching on");
        let ng = self.groups.groups.len();
        let miss = |j: usize| -> Vec<(usize, usize)> {
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

    /// Waits until every block queued for the tiers has been written or refused.
    pub fn flush_tiers(&self) {
        if let Some(ts) = &self.tiers {
            ts.writer.flush();
        }
    }

    /// Removes every block of `namespace` from every tier (after writing what is
    /// queued); returns how many were removed.
    pub fn drop_tier_namespace(&self, namespace: &[u8]) -> Result<usize> {
        let (Some(ts), Some(p)) = (self.tiers.as_ref(), self.prefix()) else {
            return Err(no_tiers());
        };
        ts.writer.flush();
        let prefix = payload::namespace_prefix(&ts.fingerprint, p.root(namespace));
        ts.fetcher.drop_prefix(&prefix);
        Ok(ts.tiers.iter().map(|t| t.drop_prefix(&prefix)).sum())
    }
}

fn no_tiers() -> KvError {
    KvError::NotSupported("this pool has no offload tiers (BlockPool(..., tiers=[...]))".into())
}
