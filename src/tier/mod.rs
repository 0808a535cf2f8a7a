//! Offload tiers below a pool's prefix cache: where cached blocks go when the pool
//! evicts them, and where a prefix lookup that misses in the pool looks next.
//!
//! - `payload`: the block's binary payload (MACed under keys derived from the pools' shared secret) and its key;
//! - `checkpoint_payload`: a hybrid model's recurrent-state checkpoint, beside its blocks;
//! - `host`: [`HostTier`], this process's memory (LRU), the tier below a CUDA pool;
//! - `disk`: [`DiskTier`], a size-bounded directory (LRU by last use);
//! - `redis`: `RedisTier`, a Redis (or Valkey) server shared by many processes (cargo
//!   feature `redis`; `rediss://` needs `redis-tls`);
//! - `pages`: [`PageStore`], an inference engine's own pages sealed in payloads, in tiers;
//! - `writer`: the background thread that writes evicted blocks, off the caller's path;
//! - `fetcher`: the background thread that fetches a prefix ahead of its lookup.
//!
//! A tier never fails generation: an I/O error, a server that is down or slow, or a
//! payload that fails its checks is a miss (lookups) or a dropped write (stores), and
//! [`TierCounters`] say which happened.

pub(crate) mod checkpoint_payload;
pub(crate) mod disk;
pub(crate) mod fetcher;
pub(crate) mod host;
pub(crate) mod pages;
pub(crate) mod payload;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod writer;

pub use disk::DiskTier;
pub use host::HostTier;
pub use pages::{PageCounters, PageStore};
#[cfg(feature = "redis")]
pub use redis::{RedisTier, TlsOptions};
pub use writer::flush_all;

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A payload as the parts it is made of, in order: [`Tier::put_parts`] stores their
/// concatenation.
pub type Parts<'a> = [&'a [u8]; 3];

/// Bytes of the trailer that a [`Seal`] computes (a payload's MAC).
pub const TRAILER: usize = payload::MAC;

/// Computes a payload's trailer (its MAC) from the parts before it, in order.
pub type Seal<'s> = &'s (dyn Fn(&[&[u8]]) -> [u8; TRAILER] + Sync);

/// Bytes of payloads [`Tier::put_sealing`] seals then stores at a time by default: few
/// enough that they are still in the CPU's cache when they are stored.
const SEAL_CHUNK_BYTES: usize = 8 << 20;

/// The end of the chunk of `lens` that starts at `at`: at least `threads` payloads (one
/// per thread of the pool) and at least [`SEAL_CHUNK_BYTES`], or the rest.
fn seal_chunk_end(lens: &[usize], at: usize, threads: usize) -> usize {
    let (mut end, mut bytes) = (at, 0);
    while end < lens.len() && (end - at < threads || bytes < SEAL_CHUNK_BYTES) {
        bytes += lens[end];
        end += 1;
    }
    end
}

/// A store of block payloads by key.
pub trait Tier: Send + Sync + fmt::Debug {
    /// A short name for stats: `host`, `disk:{path}` or `redis://{host}:{port}/{db}`.
    fn name(&self) -> &str;
    /// The payloads of `keys`, in order (`None`: absent, or the tier failed; the tier
    /// counts which). One batched request. A payload whose length is outside `sizes` is
    /// `None` and counted as rejected, and is never buffered whole: a pool asks for its
    /// configuration's exact payload size.
    fn get_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<Option<Vec<u8>>>;
    /// The payloads of `keys` as [`Tier::get_many`] finds them, handed to `found` in
    /// batches of `(index in keys, payload)` as they arrive, so that a caller checks one
    /// batch while the next is on its way (by default: one batch at the end).
    fn get_each(
        &self,
        keys: &[String],
        sizes: RangeInclusive<usize>,
        found: &mut dyn FnMut(Vec<(usize, Vec<u8>)>),
    ) {
        let got = self.get_many(keys, sizes);
        found(
            got.into_iter()
                .enumerate()
                .filter_map(|(i, p)| p.map(|p| (i, p)))
                .collect(),
        );
    }
    /// Whether each of `keys` holds a payload of a length in `sizes`, without reading
    /// or checking it (by default: read with [`Tier::get_many`]).
    fn contains_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<bool> {
        self.get_many(keys, sizes)
            .into_iter()
            .map(|p| p.is_some())
            .collect()
    }
    /// Stores `items`; returns, per item, whether the tier took it (a refusal or a
    /// failure leaves it for the next tier). One batched request.
    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool>;
    /// Stores payloads given as the parts they are made of, in order (a page's header,
    /// its bytes where the caller keeps them, its MAC), as [`Tier::put_many`] would store
    /// their concatenation; per item, whether the tier took it. By default each payload
    /// is joined into a buffer of its own and stored with [`Tier::put_many`] (a tier that
    /// keeps payloads in memory needs one); a tier that writes them out writes the
    /// parts as they lie.
    fn put_parts(&self, items: &[(&str, Parts<'_>)]) -> Vec<bool> {
        let owned: Vec<(String, Arc<Vec<u8>>)> = items
            .iter()
            .map(|(k, parts)| (k.to_string(), Arc::new(parts.concat())))
            .collect();
        self.put_many(&owned)
    }
    /// Stores payloads given as their leading parts (a page's header, its bytes where the
    /// caller keeps them), each followed by the trailer `seal` computes from them (its
    /// MAC), as [`Tier::put_parts`] would store the three; per item, whether the tier
    /// took it. By default a few MiB of payloads at a time are sealed in parallel on this
    /// process's pool, then stored with [`Tier::put_parts`] while they are still in the
    /// CPU's cache; a tier that writes payloads out on several threads seals each one on
    /// the thread that writes it, right before writing it.
    fn put_sealing(&self, items: &[(&str, [&[u8]; 2])], seal: Seal<'_>) -> Vec<bool> {
        use rayon::prelude::*;
        let lens: Vec<usize> = items.iter().map(|(_, p)| p[0].len() + p[1].len()).collect();
        let threads = crate::parallel::threads();
        let mut taken = Vec::with_capacity(items.len());
        let mut at = 0;
        while at < items.len() {
            let end = seal_chunk_end(&lens, at, threads);
            let chunk = &items[at..end];
            let trailers: Vec<[u8; TRAILER]> = crate::parallel::install(|| {
                chunk
                    .par_iter()
                    .with_max_len(1)
                    .map(|(_, p)| seal(&p[..]))
                    .collect()
            });
            let parts: Vec<(&str, Parts<'_>)> = chunk
                .iter()
                .zip(&trailers)
                .map(|((k, p), t)| (*k, [p[0], p[1], &t[..]]))
                .collect();
            taken.extend(self.put_parts(&parts));
            at = end;
        }
        taken
    }
    /// The payloads of `keys` as [`Tier::get_many`] finds them, each handed to
    /// `check(index in keys, payload)`: from several threads at once (this process's
    /// pool) and in any order, the payload only borrowed for the call (a tier may read
    /// the next one into the same memory). By default: [`Tier::get_each`], each batch
    /// checked in parallel.
    fn read_each(
        &self,
        keys: &[String],
        sizes: RangeInclusive<usize>,
        check: &(dyn Fn(usize, &[u8]) + Sync),
    ) {
        use rayon::prelude::*;
        self.get_each(keys, sizes, &mut |batch| {
            crate::parallel::install(|| {
                batch
                    .par_iter()
                    .with_max_len(1)
                    .for_each(|(i, p)| check(*i, p))
            })
        });
    }
    /// Removes every key starting with `prefix`; returns how many were removed.
    fn drop_prefix(&self, prefix: &str) -> usize;
    /// Forgets a payload that failed its checks, so it is not read again.
    fn discard(&self, key: &str);
    /// What the tier did.
    fn counters(&self) -> &TierCounters;
    /// Whether what it stores outlives the process (a disk, a server): a pool with such
    /// a tier writes its blocks through by default ([`writer::WriteMode`]).
    fn persistent(&self) -> bool {
        true
    }
}

/// Counters of one tier (monotonic; read with [`TierCounters::snapshot`]).
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Keys looked up.
    pub lookups: AtomicU64,
    /// Payloads found and loaded into the pool.
    pub hits: AtomicU64,
    /// Bytes of those payloads.
    pub hit_bytes: AtomicU64,
    /// Payloads refused: wrong length, MAC, configuration, key or chain mismatch.
    pub rejected: AtomicU64,
    /// Payloads stored.
    pub stores: AtomicU64,
    /// Bytes stored.
    pub store_bytes: AtomicU64,
    /// Failed requests (I/O errors, server down or slow, disk full); each a miss or an
    /// unstored payload, never an error to the caller.
    pub errors: AtomicU64,
    /// Payloads removed to keep the tier in its size bound (disk).
    pub evictions: AtomicU64,
    /// What the most recent failure was (its text; no secret), for logs.
    pub last_error: parking_lot::Mutex<Option<String>>,
}

impl TierCounters {
    /// Adds `n` to `counter`.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a failed request (`errors`) and records what failed (`last_error`).
    pub fn fail(&self, what: impl std::fmt::Display) {
        Self::add(&self.errors, 1);
        *self.last_error.lock() = Some(what.to_string());
    }

    /// The text of the most recent failure ([`TierCounters::fail`]), if any.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().clone()
    }

    /// The counters' values, by name.
    pub fn snapshot(&self) -> [(&'static str, u64); 8] {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("lookups", g(&self.lookups)),
            ("hits", g(&self.hits)),
            ("hit_bytes", g(&self.hit_bytes)),
            ("rejected", g(&self.rejected)),
            ("stores", g(&self.stores)),
            ("store_bytes", g(&self.store_bytes)),
            ("errors", g(&self.errors)),
            ("evictions", g(&self.evictions)),
        ]
    }
}
