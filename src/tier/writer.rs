//! The write-back thread: evicted blocks' payloads go into a queue bounded in payloads
//! and in bytes, which a thread owned by the pool seals (MACs) and drains in batches
//! into the first tier that takes each one ([`WritePolicy::First`]) or into every tier
//! ([`WritePolicy::All`]), so the caller that evicted a block never waits for a disk or
//! a server.
//!
//! When the queue is full (in payloads or in bytes) a payload is dropped (counted in
//! `dropped`): a tier is a cache, and generation never waits for one.
//! [`Writer::flush`] waits until everything queued before it has been written or
//! refused; dropping the writer does the same, then stops the thread.
//!
//! The thread and its queue belong to the process that started them
//! ([`PerProcess`]): a child forked from it starts its own on first use, and neither
//! waits for nor writes the parent's queued payloads.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::payload::{self, MacKey};
use super::Tier;
use crate::error::{KvError, Result};
use crate::per_process::PerProcess;

/// Most payloads written in one batch.
const BATCH: usize = 64;

/// The largest write-back queue (payloads): the queue is allocated up front.
pub const MAX_QUEUE: usize = 1 << 20;

/// The default bound of the write-back queue in bytes.
pub const DEFAULT_QUEUE_BYTES: usize = 256 << 20;

/// Checks the write-back queue's capacity (`tier_queue`) is in `1..=MAX_QUEUE`, and its
/// byte bound (`tier_queue_bytes`) is at least one payload of `payload_len` bytes.
pub fn check_queue(queue: usize, max_bytes: usize, payload_len: usize) -> Result<()> {
    if !(1..=MAX_QUEUE).contains(&queue) {
        return Err(KvError::InvalidArgument {
            name: "tier_queue",
            value: queue.to_string(),
            reason: format!("must be in [1, {MAX_QUEUE}] (payloads)"),
        });
    }
    if max_bytes < payload_len {
        return Err(KvError::InvalidArgument {
            name: "tier_queue_bytes",
            value: max_bytes.to_string(),
            reason: format!(
                "must hold at least one payload (a block's, or a state checkpoint's: \
                 {payload_len} bytes)"
            ),
        });
    }
    Ok(())
}

/// What the thread is asked to do.
enum Job {
    /// Store a payload (not yet sealed) under a key, sealed with the MAC key.
    Store(String, Vec<u8>, MacKey),
    /// Acknowledge once every earlier job is done.
    Flush(mpsc::Sender<()>),
}

/// Which tiers a payload is written to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// The first tier that takes it (each block stored once, as fast as it fits).
    First,
    /// Every tier (a fast local tier for this process, and a shared one for the others).
    All,
}

impl std::str::FromStr for WritePolicy {
    type Err = crate::error::KvError;

    fn from_str(s: &str) -> crate::error::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "first" => Ok(WritePolicy::First),
            "all" => Ok(WritePolicy::All),
            _ => Err(crate::error::KvError::InvalidArgument {
                name: "tier_write",
                value: s.to_string(),
                reason: "must be 'first' (the first tier that takes a block) or 'all'".into(),
            }),
        }
    }
}

/// Counters of the write-back queue.
#[derive(Debug, Default)]
pub struct WriterCounters {
    /// Payloads queued.
    pub queued: AtomicU64,
    /// Payloads dropped because the queue was full (in payloads or in bytes).
    pub dropped: AtomicU64,
    /// Payloads no tier took (every tier refused or failed).
    pub unstored: AtomicU64,
}

/// The write-back queue and its thread.
#[derive(Debug)]
pub struct Writer {
    tiers: Vec<Arc<dyn Tier>>,
    capacity: usize,
    max_bytes: usize,
    policy: WritePolicy,
    running: PerProcess<Running>,
    counters: Arc<WriterCounters>,
}

/// The queue and thread of one process.
#[derive(Debug)]
struct Running {
    tx: SyncSender<Job>,
    thread: JoinHandle<()>,
    /// Bytes of payloads queued and not yet written.
    bytes: Arc<AtomicUsize>,
}

impl Writer {
    /// Starts the thread writing into `tiers` as `policy` says, with a queue of at most
    /// `capacity` payloads and `max_bytes` bytes.
    pub fn start(
        tiers: Vec<Arc<dyn Tier>>,
        capacity: usize,
        max_bytes: usize,
        policy: WritePolicy,
    ) -> std::io::Result<Self> {
        let w = Writer {
            tiers,
            capacity: capacity.max(1),
            max_bytes,
            policy,
            running: PerProcess::new(),
            counters: Arc::new(WriterCounters::default()),
        };
        w.running.with(|| w.spawn(), |_| ())?;
        Ok(w)
    }

    /// A queue and thread for the current process.
    fn spawn(&self) -> std::io::Result<Running> {
        let (tx, rx) = mpsc::sync_channel(self.capacity);
        let bytes = Arc::new(AtomicUsize::new(0));
        let (tiers, c, b, policy) = (
            self.tiers.clone(),
            self.counters.clone(),
            bytes.clone(),
            self.policy,
        );
        let thread = std::thread::Builder::new()
            .name("kvrs-tier-writer".into())
            .spawn(move || drain(&rx, &tiers, &c, &b, policy))?;
        Ok(Running { tx, thread, bytes })
    }

    /// Queues `payload` under `key`, to be sealed with `mac` (the key of its namespace);
    /// false (and counted) when the queue is full in payloads or in bytes. The MAC is
    /// computed by the thread ([`payload::seal`]), off the caller's path.
    pub fn submit(&self, key: String, payload: Vec<u8>, mac: MacKey) -> bool {
        let len = payload.len();
        let queued = self
            .running
            .with(
                || self.spawn(),
                |r| {
                    let room = r
                        .bytes
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                            (b + len <= self.max_bytes).then_some(b + len)
                        })
                        .is_ok();
                    if !room {
                        return false;
                    }
                    match r.tx.try_send(Job::Store(key, payload, mac)) {
                        Ok(()) => true,
                        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                            r.bytes.fetch_sub(len, Ordering::AcqRel);
                            false
                        }
                    }
                },
            )
            .unwrap_or(false);
        let counter = if queued {
            &self.counters.queued
        } else {
            &self.counters.dropped
        };
        counter.fetch_add(1, Ordering::Relaxed);
        queued
    }

    /// Waits until every payload this process queued so far has been written or
    /// refused.
    pub fn flush(&self) {
        let Some(tx) = self.running.with_existing(|r| r.tx.clone()) else {
            return;
        };
        let (ack, done) = mpsc::channel();
        if tx.send(Job::Flush(ack)).is_ok() {
            let _ = done.recv();
        }
    }

    /// Bytes of payloads queued now (this process's).
    pub fn queued_bytes(&self) -> usize {
        self.running
            .with_existing(|r| r.bytes.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    /// The queue's counters.
    pub fn counters(&self) -> &WriterCounters {
        &self.counters
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Only the process that started the thread joins it (after it wrote what was
        // queued); a forked child forgets the parent's.
        if let Some(Running { tx, thread, .. }) = self.running.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

/// The thread: takes what is queued (up to [`BATCH`] payloads), offers the batch to
/// each tier in turn (what a tier took goes no further under [`WritePolicy::First`]),
/// and answers flushes, until the queue closes.
fn drain(
    rx: &Receiver<Job>,
    tiers: &[Arc<dyn Tier>],
    counters: &WriterCounters,
    queued_bytes: &AtomicUsize,
    policy: WritePolicy,
) {
    while let Ok(job) = rx.recv() {
        let mut batch = Vec::new();
        let mut flushes = Vec::new();
        let mut next = Some(job);
        while let Some(job) = next.take() {
            match job {
                Job::Store(k, mut p, mac) => {
                    payload::seal(&mut p, &mac);
                    batch.push((k, Arc::new(p)));
                }
                Job::Flush(ack) => flushes.push(ack),
            }
            if batch.len() < BATCH && flushes.is_empty() {
                next = rx.try_recv().ok();
            }
        }
        let mut stored = vec![false; batch.len()];
        for tier in tiers {
            let ask: Vec<usize> = (0..batch.len())
                .filter(|&i| policy == WritePolicy::All || !stored[i])
                .collect();
            if ask.is_empty() {
                break;
            }
            let items: Vec<(String, Arc<Vec<u8>>)> =
                ask.iter().map(|&i| batch[i].clone()).collect();
            for (&i, taken) in ask.iter().zip(tier.put_many(&items)) {
                stored[i] |= taken;
            }
        }
        let unstored = stored.iter().filter(|&&s| !s).count();
        counters
            .unstored
            .fetch_add(unstored as u64, Ordering::Relaxed);
        let written: usize = batch.iter().map(|(_, p)| p.len()).sum();
        drop(batch);
        queued_bytes.fetch_sub(written, Ordering::AcqRel);
        for ack in flushes {
            let _ = ack.send(());
        }
    }
}
