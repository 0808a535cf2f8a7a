//! The prefetch thread: [`Fetcher::request`] returns at once, and a thread owned by the
//! pool asks the tiers for the keys (one batched request per tier, in order) and keeps
//! the payloads found in a bounded buffer. A later lookup takes its payloads from the
//! buffer, waiting for a fetch of its keys still under way, and asks the tiers only for
//! the rest; every payload is checked when it is used, as if a tier had just served it.
//!
//! Invariants: a key is `pending` from its request until the thread has asked every
//! tier for it (even if the thread dies); the buffer holds at most `max_payloads`
//! payloads, each of a length in `sizes` (a block's or a checkpoint's), oldest out first (counted in
//! `discarded`). The thread and the buffer belong to the process that started them
//! ([`PerProcess`]): a forked child starts its own on first use, and never waits for
//! the parent's fetches.

use std::collections::VecDeque;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rustc_hash::{FxHashMap, FxHashSet};

use super::Tier;
use crate::per_process::PerProcess;

/// Counters of the prefetch buffer.
#[derive(Debug, Default)]
pub struct FetchCounters {
    /// Keys requested.
    pub requested: AtomicU64,
    /// Payloads a tier returned into the buffer.
    pub fetched: AtomicU64,
    /// Payloads lookups took from the buffer.
    pub used: AtomicU64,
    /// Payloads pushed out of the full buffer before any lookup took them.
    pub discarded: AtomicU64,
}

/// Payloads fetched ahead of their lookup, and the keys still being fetched.
#[derive(Debug, Default)]
struct Buffer {
    /// Key: the index of the tier that returned it, and the payload.
    by_key: FxHashMap<String, (usize, Vec<u8>)>,
    order: VecDeque<String>,
    pending: FxHashSet<String>,
    /// Key prefixes dropped while fetches were pending: what those fetches bring back
    /// under them is not buffered (cleared when nothing is pending).
    dropped: Vec<String>,
}

/// The longest a lookup, a namespace drop or [`Fetcher::wait`] waits for fetches under
/// way; after it, the keys still pending count as absent from the buffer (a lookup then
/// asks the tiers itself, under its own deadline).
pub const PENDING_WAIT: Duration = Duration::from_secs(2);

/// State shared with the thread.
#[derive(Debug)]
struct Shared {
    buffer: Mutex<Buffer>,
    /// Signalled when pending keys are done.
    done: Condvar,
    max_payloads: usize,
    /// The lengths a payload may have: a tier's other values are refused unbuffered.
    sizes: RangeInclusive<usize>,
    counters: Arc<FetchCounters>,
}

/// The prefetch buffer and its thread.
#[derive(Debug)]
pub struct Fetcher {
    tiers: Vec<Arc<dyn Tier>>,
    sizes: RangeInclusive<usize>,
    max_payloads: usize,
    running: PerProcess<Running>,
    counters: Arc<FetchCounters>,
}

/// The buffer and thread of one process.
#[derive(Debug)]
struct Running {
    tx: Sender<Vec<String>>,
    thread: JoinHandle<()>,
    shared: Arc<Shared>,
}

impl Fetcher {
    /// Starts the thread asking `tiers` for payloads of a length in `sizes`, with a
    /// buffer of at most `max_payloads`.
    pub fn start(
        tiers: Vec<Arc<dyn Tier>>,
        sizes: RangeInclusive<usize>,
        max_payloads: usize,
    ) -> std::io::Result<Self> {
        let f = Fetcher {
            tiers,
            sizes,
            max_payloads: max_payloads.max(1),
            running: PerProcess::new(),
            counters: Arc::new(FetchCounters::default()),
        };
        f.running.with(|| f.spawn(), |_| ())?;
        Ok(f)
    }

    /// A buffer and thread for the current process.
    fn spawn(&self) -> std::io::Result<Running> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            buffer: Mutex::new(Buffer::default()),
            done: Condvar::new(),
            max_payloads: self.max_payloads,
            sizes: self.sizes.clone(),
            counters: self.counters.clone(),
        });
        let (s, tiers) = (shared.clone(), self.tiers.clone());
        let thread = std::thread::Builder::new()
            .name("kvrs-tier-fetcher".into())
            .spawn(move || fetch_loop(&rx, &tiers, &s))?;
        Ok(Running { tx, thread, shared })
    }

    /// This process's buffer, if it started one.
    fn shared(&self) -> Option<Arc<Shared>> {
        self.running.with_existing(|r| r.shared.clone())
    }

    /// Queues a fetch of `keys` (those neither buffered nor pending); returns how many
    /// were queued.
    pub fn request(&self, keys: Vec<String>) -> usize {
        let Ok((tx, shared)) = self
            .running
            .with(|| self.spawn(), |r| (r.tx.clone(), r.shared.clone()))
        else {
            return 0;
        };
        let keys: Vec<String> = {
            let mut b = shared.buffer.lock();
            // At most the buffer's size in flight: payloads wait whole in a reply before
            // the buffer is trimmed, so what is pending is bounded like the buffer.
            let room = self.max_payloads.saturating_sub(b.pending.len());
            let keys: Vec<String> = keys
                .into_iter()
                .filter(|k| !b.by_key.contains_key(k) && !b.pending.contains(k))
                .take(room)
                .collect();
            b.pending.extend(keys.iter().cloned());
            keys
        };
        let n = keys.len();
        if n == 0 {
            return 0;
        }
        if let Err(mpsc::SendError(keys)) = tx.send(keys) {
            // The thread is gone: nothing will fetch them.
            let mut b = shared.buffer.lock();
            for k in &keys {
                b.pending.remove(k);
            }
            return 0;
        }
        self.counters
            .requested
            .fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Takes the buffered payloads of `keys` (tier index and bytes; `None` for a key the
    /// buffer lacks), after waiting for the fetches of those keys still under way.
    pub fn take(&self, keys: &[String]) -> Vec<Option<(usize, Vec<u8>)>> {
        let Some(shared) = self.shared() else {
            return keys.iter().map(|_| None).collect();
        };
        let mut b = shared.buffer.lock();
        let until = Instant::now() + PENDING_WAIT;
        while keys.iter().any(|k| b.pending.contains(k)) {
            if shared.done.wait_until(&mut b, until).timed_out() {
                break;
            }
        }
        if b.by_key.is_empty() {
            return keys.iter().map(|_| None).collect();
        }
        let got: Vec<Option<(usize, Vec<u8>)>> = keys.iter().map(|k| b.by_key.remove(k)).collect();
        let taken = got.iter().filter(|g| g.is_some()).count();
        if taken > 0 {
            let gone: FxHashSet<&String> = keys.iter().collect();
            b.order.retain(|k| !gone.contains(k));
            self.counters
                .used
                .fetch_add(taken as u64, Ordering::Relaxed);
        }
        got
    }

    /// Forgets buffered payloads whose key starts with `prefix` (after the fetches under
    /// way); returns how many.
    pub fn drop_prefix(&self, prefix: &str) -> usize {
        let Some(shared) = self.shared() else {
            return 0;
        };
        let mut b = shared.buffer.lock();
        let until = Instant::now() + PENDING_WAIT;
        while !b.pending.is_empty() {
            if shared.done.wait_until(&mut b, until).timed_out() {
                // Fetches still under way must not bring this prefix back.
                b.dropped.push(prefix.to_string());
                break;
            }
        }
        let before = b.by_key.len();
        b.by_key.retain(|k, _| !k.starts_with(prefix));
        b.order.retain(|k| !k.starts_with(prefix));
        before - b.by_key.len()
    }

    /// Waits until every fetch requested so far has finished.
    pub fn wait(&self) {
        let Some(shared) = self.shared() else {
            return;
        };
        let mut b = shared.buffer.lock();
        let until = Instant::now() + PENDING_WAIT;
        while !b.pending.is_empty() {
            if shared.done.wait_until(&mut b, until).timed_out() {
                return;
            }
        }
    }

    /// Payloads buffered now, and their bytes.
    pub fn buffered(&self) -> (usize, usize) {
        let Some(shared) = self.shared() else {
            return (0, 0);
        };
        let b = shared.buffer.lock();
        (
            b.by_key.len(),
            b.by_key.values().map(|(_, p)| p.len()).sum(),
        )
    }

    /// The buffer's counters.
    pub fn counters(&self) -> &FetchCounters {
        &self.counters
    }
}

impl Drop for Fetcher {
    fn drop(&mut self) {
        // Only the process that started the thread joins it; a forked child forgets
        // the parent's.
        if let Some(Running { tx, thread, .. }) = self.running.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

/// Clears a job's keys from `pending` when the job ends, however it ends.
struct Settle<'a> {
    shared: &'a Shared,
    keys: &'a [String],
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        let mut b = self.shared.buffer.lock();
        for k in self.keys {
            b.pending.remove(k);
        }
        if b.pending.is_empty() {
            b.dropped.clear();
        }
        drop(b);
        self.shared.done.notify_all();
    }
}

/// The thread: for each request, asks each tier in turn for the keys no earlier tier
/// had, and buffers what they return, until the channel closes.
fn fetch_loop(rx: &Receiver<Vec<String>>, tiers: &[Arc<dyn Tier>], shared: &Shared) {
    while let Ok(keys) = rx.recv() {
        let _settle = Settle {
            shared,
            keys: &keys,
        };
        let mut left: Vec<usize> = (0..keys.len()).collect();
        for (t, tier) in tiers.iter().enumerate() {
            if left.is_empty() {
                break;
            }
            let ask: Vec<String> = left.iter().map(|&i| keys[i].clone()).collect();
            let got = tier.get_many(&ask, shared.sizes.clone());
            let mut b = shared.buffer.lock();
            let mut still = Vec::new();
            for (&i, payload) in left.iter().zip(got) {
                match payload {
                    Some(_) if b.dropped.iter().any(|d| keys[i].starts_with(d.as_str())) => {}
                    Some(p) => {
                        while b.by_key.len() >= shared.max_payloads {
                            let Some(old) = b.order.pop_front() else {
                                break;
                            };
                            if b.by_key.remove(&old).is_some() {
                                shared.counters.discarded.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        b.by_key.insert(keys[i].clone(), (t, p));
                        b.order.push_back(keys[i].clone());
                        shared.counters.fetched.fetch_add(1, Ordering::Relaxed);
                    }
                    None => still.push(i),
                }
            }
            left = still;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::HostTier;

    #[test]
    fn fetches_from_the_first_tier_that_has_a_key_into_a_bounded_buffer() {
        let (a, b) = (
            Arc::new(HostTier::new(1 << 20)),
            Arc::new(HostTier::new(1 << 20)),
        );
        let item = |k: &str, n: u8| (k.to_string(), Arc::new(vec![n; 8]));
        a.put_many(&[item("x", 1)]);
        b.put_many(&[item("x", 2), item("y", 3), item("z", 4)]);
        b.put_many(&[("w".to_string(), Arc::new(vec![5; 9]))]);
        let f = Fetcher::start(vec![a, b], 8..=8, 2).unwrap();
        let keys: Vec<String> = ["x", "y", "z", "w"].map(String::from).to_vec();
        assert_eq!(
            f.request(keys.clone()),
            2,
            "at most the buffer's size in flight"
        );
        f.wait();
        assert_eq!(
            f.request(keys[1..].to_vec()),
            2,
            "buffered keys are not asked again"
        );
        f.wait();
        // Two payloads at most: x went out first when z came in.
        let got = f.take(&keys);
        assert_eq!(got[0], None);
        assert_eq!(got[1], Some((1, vec![3; 8])));
        assert_eq!(got[2], Some((1, vec![4; 8])));
        assert_eq!(
            got[3], None,
            "a payload of another length is never buffered"
        );
        assert_eq!(f.take(&keys[1..2]), vec![None], "taken once");
        let c = f.counters();
        assert_eq!(c.requested.load(Ordering::Relaxed), 4);
        assert_eq!(c.fetched.load(Ordering::Relaxed), 3);
        assert_eq!(c.used.load(Ordering::Relaxed), 2);
        assert_eq!(c.discarded.load(Ordering::Relaxed), 1);
        assert_eq!(f.buffered(), (0, 0));
    }

    /// A tier that answers after `delay`.
    #[derive(Debug, Default)]
    struct Slow {
        delay: Duration,
        counters: crate::tier::TierCounters,
    }

    impl Tier for Slow {
        fn name(&self) -> &str {
            "slow"
        }
        fn get_many(
            &self,
            keys: &[String],
            _: std::ops::RangeInclusive<usize>,
        ) -> Vec<Option<Vec<u8>>> {
            std::thread::sleep(self.delay);
            keys.iter().map(|_| Some(vec![1; 8])).collect()
        }
        fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
            vec![false; items.len()]
        }
        fn drop_prefix(&self, _: &str) -> usize {
            0
        }
        fn discard(&self, _: &str) {}
        fn counters(&self) -> &crate::tier::TierCounters {
            &self.counters
        }
    }

    #[test]
    fn fetches_in_flight_are_bounded_like_the_buffer_and_waited_for_a_bounded_time() {
        let slow = Arc::new(Slow {
            delay: PENDING_WAIT + Duration::from_secs(1),
            ..Slow::default()
        });
        let f = Fetcher::start(vec![slow], 8..=8, 2).unwrap();
        let keys: Vec<String> = ["a:1", "a:2", "a:3", "b:1"].map(String::from).to_vec();
        assert_eq!(
            f.request(keys.clone()),
            2,
            "at most the buffer's size in flight"
        );
        assert_eq!(
            f.request(keys[3..].to_vec()),
            0,
            "the buffer's size is in flight"
        );
        // A namespace dropped while its fetch is under way: a bounded wait, and the
        // fetch's payloads do not come back.
        let t0 = Instant::now();
        assert_eq!(f.drop_prefix("a:"), 0);
        let waited = t0.elapsed();
        assert!(waited >= PENDING_WAIT && waited < PENDING_WAIT + Duration::from_millis(500));
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(f.buffered(), (0, 0));
        // A lookup waits a bounded time for a fetch under way, then finds it absent.
        assert_eq!(f.request(keys[3..].to_vec()), 1);
        let t1 = Instant::now();
        assert_eq!(f.take(&keys[3..]), vec![None], "still pending: absent");
        let waited = t1.elapsed();
        assert!(waited >= PENDING_WAIT && waited < PENDING_WAIT + Duration::from_millis(500));
    }
}
