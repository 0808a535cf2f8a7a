//! [`RedisTier`]: block payloads in a Redis (or Valkey) server, shared by every process
//! that points at it.
//!
//! Each lookup is one `MGET` of all the keys it needs (a pipeline of several past
//! [`MGET_BATCH`] keys) and each store one pipeline of `SET key payload [EX ttl]`: one
//! write and one read of all the replies per batch. The `redis` crate parses the URL,
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
//! Server settings a shared prefix cache wants: `maxmemory <bytes>` and
//! `maxmemory-policy allkeys-lru` (the server then evicts least recently used blocks),
//! and no persistence unless warm restarts of the server matter (`save ""`,
//! `appendonly no`).

mod conn;
#[cfg(test)]
mod tests;
mod tls;

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::{Client, Value};

use self::conn::{redact_text, Conn, Target};
pub use self::tls::TlsOptions;
use super::{Tier, TierCounters};
use crate::error::{KvError, Result};

/// Block payloads in a Redis server.
pub struct RedisTier {
    name: String,
    url: String,
    target: Target,
    timeout: Duration,
    ttl: Option<u64>,
    retry_after: Duration,
    max_idle: usize,
    idle: Mutex<Vec<Conn>>,
    health: Mutex<Health>,
    counters: TierCounters,
}

/// Whether the server is usable.
#[derive(Default)]
struct Health {
    /// When the last failure happened: requests before `retry_after` has passed are
    /// skipped.
    down_since: Option<Instant>,
    /// The process whose caller is probing a server marked down (others skip until it is
    /// done); a parent's probe, seen in a child after `fork`, is not the child's.
    probe: Option<u32>,
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("url", &self.url)
            .field("timeout", &self.timeout)
            .field("ttl", &self.ttl)
            .field("retry_after", &self.retry_after)
            .finish_non_exhaustive()
    }
}

/// Most keys in one `MGET` (a lookup sends several in one pipeline beyond that).
const MGET_BATCH: usize = 256;

/// Bytes a reply may take beyond what its values account for (headers, login replies).
const SLACK: usize = 64 << 10;

/// Bytes of the framing of one value in a reply (`$<len>\r\n...\r\n`), at most.
const PER_VALUE: usize = 32;

/// Keys asked per `SCAN`.
const SCAN_COUNT: usize = 1000;
/// Bytes a `SCAN` reply may take.
const SCAN_CAP: usize = 16 << 20;

impl RedisTier {
    /// A tier on the server at `url` (`redis://[user:password@]host[:port][/db]`, or
    /// `rediss://` for TLS with the system's trust roots); no connection is made yet.
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
        let tls = TlsOptions::default();
        Self::with_tls(url, timeout, ttl, max_idle, retry_after, &tls)
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
        let (plain, on) = tls::plain_url(url).map_err(bad_url)?;
        let client =
            Client::open(plain.as_ref()).map_err(|e| bad_url(format!("not a Redis URL: {e}")))?;
        let target = Target::new(client.get_connection_info())
            .map_err(bad_url)?
            .with_tls(on, tls)?;
        if timeout.is_zero() {
            return Err(KvError::InvalidArgument {
                name: "timeout",
                value: "0".into(),
                reason: "must be > 0: a request must never wait unboundedly".into(),
            });
        }
        Ok(RedisTier {
            name: target.name(),
            url: target.redacted_url(),
            target,
            timeout,
            ttl,
            retry_after,
            max_idle,
            idle: Mutex::new(Vec::new()),
            health: Mutex::new(Health::default()),
            counters: TierCounters::default(),
        })
    }

    /// The server's URL with the password replaced by `***`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether a request may go to the server now: `Some(probing)`, or `None` while the
    /// server is marked down (or another caller of this process is probing it).
    fn admit(&self) -> Option<bool> {
        let mut h = self.health.lock();
        let Some(down_since) = h.down_since else {
            return Some(false);
        };
        let pid = std::process::id();
        if down_since.elapsed() < self.retry_after || h.probe == Some(pid) {
            return None;
        }
        h.probe = Some(pid);
        Some(true)
    }

    /// Ends a request: marks the server up or down and ends this caller's probe.
    fn finish(&self, probing: bool, ok: bool) {
        let mut h = self.health.lock();
        if probing && h.probe == Some(std::process::id()) {
            h.probe = None;
        }
        h.down_since = if ok { None } else { Some(Instant::now()) };
    }

    /// A pooled connection of this process, if any (connections another process opened,
    /// a parent's seen after `fork`, are closed in this process unused).
    fn pooled(&self) -> Option<Conn> {
        let pid = std::process::id();
        let mut idle = self.idle.lock();
        idle.retain(|c| c.pid() == pid);
        idle.pop()
    }

    /// One request: `packed` (commands, encoded) sent on a pooled or new connection and
    /// its `replies` replies read, all within `timeout` and `cap` bytes; `check` turns
    /// the replies into the result, or `None` for a reply that makes no sense. On any
    /// failure the connection is dropped, an error counted, the server marked down, and
    /// the result is `None`; while it is down, `None` at once (counted too).
    fn request<R>(
        &self,
        packed: &[u8],
        replies: usize,
        cap: usize,
        check: impl FnOnce(Vec<Value>) -> Option<R>,
    ) -> Option<R> {
        let Some(probing) = self.admit() else {
            TierCounters::add(&self.counters.errors, 1);
            return None;
        };
        let now = Instant::now();
        // A timeout past the clock's range waits "forever" (a century).
        let deadline = now
            .checked_add(self.timeout)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400));
        let conn = match self.pooled() {
            Some(c) => Ok(c),
            None => Conn::open(&self.target, deadline),
        };
        let got = conn.ok().and_then(|mut c| {
            let values = c.exchange(packed, replies, cap, deadline).ok()?;
            check(values).map(|r| (r, c))
        });
        self.finish(probing, got.is_some());
        match got {
            Some((r, c)) => {
                let mut idle = self.idle.lock();
                if idle.len() < self.max_idle {
                    idle.push(c);
                }
                Some(r)
            }
            None => {
                TierCounters::add(&self.counters.errors, 1);
                // Connections made before the failure may be dead too.
                self.idle.lock().clear();
                None
            }
        }
    }
}

/// The values of a pipeline of `MGET`s, one per key of `keys` in order: `None` unless
/// every reply is an array of exactly its keys' count of values, each nil or a string.
fn mget_values(keys: &[String], replies: Vec<Value>) -> Option<Vec<Option<Vec<u8>>>> {
    let mut out = Vec::with_capacity(keys.len());
    for (reply, chunk) in replies.into_iter().zip(keys.chunks(MGET_BATCH)) {
        let Value::Array(values) = reply else {
            return None;
        };
        if values.len() != chunk.len() {
            return None;
        }
        for v in values {
            match v {
                Value::Nil => out.push(None),
                Value::BulkString(b) => out.push(Some(b)),
                _ => return None,
            }
        }
    }
    (out.len() == keys.len()).then_some(out)
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
        let mut p = redis::pipe();
        for chunk in keys.chunks(MGET_BATCH) {
            p.cmd("MGET").arg(chunk);
        }
        let replies = keys.len().div_ceil(MGET_BATCH);
        let cap = keys
            .len()
            .saturating_mul(sizes.end().saturating_add(PER_VALUE))
            .saturating_add(SLACK);
        let got = self.request(&p.get_packed_pipeline(), replies, cap, |r| {
            mget_values(keys, r)
        });
        let Some(values) = got else {
            return vec![None; keys.len()];
        };
        values
            .into_iter()
            .map(|p| {
                let p = p?;
                if sizes.contains(&p.len()) {
                    Some(p)
                } else {
                    TierCounters::add(&self.counters.rejected, 1);
                    None
                }
            })
            .collect()
    }

    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
        if items.is_empty() {
            return Vec::new();
        }
        let mut p = redis::pipe();
        for (k, v) in items {
            let cmd = p.cmd("SET").arg(k).arg(v.as_slice());
            if let Some(ttl) = self.ttl {
                cmd.arg("EX").arg(ttl);
            }
        }
        let cap = items.len().saturating_mul(PER_VALUE).saturating_add(SLACK);
        let ok = self
            .request(&p.get_packed_pipeline(), items.len(), cap, |r| {
                r.iter().all(|v| matches!(v, Value::Okay)).then_some(())
            })
            .is_some();
        if ok {
            TierCounters::add(&self.counters.stores, items.len() as u64);
            let bytes: usize = items.iter().map(|(_, v)| v.len()).sum();
            TierCounters::add(&self.counters.store_bytes, bytes as u64);
        }
        vec![ok; items.len()]
    }

    /// One request (each bounded by `timeout`) per `SCAN` page and one per `UNLINK` of
    /// the keys found; stops at the first failure.
    fn drop_prefix(&self, prefix: &str) -> usize {
        let pattern = format!("{prefix}*");
        let mut cursor = b"0".to_vec();
        let mut removed = 0;
        loop {
            let scan = redis::cmd("SCAN")
                .arg(&cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .get_packed_command();
            let page = self.request(&scan, 1, SCAN_CAP, |r| {
                let Some(Value::Array(mut parts)) = r.into_iter().next() else {
                    return None;
                };
                let (Some(Value::Array(keys)), Some(Value::BulkString(next))) =
                    (parts.pop(), parts.pop())
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
            });
            let Some((next, keys)) = page else {
                return removed;
            };
            if !keys.is_empty() {
                let unlink = redis::cmd("UNLINK").arg(&keys).get_packed_command();
                match self.request(&unlink, 1, SLACK, int_reply) {
                    Some(n) => removed += n,
                    None => return removed,
                }
            }
            if next == b"0" {
                return removed;
            }
            cursor = next;
        }
    }

    fn discard(&self, key: &str) {
        let unlink = redis::cmd("UNLINK").arg(key).get_packed_command();
        self.request(&unlink, 1, SLACK, int_reply);
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}

/// The count an integer reply (`UNLINK`'s) holds.
fn int_reply(r: Vec<Value>) -> Option<usize> {
    match r.as_slice() {
        [Value::Int(n)] => usize::try_from(*n).ok(),
        _ => None,
    }
}
