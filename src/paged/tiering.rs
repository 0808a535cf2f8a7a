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

use std::ops::RangeInclusive;
use std::sync::Arc;

use smallvec::SmallVec;

use super::pool::{PoolCore, SeqId};
use crate::error::{KvError, Result};
use crate::layout::BlockId;
use crate::prefix::persist::{expected_metadata, state_layout};
use crate::prefix::CachedBlock;
use crate::tier::checkpoint_payload;
use crate::tier::fetcher::Fetcher;
use crate::tier::payload::{self, BlockMeta, ConfigKey, Fingerprint, PayloadShape, TierKey};
use crate::tier::writer::{WriteMode, WritePolicy, Writer};
use crate::tier::Tier;

/// Tokens of a prompt that each tier served (by the tier's index).
pub type TierTokens = SmallVec<[usize; 2]>;

/// A pool's tiers, the fingerprint its payloads carry and the write-back thread. Cheap
/// to clone (its threads and tiers are shared): tier I/O runs on a clone, without the
/// pool's lock.
#[derive(Clone, Debug)]
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
    /// Bytes of state in this pool's checkpoint payloads (a pool with state layers that
    /// caches prefixes; `None`: no checkpoints travel).
    pub state_bytes: Option<usize>,
    /// When cached blocks are written ([`WriteMode`]).
    pub mode: WriteMode,
    /// The write-back queue and thread.
    pub writer: Arc<Writer>,
    /// The prefetch buffer and thread ([`PoolCore::prefetch_async`]).
    pub fetcher: Arc<Fetcher>,
}

/// How a pool uses its tiers ([`PoolCore::with_tiers`]).
#[derive(Clone, PartialEq, Eq)]
pub struct TierOptions {
    /// The secret shared by the processes whose pools share the tiers (at least
    /// 16 bytes, `payload::MIN_SECRET`): payloads are MACed under keys derived from it.
    /// `None`: the keys are public, and whoever can write to a tier is trusted.
    pub secret: Option<Vec<u8>>,
    /// Most payloads in the write-back queue.
    pub queue: usize,
    /// Most bytes in the write-back queue.
    pub queue_bytes: usize,
    /// Which tiers an evicted block is written to.
    pub policy: WritePolicy,
    /// When cached blocks are written; `None`: through when a tier is persistent (disk,
    /// Redis), else back.
    pub mode: Option<WriteMode>,
}

impl std::fmt::Debug for TierOptions {
    /// Shows whether a secret is set, never the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierOptions")
            .field("secret", &self.secret.as_ref().map(|_| "***"))
            .field("queue", &self.queue)
            .field("queue_bytes", &self.queue_bytes)
            .field("policy", &self.policy)
            .field("mode", &self.mode)
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
            mode: None,
        }
    }
}

/// Most bytes of payloads the prefetch buffer holds (besides at most the pool's number
/// of blocks).
pub const PREFETCH_BYTES: usize = 1 << 30;

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
        if tiers.is_empty() {
            return Ok(self.with_model_id(model_id));
        }
        if model_id.is_empty() {
            // Payloads are keyed by the model id: two models sharing a tier under one
            // id would read each other's K/V.
            return Err(KvError::InvalidArgument {
                name: "model_id",
                value: "\"\"".into(),
                reason: format!(
                    "a pool with offload tiers must name the model whose K/V it stores (its \
                     name and revision, e.g. model_id=\"org/model@rev\"), or be made with \
                     block_pool_from_config(model, ...), which derives it from the model; \
                     {} tier(s) given",
                    tiers.len()
                ),
            });
        }
        self = self.with_model_id(model_id);
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
        // Pools with state layers add their layout, so pools of other layouts never
        // share payloads (the fingerprints of pools without stay as they were).
        let states = state_layout(&self);
        let fingerprint = payload::fingerprint(
            meta.iter()
                .map(|(k, v)| (*k, v.as_str()))
                .chain([
                    ("model_id", model_id),
                    ("payload", "2"),
                    ("tier_key", tag.as_str()),
                ])
                .chain(states.as_deref().map(|s| ("state_layout", s))),
        );
        let sh = self.shape;
        let tensor_bytes = sh.block_elems() * self.dtype().size();
        let scale_bytes = if self.storage.row_scales().is_some() {
            4 * sh.block_elems() / sh.scale_unit()
        } else {
            0
        };
        let shape = PayloadShape {
            block_size: sh.block_size,
            tensors: self.groups.per_block,
            tensor_bytes,
            scale_bytes,
        };
        let state_bytes = self
            .checkpoints
            .as_ref()
            .and(self.states.as_ref())
            .map(|a| a.config().slot_bytes());
        let sizes = payload_sizes(&shape, state_bytes);
        crate::tier::writer::check_queue(options.queue, options.queue_bytes, *sizes.end())?;
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
        // buffered payload has a block's or a checkpoint's length).
        let buffered = sh.num_blocks.min(PREFETCH_BYTES / *sizes.end()).max(1);
        let fetcher = Fetcher::start(tiers.clone(), sizes, buffered)
            .map_err(|e| thread_error("fetcher", e))?;
        let writer = Arc::new(writer);
        crate::tier::writer::register(&writer);
        let mode = options
            .mode
            .unwrap_or(if tiers.iter().any(|t| t.persistent()) {
                WriteMode::Through
            } else {
                WriteMode::Back
            });
        self.tiers = Some(TierSet {
            tiers,
            fingerprint,
            config_key: key.config(&fingerprint),
            keyed: key.is_secret(),
            shape,
            state_bytes,
            mode,
            writer,
            fetcher: Arc::new(fetcher),
        });
        Ok(self)
    }

    /// The attached tiers, if any.
    pub fn tiers(&self) -> Option<&TierSet> {
        self.tiers.as_ref()
    }

    /// The payload of cached block `b` (its index entry `meta`, token ids `tokens`),
    /// not yet sealed: the write-back thread computes its MAC.
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

    /// Queues cached block `b` for the tiers; returns whether it was queued (a full
    /// queue drops it, a block that cannot be read is counted as unstored: never an
    /// error).
    pub(crate) fn write_back(&self, b: BlockId, meta: &CachedBlock, tokens: &[u32]) -> bool {
        let Some(ts) = self.tiers.as_ref() else {
            return false;
        };
        match self.payload_of(ts, b, meta, tokens) {
            Ok(p) => {
                let key = payload::block_key(&ts.fingerprint, meta.root, meta.hash);
                ts.writer.submit(key, p, ts.config_key.namespace(meta.root))
            }
            Err(_) => {
                let c = &ts.writer.counters().unstored;
                c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                false
            }
        }
    }

    /// Writes checked payloads' K/V into `blocks` straight from the payloads (on a
    /// device in one swap: one transfer and one launch per chunk), then their int8
    /// scales.
    pub(crate) fn load_payloads(
        &mut self,
        shape: &PayloadShape,
        blocks: &[BlockId],
        payloads: &[&[u8]],
    ) -> Result<()> {
        let sh = self.shape;
        let kv = kv_span(shape);
        let data: Vec<&[u8]> = payloads.iter().map(|p| &p[kv.clone()]).collect();
        for &b in blocks {
            self.blocks.wrote(b, sh.block_size);
        }
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

    /// Queues every cached block sequence `id` holds for the tiers now (write-back
    /// without eviction), with the cached state checkpoints at its blocks' ends (a pool
    /// with state layers); returns how many blocks were queued.
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
        self.store_checkpoints_to_tiers(s);
        Ok(n)
    }

    /// Waits until every block queued for the tiers has been written or refused. (A
    /// caller that shares the pool behind a lock runs [`TierSet::flush`] on a clone of
    /// [`PoolCore::tiers`] instead, without the lock.)
    pub fn flush_tiers(&self) {
        if let Some(ts) = &self.tiers {
            ts.flush();
        }
    }

    /// The key prefix of `namespace`'s blocks in the tiers ([`TierSet::drop_namespace`]).
    pub fn tier_namespace_prefix(&self, namespace: &[u8]) -> Result<String> {
        let (Some(ts), Some(p)) = (self.tiers.as_ref(), self.prefix()) else {
            return Err(no_tiers());
        };
        Ok(payload::namespace_prefix(
            &ts.fingerprint,
            p.root(namespace),
        ))
    }

    /// Removes every block of `namespace` from every tier (after writing what is
    /// queued); returns how many were removed.
    pub fn drop_tier_namespace(&self, namespace: &[u8]) -> Result<usize> {
        let prefix = self.tier_namespace_prefix(namespace)?;
        Ok(self
            .tiers
            .as_ref()
            .map_or(0, |ts| ts.drop_namespace(&prefix)))
    }
}

/// The lengths of a pool's payloads: a block's, and a checkpoint's (with `state_bytes`
/// of state; in the tiers only at block ends, with an empty run).
fn payload_sizes(shape: &PayloadShape, state_bytes: Option<usize>) -> RangeInclusive<usize> {
    match state_bytes {
        Some(s) => {
            let c = checkpoint_payload::payload_len(0, s);
            c.min(shape.len())..=c.max(shape.len())
        }
        None => shape.len()..=shape.len(),
    }
}

impl TierSet {
    /// The lengths of this pool's payloads (blocks', and checkpoints' at block ends):
    /// what a lookup asks the tiers for.
    pub fn sizes(&self) -> RangeInclusive<usize> {
        payload_sizes(&self.shape, self.state_bytes)
    }

    /// Waits until every block queued for the tiers has been written or refused.
    pub fn flush(&self) {
        self.writer.flush();
    }

    /// Removes every block under key `prefix` ([`PoolCore::tier_namespace_prefix`]) from
    /// the prefetch buffer and every tier, after writing what is queued; returns how
    /// many the tiers removed.
    pub fn drop_namespace(&self, prefix: &str) -> usize {
        self.writer.flush();
        self.fetcher.drop_prefix(prefix);
        self.tiers.iter().map(|t| t.drop_prefix(prefix)).sum()
    }
}

/// The error of a tier call on a pool without tiers.
pub(crate) fn no_tiers() -> KvError {
    KvError::NotSupported("this pool has no offload tiers (BlockPool(..., tiers=[...]))".into())
}
