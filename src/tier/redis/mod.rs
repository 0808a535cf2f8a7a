//! [`RedisTier`]: block payloads in a Redis (or Valkey) server, shared by every process
//! that points at it.
//!
//! Each lookup is one pipeline of `MGET`s of about [`MGET_BYTES`] of payloads each, whose
//! replies are handed on one by one as they arrive (a pool checks the first payloads
//! while the later ones are on their way), and each store one pipeline of
//! `SET key payload [EX ttl]`: one vectored write and one read of all the replies per
//! batch, each payload sent from where it lies ([`resp`]: a page's header, its bytes in
//! the caller's buffer and its MAC as one bulk string), never copied into the pipeline. The `redis` crate parses the URL,
//! encodes the commands and parses the replies; the sockets are this crate's own
//! ([`conn`]), so that `timeout` bounds a whole request: connecting, logging in
//! (`AUTH`, `SELECT`), sending and receiving every byte of the reply. A reply is also
//! bounded in bytes by what the request can accept (an `MGET` of `n` keys whose payloads
//! are at most `m` bytes: about `n * (m + 32)`), so a forged huge value is never buffered.
//!
//! After a failure (an I/O error, the deadline, a malformed or short reply) the
//! connection is dropped, one error is counted and the tier is skipped for
//! `retry_after`: requests are then misses or dropped writes at once, each counted as an
//! error. When `retry_after` has passed, one caller at a time probes the server, so a
//! server that is down or slow costs at most one `timeout` per `retry_after`.
//!
//! Connections are pooled and reused by the process that opened them only: after
//! `fork`, a child never touches its parent's sockets and opens its own.
//!
//! On a Redis Cluster ([`RedisTier::cluster`], [`cluster`]) the same holds per node: keys
//! are grouped by the master of their slot, each master gets one pipeline of `GET`s (or
//! `SET`s) per call, all masters at once under one deadline, `MOVED` and `ASK`
//! redirections are followed once, and a node that fails is skipped on its own.
//!
//! Server settings a shared prefix cache wants: `maxmemory <bytes>` and
//! `maxmemory-policy allkeys-lru` (the server then evicts least recently used blocks),
//! and no persistence unless warm restarts of the server matter (`save ""`,
//! `appendonly no`).

mod cluster;
mod conn;
mod node;
mod options;
mod resp;
mod slots;
#[cfg(test)]
mod tests;
#[cfg(feature = "redis-tls")]
mod tls;
#[cfg(not(feature = "redis-tls"))]
#[path = "no_tls.rs"]
mod tls;

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use redis::{Client, Value};

use self::cluster::{builder, Cluster};
use self::conn::{redact_text, Target};
use self::node::{deadline_in, Node};
pub use self::options::TlsOptions;
use self::resp::Segments;
use super::{Parts, Seal, Tier, TierCounters, TRAILER};
use crate::error::{KvError, Result};

/// Block payloads in a Redis server, or in a Redis Cluster.
pub struct RedisTier {
    name: String,
    url: String,
    timeout: Duration,
    ttl: Option<u64>,
    retry_after: Duration,
    servers: Servers,
    counters: TierCounters,
}

/// One server, or a cluster's nodes.
enum Servers {
    Single(Node),
    Cluster(Cluster),
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("url", &self.url)
            .field("cluster", &matches!(self.servers, Servers::Cluster(_)))
            .field("timeout", &self.timeout)
            .field("ttl", &self.ttl)
            .field("retry_after", &self.retry_after)
            .finish_non_exhaustive()
    }
}

/// Most keys in one `MGET` (a request sends several past that).
const MGET_BATCH: usize = 256;

/// About how many bytes of payloads one `MGET` of a lookup asks for: small enough that
/// the first replies are checked while the later ones are on their way.
const MGET_BYTES: usize = 1 << 20;

/// How many `MGET`s of a lookup the server holds at once: it builds the replies of all
/// the commands it has read before it sends any, so a lookup sends two, then one more as
/// each reply arrives.
const MGET_WINDOW: usize = 2;

/// Bytes a reply may take beyond what its values account for (headers, login replies).
const SLACK: usize = 64 << 10;

/// Bytes of the framing of one value in a reply (`$<len>\r\n...\r\n`), at most.
const PER_VALUE: usize = 32;

/// Keys asked per `SCAN`.
const SCAN_COUNT: usize = 1000;
/// Bytes a `SCAN` reply may take (a `CLUSTER SLOTS` reply too).
const SCAN_CAP: usize = 16 << 20;

/// The longest a namespace drop runs (its `SCAN` pages and `UNLINK`s together): a server
/// that never ends its cursor cannot hold the caller; what is left stays until the next
/// drop, an expiry or the server's eviction.
const DROP_DEADLINE: Duration = Duration::from_secs(60);

/// The target of `url`, or an error that names what is wrong without the password.
fn target_of(url: &str) -> Result<Target> {
    let bad_url = |reason: String| KvError::InvalidArgument {
        name: "url",
        value: redact_text(url),
        reason: reason.replace(url, &redact_text(url)),
    };
    let client = Client::open(url).map_err(|e| bad_url(format!("not a Redis URL: {e}")))?;
    Target::new(client.get_connection_info()).map_err(bad_url)
}

/// `Ok` for a timeout > 0.
fn check_timeout(timeout: Duration) -> Result<()> {
    if timeout.is_zero() {
        return Err(KvError::InvalidArgument {
            name: "timeout",
            value: "0".into(),
            reason: "must be > 0: a request must never wait unboundedly".into(),
        });
    }
    Ok(())
}

impl RedisTier {
    /// A tier on the server at `url` (`redis://[user:password@]host[:port][/db]`, or
    /// `rediss://` for TLS with the system's trust roots, which needs the `redis-tls`
    /// feature: without it such a URL is [`KvError::NotSupported`]); no connection is
    /// made yet.
    /// `timeout` bounds each request whole (connect, TLS handshake, login, send, the full
    /// reply); `ttl` (seconds) expires stored blocks; `max_idle` connections are kept for
    /// reuse; after a failure the tier is skipped for `retry_after`.
    pub fn new(
        url: &str,
        timeout: Duration,
        ttl: Option<u64>,
        max_idle: usize,
        retry_after: Duration,
    ) -> Result<Self> {
        Self::with_tls(
            url,
            timeout,
            ttl,
            max_idle,
            retry_after,
            &TlsOptions::default(),
        )
    }

    /// [`RedisTier::new`] with TLS files (a CA, a client certificate) for a `rediss://`
    /// URL, read and checked now.
    pub fn with_tls(
        url: &str,
        timeout: Duration,
        ttl: Option<u64>,
        max_idle: usize,
        retry_after: Duration,
        tls: &TlsOptions,
    ) -> Result<Self> {
        let bad_url = |reason: String| KvError::InvalidArgument {
            name: "url",
            value: redact_text(url),
            reason: reason.replace(url, &redact_text(url)),
        };
        let (plain, on) = options::plain_url(url).map_err(bad_url)?;
        let target = target_of(plain.as_ref())?.with_tls(on, tls)?;
        check_timeout(timeout)?;
        Ok(RedisTier {
            name: target.name(),
            url: target.redacted_url(),
            timeout,
            ttl,
            retry_after,
            servers: Servers::Single(Node::new(target, max_idle, retry_after)),
            counters: TierCounters::default(),
        })
    }

    /// A tier on the Redis Cluster that the nodes at `seeds` belong to (each
    /// `redis://[user:password@]host:port[/0]`, one login for all; any live one is enough
    /// to find the others); no connection is made yet. `timeout` bounds each call whole:
    /// every node's request (all sent at once) and a redirected key's second request end
    /// by then. `max_idle` connections are kept per node, and a node that fails is
    /// skipped for `retry_after` (the others are still used).
    pub fn cluster(
        seeds: &[&str],
        timeout: Duration,
        ttl: Option<u64>,
        max_idle: usize,
        retry_after: Duration,
    ) -> Result<Self> {
        if seeds.is_empty() {
            return Err(KvError::InvalidArgument {
                name: "url",
                value: "[]".into(),
                reason: "a cluster needs at least one seed URL".into(),
            });
        }
        let targets = seeds
            .iter()
            .map(|u| target_of(u))
            .collect::<Result<Vec<_>>>()?;
        for (t, u) in targets.iter().zip(seeds) {
            let reason = if t.tcp().is_none() {
                "a cluster node is reached over TCP (redis://host:port)"
            } else if t.db() != 0 {
                "a cluster has database 0 only"
            } else {
                continue;
            };
            return Err(KvError::InvalidArgument {
                name: "url",
                value: redact_text(u),
                reason: reason.into(),
            });
        }
        check_timeout(timeout)?;
        let addrs: Vec<String> = targets
            .iter()
            .filter_map(|t| t.tcp().map(|(h, p)| slots::join(h, p)))
            .collect();
        let urls: Vec<String> = targets.iter().map(Target::redacted_url).collect();
        Ok(RedisTier {
            name: format!("redis-cluster://{}", addrs.join(",")),
            url: urls.join(","),
            timeout,
            ttl,
            retry_after,
            servers: Servers::Cluster(Cluster::new(&targets, max_idle, retry_after)),
            counters: TierCounters::default(),
        })
    }

    /// The server's URL with the password replaced by `***` (a cluster's seeds, joined by
    /// commas).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether the tier is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.servers, Servers::Cluster(_))
    }

    /// One request to the single server, bounded by `timeout` from now.
    fn request<R>(
        &self,
        node: &Node,
        packed: &[u8],
        replies: usize,
        cap: usize,
        check: impl FnOnce(Vec<Value>) -> Option<R>,
    ) -> Option<R> {
        let deadline = deadline_in(self.timeout);
        node.request(packed, replies, cap, deadline, &self.counters, check)
            .ok()
    }

    /// A payload found, kept when its length is in `sizes` (else counted as rejected).
    fn sized(&self, p: Option<Vec<u8>>, sizes: &RangeInclusive<usize>) -> Option<Vec<u8>> {
        let p = p?;
        if sizes.contains(&p.len()) {
            Some(p)
        } else {
            TierCounters::add(&self.counters.rejected, 1);
            None
        }
    }

    /// Counts the payloads of `lens` bytes as stored where `ok`.
    fn count_stores(&self, lens: &[usize], ok: &[bool]) {
        let (n, bytes) = lens
            .iter()
            .zip(ok)
            .filter(|(_, &ok)| ok)
            .fold((0u64, 0u64), |(n, b), (len, _)| (n + 1, b + *len as u64));
        TierCounters::add(&self.counters.stores, n);
        TierCounters::add(&self.counters.store_bytes, bytes);
    }

    /// Stores each payload (its parts, concatenated) with `SET key payload [EX ttl]`: one
    /// pipeline (per master, on a cluster), its payloads sent from where they lie
    /// ([`Segments`]); per item, whether it was stored.
    fn store(&self, items: &[(&str, &[&[u8]])]) -> Vec<bool> {
        if items.is_empty() {
            return Vec::new();
        }
        let ttl = self.ttl.map(|t| t.to_string());
        let set = builder(|i: usize, p: &mut Segments<'_>| {
            let (k, parts) = items[i];
            match &ttl {
                Some(t) => {
                    p.command(&[&[b"SET"], &[k.as_bytes()], parts, &[b"EX"], &[t.as_bytes()]])
                }
                None => p.command(&[&[b"SET"], &[k.as_bytes()], parts]),
            }
        });
        let ok = match &self.servers {
            Servers::Single(node) => {
                let mut p = Segments::new();
                for i in 0..items.len() {
                    set(i, &mut p);
                }
                let cap = items.len().saturating_mul(PER_VALUE).saturating_add(SLACK);
                let deadline = deadline_in(self.timeout);
                let ok = node
                    .request_parts(
                        &p.slices(),
                        items.len(),
                        cap,
                        deadline,
                        &self.counters,
                        |r| r.iter().all(|v| matches!(v, Value::Okay)).then_some(()),
                    )
                    .is_ok();
                vec![ok; items.len()]
            }
            Servers::Cluster(c) => {
                let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
                let got = c.run(&keys, &set, 0, deadline_in(self.timeout), &self.counters);
                got.into_iter()
                    .map(|v| matches!(v, Some(Value::Okay)))
                    .collect()
            }
        };
        let lens: Vec<usize> = items
            .iter()
            .map(|(_, parts)| parts.iter().map(|p| p.len()).sum())
            .collect();
        self.count_stores(&lens, &ok);
        ok
    }
}

/// The values of one `MGET` reply for `n` keys: `None` unless it is an array of exactly
/// `n` values, each nil or a string.
fn mget_values(n: usize, reply: Value) -> Option<Vec<Option<Vec<u8>>>> {
    let Value::Array(values) = reply else {
        return None;
    };
    if values.len() != n {
        return None;
    }
    values
        .into_iter()
        .map(|v| match v {
            Value::Nil => Some(None),
            Value::BulkString(b) => Some(Some(b)),
            _ => None,
        })
        .collect()
}

/// Keys per `MGET` of a lookup whose payloads take at most `size` bytes: about
/// [`MGET_BYTES`] of reply each, at most [`MGET_BATCH`] keys.
fn mget_batch(size: usize) -> usize {
    (MGET_BYTES / size.max(1)).clamp(1, MGET_BATCH)
}

impl Tier for RedisTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn get_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<Option<Vec<u8>>> {
        TierCounters::add(&self.counters.lookups, keys.len() as u64);
        if keys.is_empty() {
            return Vec::new();
        }
        let node = match &self.servers {
            Servers::Single(node) => node,
            Servers::Cluster(c) => {
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let build = builder(|i: usize, p: &mut Segments<'_>| {
                    p.simple(&[b"GET", keys[i].as_bytes()]);
                });
                let got = c.run(
                    &refs,
                    &build,
                    *sizes.end(),
                    deadline_in(self.timeout),
                    &self.counters,
                );
                return got
                    .into_iter()
                    .map(|v| match v {
                        None | Some(Value::Nil) => None,
                        Some(Value::BulkString(b)) => self.sized(Some(b), &sizes),
                        Some(_) => {
                            // An error reply (CLUSTERDOWN, TRYAGAIN, ...): a miss.
                            self.counters
                                .fail("the server answered a read with an error reply");
                            None
                        }
                    })
                    .collect();
            }
        };
        // Sizes may be a loose bound here (a caller's `RedisTier.get`): one pipeline of
        // `MGET`s, all sent at once, rather than the stream a pool's lookups use.
        let mut p = redis::pipe();
        for chunk in keys.chunks(MGET_BATCH) {
            p.cmd("MGET").arg(chunk);
        }
        let replies = keys.len().div_ceil(MGET_BATCH);
        let cap = keys
            .len()
            .saturating_mul(sizes.end().saturating_add(PER_VALUE))
            .saturating_add(SLACK);
        let got = self.request(node, &p.get_packed_pipeline(), replies, cap, |r| {
            let chunks = r.into_iter().zip(keys.chunks(MGET_BATCH));
            let values: Option<Vec<Vec<Option<Vec<u8>>>>> = chunks
                .map(|(reply, c)| mget_values(c.len(), reply))
                .collect();
            values.map(|v| v.into_iter().flatten().collect::<Vec<_>>())
        });
        let Some(values) = got else {
            return vec![None; keys.len()];
        };
        values.into_iter().map(|p| self.sized(p, &sizes)).collect()
    }

    /// On one server (a pool's lookups, which know their payloads' exact size): `MGET`s
    /// of about `MGET_BYTES` of reply each, `MGET_WINDOW` at a time, whose replies are
    /// checked (exactly one value per key, each nil or a string) and handed
    /// on one by one as they arrive. A failure midway keeps what was handed on (each
    /// payload is checked by its reader anyway) and makes the rest misses.
    fn get_each(
        &self,
        keys: &[String],
        sizes: RangeInclusive<usize>,
        found: &mut dyn FnMut(Vec<(usize, Vec<u8>)>),
    ) {
        let node = match &self.servers {
            Servers::Single(node) => node,
            Servers::Cluster(_) => {
                let got = self.get_many(keys, sizes);
                let batch = got.into_iter().enumerate();
                return found(batch.filter_map(|(i, p)| p.map(|p| (i, p))).collect());
            }
        };
        TierCounters::add(&self.counters.lookups, keys.len() as u64);
        if keys.is_empty() {
            return;
        }
        let per = mget_batch(*sizes.end());
        let commands: Vec<Vec<u8>> = keys
            .chunks(per)
            .map(|chunk| redis::cmd("MGET").arg(chunk).get_packed_command())
            .collect();
        let commands: Vec<&[u8]> = commands.iter().map(Vec::as_slice).collect();
        let cap = keys
            .len()
            .saturating_mul(sizes.end().saturating_add(PER_VALUE))
            .saturating_add(SLACK);
        let mut next = 0;
        let each = |reply: Value| {
            let n = per.min(keys.len() - next);
            let Some(values) = mget_values(n, reply) else {
                return false;
            };
            let batch = values
                .into_iter()
                .enumerate()
                .filter_map(|(k, p)| self.sized(p, &sizes).map(|p| (next + k, p)))
                .collect();
            next += n;
            found(batch);
            true
        };
        let deadline = deadline_in(self.timeout);
        let _ = node.request_each(
            &commands,
            MGET_WINDOW,
            commands.len(),
            cap,
            deadline,
            &self.counters,
            each,
        );
    }

    /// One pipeline of `STRLEN`s (per node, on a cluster): whether each key holds a
    /// payload of a length in `sizes`, without moving the payloads.
    fn contains_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<bool> {
        if keys.is_empty() {
            return Vec::new();
        }
        let fits = |v: &Value| matches!(v, Value::Int(n) if *n > 0 && usize::try_from(*n).is_ok_and(|n| sizes.contains(&n)));
        let node = match &self.servers {
            Servers::Single(node) => node,
            Servers::Cluster(c) => {
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let build = builder(|i: usize, p: &mut Segments<'_>| {
                    p.simple(&[b"STRLEN", keys[i].as_bytes()]);
                });
                let got = c.run(
                    &refs,
                    &build,
                    PER_VALUE,
                    deadline_in(self.timeout),
                    &self.counters,
                );
                return got.iter().map(|v| v.as_ref().is_some_and(fits)).collect();
            }
        };
        let mut p = redis::pipe();
        for k in keys {
            p.cmd("STRLEN").arg(k);
        }
        let cap = keys.len().saturating_mul(PER_VALUE).saturating_add(SLACK);
        let got = self.request(node, &p.get_packed_pipeline(), keys.len(), cap, |r| {
            (r.len() == keys.len()).then(|| r.iter().map(fits).collect::<Vec<bool>>())
        });
        got.unwrap_or_else(|| vec![false; keys.len()])
    }

    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
        let parts: Vec<[&[u8]; 1]> = items.iter().map(|(_, v)| [v.as_slice()]).collect();
        let items: Vec<(&str, &[&[u8]])> = items
            .iter()
            .zip(&parts)
            .map(|((k, _), p)| (k.as_str(), &p[..]))
            .collect();
        self.store(&items)
    }

    /// Seals every payload first (in parallel on this process's pool), then stores them
    /// all in one pipeline as [`Tier::put_parts`] does: one round trip, not one per few
    /// MiB (the trailers are computed from the caller's memory; nothing is joined).
    fn put_sealing(&self, items: &[(&str, [&[u8]; 2])], seal: Seal<'_>) -> Vec<bool> {
        use rayon::prelude::*;
        let trailers: Vec<[u8; TRAILER]> = crate::parallel::install(|| {
            items
                .par_iter()
                .with_max_len(1)
                .map(|(_, p)| seal(&p[..]))
                .collect()
        });
        let parts: Vec<[&[u8]; 3]> = items
            .iter()
            .zip(&trailers)
            .map(|((_, p), t)| [p[0], p[1], &t[..]])
            .collect();
        let items: Vec<(&str, &[&[u8]])> = items
            .iter()
            .zip(&parts)
            .map(|((k, _), p)| (*k, &p[..]))
            .collect();
        self.store(&items)
    }

    /// `SET`s whose values are the parts as they lie: each one bulk string of the parts'
    /// summed length, sent with vectored writes, never joined into a copy.
    fn put_parts(&self, items: &[(&str, Parts<'_>)]) -> Vec<bool> {
        let items: Vec<(&str, &[&[u8]])> = items.iter().map(|(k, p)| (*k, &p[..])).collect();
        self.store(&items)
    }

    /// One request (each bounded by `timeout`) per `SCAN` page and one per `UNLINK` of
    /// the keys found; stops at the first failure (on a cluster: every master in turn,
    /// each stopping at its own first failure).
    fn drop_prefix(&self, prefix: &str) -> usize {
        let pattern = format!("{prefix}*");
        let node = match &self.servers {
            Servers::Single(node) => node,
            Servers::Cluster(c) => return c.drop_matching(&pattern, self.timeout, &self.counters),
        };
        let mut cursor = b"0".to_vec();
        let mut removed = 0;
        let give_up = std::time::Instant::now() + DROP_DEADLINE;
        while std::time::Instant::now() < give_up {
            let scan = redis::cmd("SCAN")
                .arg(&cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .get_packed_command();
            let Some((next, keys)) = self.request(node, &scan, 1, SCAN_CAP, scan_page) else {
                return removed;
            };
            if !keys.is_empty() {
                let unlink = redis::cmd("UNLINK").arg(&keys).get_packed_command();
                match self.request(node, &unlink, 1, SLACK, int_reply) {
                    Some(n) => removed += n,
                    None => return removed,
                }
            }
            if next == b"0" {
                return removed;
            }
            cursor = next;
        }
        removed
    }

    fn discard(&self, key: &str) {
        match &self.servers {
            Servers::Single(node) => {
                let unlink = redis::cmd("UNLINK").arg(key).get_packed_command();
                self.request(node, &unlink, 1, SLACK, int_reply);
            }
            Servers::Cluster(c) => {
                let unlink = builder(|_: usize, p: &mut Segments<'_>| {
                    p.simple(&[b"UNLINK", key.as_bytes()]);
                });
                c.run(
                    &[key],
                    &unlink,
                    0,
                    deadline_in(self.timeout),
                    &self.counters,
                );
            }
        }
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}

/// A `SCAN` reply's next cursor and keys; `None` for a reply of another shape.
fn scan_page(r: Vec<Value>) -> Option<(Vec<u8>, Vec<Vec<u8>>)> {
    let Some(Value::Array(mut parts)) = r.into_iter().next() else {
        return None;
    };
    let (Some(Value::Array(keys)), Some(Value::BulkString(next))) = (parts.pop(), parts.pop())
    else {
        return None;
    };
    let keys: Option<Vec<Vec<u8>>> = keys
        .into_iter()
        .map(|k| match k {
            Value::BulkString(k) => Some(k),
            _ => None,
        })
        .collect();
    Some((next, keys?))
}

/// The count an integer reply (`UNLINK`'s) holds.
fn int_reply(r: Vec<Value>) -> Option<usize> {
    match r.as_slice() {
        [Value::Int(n)] => usize::try_from(*n).ok(),
        _ => None,
    }
}
