//! [`RedisTier`]: block payloads in a Redis (or Valkey) server, shared by every process
//! that points at it, through the `redis` crate's synchronous client.
//!
//! Each lookup is one `MGET` of all the keys it needs and each store one pipeline of
//! `SET key payload [EX ttl]`: one round trip per batch. Connections are kept in a small
//! pool and reused. Every request has a timeout (connect, read and write), and after a
//! failure the tier stays off for `retry_after`, so a server that is down or slow costs
//! at most one timeout per `retry_after`: lookups are misses and stores are dropped
//! (both counted as errors), and generation never waits unboundedly.
//!
//! Server settings a shared prefix cache wants: `maxmemory <bytes>` and
//! `maxmemory-policy allkeys-lru` (the server then evicts least recently used blocks),
//! and no persistence unless warm restarts of the server matter (`save ""`,
//! `appendonly no`).

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::{Client, Connection};

use super::{Tier, TierCounters};
use crate::error::{KvError, Result};

/// Block payloads in a Redis server.
pub struct RedisTier {
    name: String,
    client: Client,
    timeout: Duration,
    ttl: Option<u64>,
    retry_after: Duration,
    max_idle: usize,
    idle: Mutex<Vec<Connection>>,
    /// When the last failure happened: requests before `retry_after` has passed are
    /// skipped.
    down_since: Mutex<Option<Instant>>,
    counters: TierCounters,
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("name", &self.name)
            .field("timeout", &self.timeout)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// Most keys in one `MGET` (a lookup sends several in one pipeline beyond that).
const MGET_BATCH: usize = 256;

impl RedisTier {
    /// A tier on the server at `url` (`redis://[user:password@]host[:port][/db]`); no
    /// connection is made yet. `timeout` bounds each connect, read and write; `ttl`
    /// (seconds) expires stored blocks; `max_idle` connections are kept for reuse; after
    /// a failure the tier is skipped for `retry_after`.
    pub fn new(
        url: &str,
        timeout: Duration,
        ttl: Option<u64>,
        max_idle: usize,
        retry_after: Duration,
    ) -> Result<Self> {
        let client = Client::open(url).map_err(|e| KvError::InvalidArgument {
            name: "url",
            value: url.to_string(),
            reason: format!("not a Redis URL: {e}"),
        })?;
        if timeout.is_zero() {
            return Err(KvError::InvalidArgument {
                name: "timeout",
                value: "0".into(),
                reason: "must be > 0: a request must never wait unboundedly".into(),
            });
        }
        let info = client.get_connection_info();
        let name = format!("redis://{}/{}", info.addr(), info.redis_settings().db());
        Ok(RedisTier {
            name,
            client,
            timeout,
            ttl,
            retry_after,
            max_idle,
            idle: Mutex::new(Vec::new()),
            down_since: Mutex::new(None),
            counters: TierCounters::default(),
        })
    }

    /// Runs `f` on a pooled connection; on failure counts an error, drops the connection
    /// and marks the server down. `None` when the server is marked down or `f` failed.
    fn with_connection<R>(
        &self,
        f: impl FnOnce(&mut Connection) -> redis::RedisResult<R>,
    ) -> Option<R> {
        if let Some(t) = *self.down_since.lock() {
            if t.elapsed() < self.retry_after {
                TierCounters::add(&self.counters.errors, 1);
                return None;
            }
        }
        let pooled = self.idle.lock().pop();
        let con = match pooled {
            Some(c) => Ok(c),
            None => self
                .client
                .get_connection_with_timeout(self.timeout)
                .and_then(|c| {
                    c.set_read_timeout(Some(self.timeout))?;
                    c.set_write_timeout(Some(self.timeout))?;
                    Ok(c)
                }),
        };
        let result = con.and_then(|mut c| f(&mut c).map(|r| (r, c)));
        match result {
            Ok((r, c)) => {
                *self.down_since.lock() = None;
                let mut idle = self.idle.lock();
                if idle.len() < self.max_idle {
                    idle.push(c);
                }
                Some(r)
            }
            Err(_) => {
                TierCounters::add(&self.counters.errors, 1);
                *self.down_since.lock() = Some(Instant::now());
                // Connections made before the failure may be dead too.
                self.idle.lock().clear();
                None
            }
        }
    }
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
        let got = self.with_connection(|c| {
            let mut p = redis::pipe();
            for chunk in keys.chunks(MGET_BATCH) {
                p.cmd("MGET").arg(chunk);
            }
            p.query::<Vec<Vec<Option<Vec<u8>>>>>(c)
        });
        match got {
            Some(parts) => parts
                .into_iter()
                .flatten()
                .map(|p| {
                    let p = p?;
                    if sizes.contains(&p.len()) {
                        Some(p)
                    } else {
                        TierCounters::add(&self.counters.rejected, 1);
                        None
                    }
                })
                .collect(),
            None => vec![None; keys.len()],
        }
    }

    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
        if items.is_empty() {
            return Vec::new();
        }
        let ok = self
            .with_connection(|c| {
                let mut p = redis::pipe();
                for (k, v) in items {
                    let cmd = p.cmd("SET").arg(k).arg(v.as_slice());
                    if let Some(ttl) = self.ttl {
                        cmd.arg("EX").arg(ttl);
                    }
                    cmd.ignore();
                }
                p.query::<()>(c)
            })
            .is_some();
        if ok {
            TierCounters::add(&self.counters.stores, items.len() as u64);
            let bytes: usize = items.iter().map(|(_, v)| v.len()).sum();
            TierCounters::add(&self.counters.store_bytes, bytes as u64);
        }
        vec![ok; items.len()]
    }

    fn drop_prefix(&self, prefix: &str) -> usize {
        let pattern = format!("{prefix}*");
        self.with_connection(|c| {
            let mut cursor: u64 = 0;
            let mut removed = 0;
            loop {
                let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query(c)?;
                if !keys.is_empty() {
                    removed += redis::cmd("UNLINK").arg(&keys).query::<usize>(c)?;
                }
                if next == 0 {
                    return Ok(removed);
                }
                cursor = next;
            }
        })
        .unwrap_or(0)
    }

    fn discard(&self, key: &str) {
        self.with_connection(|c| redis::cmd("UNLINK").arg(key).query::<usize>(c));
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}
