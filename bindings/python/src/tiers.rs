//! `kvrs.HostTier`, `kvrs.DiskTier` and `kvrs.RedisTier`: offload tiers a `BlockPool` is given with
//! `tiers=[...]`, and the tier parts of the pool's and sequences' Python surface.

use std::path::PathBuf;
use std::sync::Arc;
#[cfg(feature = "redis")]
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::ToPython;
use kvrs::tier::{DiskTier, HostTier, Tier};
#[cfg(feature = "redis")]
use kvrs::tier::{RedisTier, TlsOptions};
use kvrs::unstable::{parse_size, PoolCore};
use kvrs::KvError;

/// `max_bytes` (an int or a size such as "8GiB") as a positive byte count.
fn byte_bound(max_bytes: &Bound<'_, PyAny>) -> PyResult<u64> {
    size_arg("max_bytes", max_bytes)
}

/// Argument `name` (an int or a size such as "8GiB") as a positive byte count.
pub fn size_arg(name: &'static str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let bytes = match value.extract::<i64>() {
        Ok(b) if b > 0 => b as usize,
        Ok(b) => {
            return Err(KvError::InvalidArgument {
                name,
                value: b.to_string(),
                reason: "must be > 0".into(),
            }
            .py())
        }
        Err(_) => parse_size(&value.str()?.to_string()).py()?,
    };
    if bytes == 0 {
        return Err(KvError::InvalidArgument {
            name,
            value: "0".into(),
            reason: "must be > 0".into(),
        }
        .py());
    }
    Ok(bytes as u64)
}

/// `tier_key` (bytes, or a str taken as UTF-8) as the secret's bytes.
pub fn secret(key: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = key.cast::<pyo3::types::PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(s) = key.extract::<String>() {
        return Ok(s.into_bytes());
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "tier_key must be bytes or str, not {}",
        key.get_type().name()?
    )))
}

/// Cached blocks in this process's memory, at most `max_bytes`, least recently used out
/// first: below a CUDA pool, evicted blocks are copied to the host once and come back
/// with one copy. Pools of one process can share it.
#[pyclass(name = "HostTier", module = "kvrs", frozen)]
pub struct PyHostTier {
    pub(crate) tier: Arc<HostTier>,
}

#[pymethods]
impl PyHostTier {
    #[new]
    #[pyo3(signature = (max_bytes))]
    fn new(max_bytes: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyHostTier {
            tier: Arc::new(HostTier::new(byte_bound(max_bytes)?)),
        })
    }

    /// The size bound in bytes.
    #[getter]
    fn max_bytes(&self) -> u64 {
        self.tier.max_bytes()
    }

    /// Bytes of blocks held now.
    fn used_bytes(&self) -> u64 {
        self.tier.used_bytes()
    }

    /// The raw payloads stored under `keys` (bytes, or None where absent): for
    /// inspection and tools (the pool checks payloads; this does not).
    #[pyo3(signature = (keys, max_bytes=RAW_MAX_BYTES))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        max_bytes: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        raw_get(py, self.tier.as_ref(), keys, max_bytes)
    }

    /// What the tier did, as a dict of counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counters(py, self.tier.as_ref())
    }

    fn __repr__(&self) -> String {
        format!("HostTier(max_bytes={})", self.tier.max_bytes())
    }
}

/// A directory of cached blocks bounded to `max_bytes` (an int or a size such as
/// "20GiB"), least recently used out first; safe to share between processes, and found
/// again after a restart.
#[pyclass(name = "DiskTier", module = "kvrs", frozen)]
pub struct PyDiskTier {
    pub(crate) tier: Arc<DiskTier>,
}

#[pymethods]
impl PyDiskTier {
    #[new]
    #[pyo3(signature = (path, max_bytes))]
    fn new(path: PathBuf, max_bytes: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyDiskTier {
            tier: Arc::new(DiskTier::open(path, byte_bound(max_bytes)?).py()?),
        })
    }

    /// The directory.
    #[getter]
    fn path(&self) -> PathBuf {
        self.tier.dir().to_path_buf()
    }

    /// The size bound in bytes.
    #[getter]
    fn max_bytes(&self) -> u64 {
        self.tier.max_bytes()
    }

    /// Bytes of block and temporary files in the directory now (every process's),
    /// counted afresh.
    fn used_bytes(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.tier.used_bytes())
    }

    /// The raw payloads stored under `keys` (bytes, or None where absent), in one
    /// batched request: for inspection and tools (the pool checks payloads; this does
    /// not).
    #[pyo3(signature = (keys, max_bytes=RAW_MAX_BYTES))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        max_bytes: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        raw_get(py, self.tier.as_ref(), keys, max_bytes)
    }

    /// What the tier did, as a dict of counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counters(py, self.tier.as_ref())
    }

    fn __repr__(&self) -> String {
        format!(
            "DiskTier('{}', max_bytes={})",
            self.tier.dir().display(),
            self.tier.max_bytes()
        )
    }
}

/// A Redis (or Valkey) server holding cached blocks for every process that uses it, or a
/// Redis Cluster (`cluster=True`, or a list of seed URLs). `timeout` (seconds) bounds
/// each request whole: connect, login, send and the full reply (on a cluster: every
/// node's request, sent at once, and a redirected key's second request); `ttl` (seconds)
/// expires stored blocks; `max_idle` connections are kept for reuse (per node); after a
/// failure the server (the node) is skipped for `retry_after` seconds. A server that is
/// down or slow makes lookups miss and stores drop (counted), never an error. A
/// `rediss://` URL (one server) is TLS, the server verified against the system's trust
/// roots and `tls_ca` (a PEM file of CAs), with a client certificate (`tls_cert`,
/// `tls_key`: PEM files) for `tls-auth-clients yes`.
#[cfg(feature = "redis")]
#[pyclass(name = "RedisTier", module = "kvrs", frozen)]
pub struct PyRedisTier {
    pub(crate) tier: Arc<RedisTier>,
}

/// A positive, finite number of seconds that a `Duration` holds.
#[cfg(feature = "redis")]
fn seconds(name: &'static str, s: f64) -> PyResult<Duration> {
    match Duration::try_from_secs_f64(s) {
        Ok(d) if s > 0.0 => Ok(d),
        _ => Err(KvError::InvalidArgument {
            name,
            value: s.to_string(),
            reason: format!(
                "must be a finite number of seconds > 0 and at most {}",
                Duration::MAX.as_secs()
            ),
        }
        .py()),
    }
}

/// `url=`: one URL, or a cluster's seed URLs.
#[cfg(feature = "redis")]
#[derive(FromPyObject)]
enum Urls {
    One(String),
    Many(Vec<String>),
}

#[cfg(feature = "redis")]
#[pymethods]
impl PyRedisTier {
    #[new]
    #[pyo3(
        signature = (url = Urls::One("redis://127.0.0.1:6379/0".into()), *, timeout = 0.1, ttl = None, max_idle = 8, retry_after = 1.0, cluster = None, tls_ca = None, tls_cert = None, tls_key = None),
        text_signature = "(url='redis://127.0.0.1:6379/0', *, timeout=0.1, ttl=None, max_idle=8, retry_after=1.0, cluster=None, tls_ca=None, tls_cert=None, tls_key=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: Urls,
        timeout: f64,
        ttl: Option<u64>,
        max_idle: usize,
        retry_after: f64,
        cluster: Option<bool>,
        tls_ca: Option<PathBuf>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
    ) -> PyResult<Self> {
        if ttl == Some(0) {
            return Err(KvError::InvalidArgument {
                name: "ttl",
                value: "0".into(),
                reason: "must be >= 1 second, or None for no expiry".into(),
            }
            .py());
        }
        let tls = TlsOptions {
            ca: tls_ca,
            cert: tls_cert,
            key: tls_key,
        };
        let (timeout, retry_after) = (
            seconds("timeout", timeout)?,
            seconds("retry_after", retry_after)?,
        );
        let (urls, listed) = match url {
            Urls::One(u) => (vec![u], false),
            Urls::Many(us) => (us, true),
        };
        let tier = match cluster.unwrap_or(listed) {
            true if tls.ca.is_some() || tls.cert.is_some() || tls.key.is_some() => {
                return Err(KvError::InvalidArgument {
                    name: "tls_ca",
                    value: "a cluster".into(),
                    reason: "TLS is supported on one server (rediss://), not on a cluster yet"
                        .into(),
                }
                .py())
            }
            true => {
                let seeds: Vec<&str> = urls.iter().map(String::as_str).collect();
                RedisTier::cluster(&seeds, timeout, ttl, max_idle, retry_after).py()?
            }
            false if urls.len() == 1 => {
                // Reads the trust roots and the files: without the GIL.
                let url = &urls[0];
                py.detach(|| RedisTier::with_tls(url, timeout, ttl, max_idle, retry_after, &tls))
                    .py()?
            }
            false => {
                return Err(KvError::InvalidArgument {
                    name: "url",
                    value: format!("a list of {} URLs", urls.len()),
                    reason: "several URLs are a cluster's seeds: cluster=False takes one".into(),
                }
                .py())
            }
        };
        Ok(PyRedisTier {
            tier: Arc::new(tier),
        })
    }

    /// Whether the tier is on a Redis Cluster.
    #[getter]
    fn cluster(&self) -> bool {
        self.tier.is_cluster()
    }

    /// The server's URL, with the password (if any) replaced by `***` (a cluster's seeds,
    /// joined by commas).
    #[getter]
    fn url(&self) -> &str {
        self.tier.url()
    }

    /// The raw payloads stored under `keys` (bytes, or None where absent), in one
    /// batched request: for inspection and tools (the pool checks payloads; this does
    /// not).
    #[pyo3(signature = (keys, max_bytes=RAW_MAX_BYTES))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        max_bytes: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        raw_get(py, self.tier.as_ref(), keys, max_bytes)
    }

    /// What the tier did, as a dict of counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counters(py, self.tier.as_ref())
    }

    fn __repr__(&self) -> String {
        match self.tier.is_cluster() {
            true => format!("RedisTier('{}', cluster=True)", self.tier.url()),
            false => format!("RedisTier('{}')", self.tier.url()),
        }
    }
}

/// `kvrs.RedisTier` in a build without the `redis` feature: the class exists (the
/// package's API is the same in every build) and making one raises `NotSupportedError`
/// naming the feature to build with.
#[cfg(not(feature = "redis"))]
#[pyclass(name = "RedisTier", module = "kvrs", frozen)]
pub struct PyRedisTier;

#[cfg(not(feature = "redis"))]
#[pymethods]
impl PyRedisTier {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(
        _args: &Bound<'_, pyo3::types::PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        Err(KvError::NotSupported(
            "kvrs.RedisTier needs kvrs built with the `redis` cargo feature (`redis-tls` for \
             rediss://), as the released wheels are: maturin reads them from pyproject.toml"
                .into(),
        )
        .py())
    }
}

/// The default bound of a raw `get`'s payloads (larger ones are `None`).
const RAW_MAX_BYTES: usize = 1 << 30;

/// The raw payloads of `keys` from `tier`, each at most `max_bytes` (one batched
/// request, without the GIL).
fn raw_get<'py>(
    py: Python<'py>,
    tier: &dyn Tier,
    keys: Vec<String>,
    max_bytes: usize,
) -> PyResult<Bound<'py, PyList>> {
    let got = py.detach(|| tier.get_many(&keys, 0..=max_bytes));
    let out = PyList::empty(py);
    for g in got {
        match g {
            Some(bytes) => out.append(pyo3::types::PyBytes::new(py, &bytes))?,
            None => out.append(py.None())?,
        }
    }
    Ok(out)
}

/// A tier's counters as a dict, with its name.
/// A tier's counters as a dict, with its name.
fn counters<'py>(py: Python<'py>, tier: &dyn Tier) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", tier.name())?;
    for (k, v) in tier.counters().snapshot() {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// The tiers of `tiers=[...]` (each a `HostTier`, `DiskTier` or `RedisTier`).
pub fn parse_tiers(tiers: Option<&Bound<'_, PyList>>) -> PyResult<Vec<Arc<dyn Tier>>> {
    let Some(list) = tiers else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|t| {
            if let Ok(h) = t.cast::<PyHostTier>() {
                Ok(h.get().tier.clone() as Arc<dyn Tier>)
            } else if let Ok(d) = t.cast::<PyDiskTier>() {
                Ok(d.get().tier.clone() as Arc<dyn Tier>)
            } else {
                #[cfg(feature = "redis")]
                if let Ok(r) = t.cast::<PyRedisTier>() {
                    return Ok(r.get().tier.clone() as Arc<dyn Tier>);
                }
                Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "tiers: expected kvrs.HostTier, kvrs.DiskTier or kvrs.RedisTier items, got {}",
                    t.get_type().name()?
                )))
            }
        })
        .collect()
}

/// What `BlockPool.stats()` reports of the tiers, read under the pool's lock as plain
/// data (the dicts are built after it is released).
/// A tier's name, counters ([`kvrs::tier::TierCounters::snapshot`]) and last error.
type TierCountersSnapshot = (String, [(&'static str, u64); 8], Option<String>);

pub struct TierSnapshot {
    /// Each tier's name, counters and last error.
    tiers: Vec<TierCountersSnapshot>,
    /// The write-back queue's counters.
    queue: [(&'static str, u64); 4],
    /// The prefetch buffer's counters and contents.
    prefetch: [(&'static str, u64); 6],
}

/// The tiers' counters of `pool` (`None` without tiers).
pub fn tier_snapshot(pool: &PoolCore) -> Option<TierSnapshot> {
    let ts = pool.tiers()?;
    let get = |x: &std::sync::atomic::AtomicU64| x.load(std::sync::atomic::Ordering::Relaxed);
    let w = ts.writer.counters();
    let f = ts.fetcher.counters();
    let (payloads, bytes) = ts.fetcher.buffered();
    Some(TierSnapshot {
        tiers: ts
            .tiers
            .iter()
            .map(|t| {
                let c = t.counters();
                (t.name().to_string(), c.snapshot(), c.last_error())
            })
            .collect(),
        queue: [
            ("queued", get(&w.queued)),
            ("dropped", get(&w.dropped)),
            ("unstored", get(&w.unstored)),
            ("queued_bytes", ts.writer.queued_bytes() as u64),
        ],
        prefetch: [
            ("requested", get(&f.requested)),
            ("fetched", get(&f.fetched)),
            ("used", get(&f.used)),
            ("discarded", get(&f.discarded)),
            ("buffered", payloads as u64),
            ("buffered_bytes", bytes as u64),
        ],
    })
}

/// Adds the tiers' entries of `stats()` (`tiers`, `tier_queue`, `prefetch`) to `d`.
pub fn tier_stats<'py>(
    py: Python<'py>,
    snap: &TierSnapshot,
    d: &Bound<'py, PyDict>,
) -> PyResult<()> {
    let list = PyList::empty(py);
    for (name, counters, last_error) in &snap.tiers {
        let t = PyDict::new(py);
        t.set_item("name", name)?;
        for (k, v) in counters {
            t.set_item(k, v)?;
        }
        t.set_item("last_error", last_error)?;
        list.append(t)?;
    }
    d.set_item("tiers", list)?;
    for (key, entries) in [
        ("tier_queue", &snap.queue[..]),
        ("prefetch", &snap.prefetch[..]),
    ] {
        let e = PyDict::new(py);
        for (k, v) in entries {
            e.set_item(k, v)?;
        }
        d.set_item(key, e)?;
    }
    Ok(())
}

/// The tokens the pool itself (first entry, named "pool") and each tier served when
/// sequence `s` started, read under the pool's lock.
pub fn cached_by_tier(pool: &PoolCore, s: &kvrs::unstable::SeqState) -> Vec<(String, usize)> {
    let from_tiers: usize = s.tier_tokens.iter().sum();
    let mut out = vec![("pool".to_string(), s.num_cached_tokens - from_tiers)];
    if let Some(ts) = pool.tiers() {
        out.extend(
            ts.tiers
                .iter()
                .zip(s.tier_tokens.iter().chain(std::iter::repeat(&0)))
                .map(|(t, &n)| (t.name().to_string(), n)),
        );
    }
    out
}

/// Waits (at most 10 s, the GIL released) until every pool of this process has written
/// what it queued for its tiers; returns whether all did in time. `kvrs` registers it
/// with `atexit`: a process that exits without closing its pools (whose objects Python
/// may never drop) still leaves its written-through blocks in its tiers.
#[pyfunction]
pub fn _flush_tiers_at_exit(py: Python<'_>) -> bool {
    let deadline = std::time::Instant::now() + kvrs::unstable::DROP_DEADLINE;
    py.detach(|| kvrs::tier::flush_all(deadline))
}
