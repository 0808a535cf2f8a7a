//! A Redis Cluster behind [`RedisTier`](super::RedisTier): keys spread over 16384 slots,
//! each slot served by one master.
//!
//! The slot map comes from `CLUSTER SLOTS`, asked of a known master or a seed, and is
//! cached. It is refreshed at the start of a request (at most once per request, and at
//! most once per [`REFRESH_GAP`]) after a node failed or was skipped, after a `MOVED`
//! reply, or while some slot has no known master. A request groups its keys by master
//! and sends each master one pipeline (a `GET` or `SET` per key: a cluster refuses an
//! `MGET` across slots), to every master at once on scoped threads, all under one
//! deadline. A key answered `MOVED` (the map is updated for its slot) or `ASK` (asked
//! again after `ASKING`) is sent once more to that node under the same deadline; any
//! other answer, or a second redirection, is a miss. A node that fails or is slow makes
//! only its own keys miss: health is kept per node (skipped for `retry_after`, then one
//! probe at a time), and the other nodes' values are used.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::Value;

use super::conn::Target;
use super::node::{deadline_in, Failure, Node};
use super::resp::Segments;
use super::slots::{join, key_slot, split, Redirect, SlotMap};
use super::{int_reply, scan_page, PER_VALUE, SCAN_CAP, SCAN_COUNT, SLACK};
use crate::tier::TierCounters;

/// The least time between two refreshes of the slot map (a failover in progress
/// otherwise refreshes it on every request).
pub(super) const REFRESH_GAP: Duration = Duration::from_millis(100);

/// The nodes of a cluster and its slot map.
pub(super) struct Cluster {
    /// The seeds' addresses (`host:port`), asked for the map when no master answers.
    seeds: Vec<String>,
    /// The login of every node (a seed's target; its address is replaced per node).
    login: Target,
    max_idle: usize,
    retry_after: Duration,
    /// Every node met so far, by address.
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    topology: Mutex<Topology>,
}

/// The cached slot map and whether it needs a refresh.
#[derive(Default)]
struct Topology {
    map: Option<Arc<SlotMap>>,
    stale: bool,
    refreshed: Option<Instant>,
}

/// A key's command appended to a node's pipeline (`i`: the key's index); its long
/// arguments are borrowed, not copied ([`Segments`]).
type Build<'a> = dyn Fn(usize, &mut Segments<'a>) + Sync + 'a;

/// `f` as a [`Build`] whose borrowed arguments live for `'a` (a closure alone would be
/// asked to append arguments of any lifetime).
pub(super) fn builder<'a, F: Fn(usize, &mut Segments<'a>) + Sync>(f: F) -> F {
    f
}

/// The keys sent to one node in one pipeline.
struct Batch {
    addr: String,
    keys: Vec<usize>,
    /// Each command preceded by `ASKING` (an `ASK` redirection).
    asking: bool,
}

impl Cluster {
    /// A cluster found through `seeds` (TCP targets with the same login); no connection
    /// is made yet.
    pub(super) fn new(seeds: &[Target], max_idle: usize, retry_after: Duration) -> Self {
        let addrs = seeds
            .iter()
            .filter_map(|t| t.tcp().map(|(h, p)| join(h, p)))
            .collect();
        Cluster {
            seeds: addrs,
            login: seeds[0].at("", 0),
            max_idle,
            retry_after,
            nodes: Mutex::new(HashMap::new()),
            topology: Mutex::new(Topology::default()),
        }
    }

    /// The node at `addr` (`host:port`), met before or new.
    fn node(&self, addr: &str) -> Option<Arc<Node>> {
        let mut nodes = self.nodes.lock();
        if let Some(n) = nodes.get(addr) {
            return Some(n.clone());
        }
        let (host, port) = split(addr)?;
        let node = Arc::new(Node::new(
            self.login.at(host, port),
            self.max_idle,
            self.retry_after,
        ));
        nodes.insert(addr.to_string(), node.clone());
        Some(node)
    }

    /// Marks the map for a refresh by the next request.
    fn mark_stale(&self) {
        self.topology.lock().stale = true;
    }

    /// The slot map, refreshed first when it is missing or stale (and the last refresh is
    /// older than [`REFRESH_GAP`]).
    fn plan(&self, deadline: Instant, counters: &TierCounters) -> Option<Arc<SlotMap>> {
        let (map, due) = {
            let mut t = self.topology.lock();
            let due = (t.map.is_none() || t.stale)
                && t.refreshed.is_none_or(|at| at.elapsed() >= REFRESH_GAP);
            if due {
                t.refreshed = Some(Instant::now());
            }
            (t.map.clone(), due)
        };
        if !due {
            return map;
        }
        match self.fetch_map(deadline, counters) {
            Some(fresh) => {
                let fresh = Arc::new(fresh);
                let mut t = self.topology.lock();
                t.stale = fresh.slots.iter().any(Option::is_none);
                t.map = Some(fresh.clone());
                Some(fresh)
            }
            None => map,
        }
    }

    /// A fresh map from the first node that gives one: the known masters, then the
    /// seeds (nodes marked down are skipped).
    fn fetch_map(&self, deadline: Instant, counters: &TierCounters) -> Option<SlotMap> {
        let mut candidates: Vec<String> = {
            let t = self.topology.lock();
            t.map
                .as_ref()
                .map(|m| m.masters.clone())
                .unwrap_or_default()
        };
        for s in &self.seeds {
            if !candidates.contains(s) {
                candidates.push(s.clone());
            }
        }
        let ask = redis::cmd("CLUSTER").arg("SLOTS").get_packed_command();
        for addr in candidates {
            let Some(node) = self.node(&addr) else {
                continue;
            };
            if node.is_down() {
                continue;
            }
            let host = node.target().tcp().map_or("", |(h, _)| h).to_string();
            let got = node.request(&ask, 1, SCAN_CAP, deadline, counters, |r| {
                SlotMap::parse(r.into_iter().next()?, &host)
            });
            if let Ok(map) = got {
                return Some(map);
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        None
    }

    /// Sends each key's command (`build`) to the master of its slot, one pipeline per
    /// master, all under `deadline`; a reply may take `value_cap` bytes of value. The
    /// reply per key, or `None` (its node failed, no master known, redirected twice).
    pub(super) fn run(
        &self,
        keys: &[&str],
        build: &Build<'_>,
        value_cap: usize,
        deadline: Instant,
        counters: &TierCounters,
    ) -> Vec<Option<Value>> {
        let mut out = vec![None; keys.len()];
        let Some(map) = self.plan(deadline, counters) else {
            counters.fail("no slot map: no seed node of the cluster answered");
            return out;
        };
        let mut by_node: HashMap<&str, Vec<usize>> = HashMap::new();
        let mut unmapped = false;
        for (i, k) in keys.iter().enumerate() {
            match map.master(key_slot(k.as_bytes())) {
                Some(addr) => by_node.entry(addr).or_default().push(i),
                None => unmapped = true,
            }
        }
        if unmapped {
            counters.fail("a key's hash slot has no master in the cluster's slot map");
            self.mark_stale();
        }
        let batches = by_node
            .into_iter()
            .map(|(addr, keys)| Batch {
                addr: addr.to_string(),
                keys,
                asking: false,
            })
            .collect();
        let mut again: HashMap<(String, bool), Vec<usize>> = HashMap::new();
        for (batch, replies) in self.send_all(batches, build, value_cap, deadline, counters) {
            for (i, v) in batch.keys.into_iter().zip(replies) {
                match Redirect::of(&v) {
                    Some(Redirect::Moved(slot, addr)) => {
                        let mut t = self.topology.lock();
                        if let Some(m) = t.map.as_mut() {
                            Arc::make_mut(m).set(slot, &addr);
                        }
                        t.stale = true;
                        again.entry((addr, false)).or_default().push(i);
                    }
                    Some(Redirect::Ask(_, addr)) => again.entry((addr, true)).or_default().push(i),
                    None => out[i] = Some(v),
                }
            }
        }
        let batches = again
            .into_iter()
            .map(|((addr, asking), keys)| Batch { addr, keys, asking })
            .collect();
        for (batch, replies) in self.send_all(batches, build, value_cap, deadline, counters) {
            for (i, v) in batch.keys.into_iter().zip(replies) {
                if Redirect::of(&v).is_none() {
                    out[i] = Some(v);
                }
            }
        }
        out
    }

    /// Sends every batch, each to its node in one request, concurrently (the first on
    /// this thread, the others on scoped threads). The replies per batch, one per key;
    /// none for a batch whose node failed (its keys miss, the map is refreshed next).
    fn send_all(
        &self,
        batches: Vec<Batch>,
        build: &Build<'_>,
        value_cap: usize,
        deadline: Instant,
        counters: &TierCounters,
    ) -> Vec<(Batch, Vec<Value>)> {
        let one = |b: &Batch| self.send(b, build, value_cap, deadline, counters);
        let results: Vec<Result<Vec<Value>, Failure>> = match batches.as_slice() {
            [] => Vec::new(),
            [only] => vec![one(only)],
            [first, rest @ ..] => thread::scope(|s| {
                let handles: Vec<_> = rest
                    .iter()
                    .map(|b| {
                        thread::Builder::new()
                            .name("kvrs-redis-node".into())
                            .spawn_scoped(s, move || one(b))
                    })
                    .collect();
                let mut results = vec![one(first)];
                for (h, b) in handles.into_iter().zip(rest) {
                    results.push(match h {
                        Ok(h) => h.join().unwrap_or(Err(Failure::Failed)),
                        // No thread to be had: this one sends it.
                        Err(_) => one(b),
                    });
                }
                results
            }),
        };
        let mut out = Vec::with_capacity(batches.len());
        for (b, r) in batches.into_iter().zip(results) {
            match r {
                Ok(values) => out.push((b, values)),
                Err(_) => self.mark_stale(),
            }
        }
        out
    }

    /// One batch to its node: one pipeline, one reply per key (after `ASKING`'s, when
    /// asked).
    fn send(
        &self,
        batch: &Batch,
        build: &Build<'_>,
        value_cap: usize,
        deadline: Instant,
        counters: &TierCounters,
    ) -> Result<Vec<Value>, Failure> {
        let Some(node) = self.node(&batch.addr) else {
            counters.fail(format!("no connection to cluster node {}", batch.addr));
            return Err(Failure::Failed);
        };
        let mut p = Segments::new();
        for &i in &batch.keys {
            if batch.asking {
                p.simple(&[b"ASKING"]);
            }
            build(i, &mut p);
        }
        let per_key = if batch.asking { 2 } else { 1 };
        let cap = batch
            .keys
            .len()
            .saturating_mul(value_cap.saturating_add(PER_VALUE * per_key))
            .saturating_add(SLACK);
        let replies = batch.keys.len() * per_key;
        node.request_parts(&p.slices(), replies, cap, deadline, counters, |values| {
            if !batch.asking {
                return Some(values);
            }
            let mut out = Vec::with_capacity(batch.keys.len());
            let mut it = values.into_iter();
            while let (Some(asking), Some(v)) = (it.next(), it.next()) {
                if !matches!(asking, Value::Okay) {
                    return None;
                }
                out.push(v);
            }
            Some(out)
        })
    }

    /// Removes every key matching `pattern` from every master: on each, `SCAN` pages and a
    /// pipeline of `UNLINK`s per page (each request bounded by `timeout`); a master that
    /// fails is left for later. Returns how many keys went.
    pub(super) fn drop_matching(
        &self,
        pattern: &str,
        timeout: Duration,
        counters: &TierCounters,
    ) -> usize {
        let Some(map) = self.plan(deadline_in(timeout), counters) else {
            counters.fail("no slot map: no seed node of the cluster answered");
            return 0;
        };
        let mut serving: Vec<u16> = map.slots.iter().flatten().copied().collect();
        serving.sort_unstable();
        serving.dedup();
        let mut removed = 0;
        for i in serving {
            let Some(node) = self.node(&map.masters[usize::from(i)]) else {
                continue;
            };
            removed += drop_on(&node, pattern, timeout, counters);
        }
        removed
    }
}

/// `SCAN MATCH pattern` + `UNLINK` on one node (one `UNLINK` per key: a cluster refuses
/// one across slots); stops at the node's first failure.
fn drop_on(node: &Node, pattern: &str, timeout: Duration, counters: &TierCounters) -> usize {
    let mut cursor = b"0".to_vec();
    let mut removed = 0;
    let give_up = std::time::Instant::now() + super::DROP_DEADLINE;
    while std::time::Instant::now() < give_up {
        let scan = redis::cmd("SCAN")
            .arg(&cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .get_packed_command();
        let page = node.request(
            &scan,
            1,
            SCAN_CAP,
            deadline_in(timeout),
            counters,
            scan_page,
        );
        let Ok((next, keys)) = page else {
            return removed;
        };
        if !keys.is_empty() {
            let mut p = redis::pipe();
            for k in &keys {
                p.cmd("UNLINK").arg(k);
            }
            let cap = keys.len().saturating_mul(PER_VALUE).saturating_add(SLACK);
            let got = node.request(
                &p.get_packed_pipeline(),
                keys.len(),
                cap,
                deadline_in(timeout),
                counters,
                |r| {
                    // A key moved away meanwhile (an error reply) counts nothing.
                    Some(
                        r.into_iter()
                            .filter_map(|v| int_reply(vec![v]))
                            .sum::<usize>(),
                    )
                },
            );
            match got {
                Ok(n) => removed += n,
                Err(_) => return removed,
            }
        }
        if next == b"0" {
            return removed;
        }
        cursor = next;
    }
    removed
}
