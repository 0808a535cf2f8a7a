//! The write-back thread: evicted blocks' payloads go into a bounded queue that a
//! thread owned by the pool seals (checksums) and drains in batches into the first tier
//! that takes each one
//! ([`WritePolicy::First`]) or into every tier ([`WritePolicy::All`]), so the caller
//! that evicted a block never waits for a disk or a server.
//!
//! When the queue is full a payload is dropped (counted in `dropped`): a tier is a
//! cache, and generation never waits for one. [`Writer::flush`] waits until everything
//! queued before it has been written or refused; dropping the writer does the same, then
//! stops the thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::{payload, Tier};
use crate::error::{KvError, Result};

/// Most payloads written in one batch.
const BATCH: usize = 64;

/// The largest write-back queue (payloads): the queue is allocated up front.
pub const MAX_QUEUE: usize = 1 << 20;

/// Checks the write-back queue's capacity (`tier_queue`) is in `1..=MAX_QUEUE`.
pub fn check_queue(queue: usize) -> Result<()> {
    if !(1..=MAX_QUEUE).contains(&queue) {
        return Err(KvError::InvalidArgument {
            name: "tier_queue",
            value: queue.to_string(),
            reason: format!("must be in [1, {MAX_QUEUE}] (payloads)"),
        });
    }
    Ok(())
}

/// What the thread is asked to do.
enum Job {
    /// Store a payload (not yet sealed) under a key.
    Store(String, Vec<u8>),
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
        match s {
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
    /// Payloads dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Payloads no tier took (every tier refused or failed).
    pub unstored: AtomicU64,
}

/// The write-back queue and its thread.
#[derive(Debug)]
pub struct Writer {
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<WriterCounters>,
}

impl Writer {
    /// Starts the thread writing into `tiers` as `policy` says, with a queue of
    /// `capacity` payloads.
    pub fn start(
        tiers: Vec<Arc<dyn Tier>>,
        capacity: usize,
        policy: WritePolicy,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(capacity.max(1));
        let counters = Arc::new(WriterCounters::default());
        let c = counters.clone();
        let thread = std::thread::Builder::new()
            .name("kvrs-tier-writer".into())
            .spawn(move || drain(&rx, &tiers, &c, policy))?;
        Ok(Writer {
            tx: Some(tx),
            thread: Some(thread),
            counters,
        })
    }

    /// Queues `payload` under `key`; false (and counted) when the queue is full. The
    /// payload comes unsealed: the thread computes its checksum
    /// ([`payload::seal`]), off the caller's path.
    pub fn submit(&self, key: String, payload: Vec<u8>) -> bool {
        let tx = self.tx.as_ref().expect("the sender lives until drop");
        match tx.try_send(Job::Store(key, payload)) {
            Ok(()) => {
                self.counters.queued.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Waits until every payload queued so far has been written or refused.
    pub fn flush(&self) {
        let (ack, done) = mpsc::channel();
        let tx = self.tx.as_ref().expect("the sender lives until drop");
        if tx.send(Job::Flush(ack)).is_ok() {
            let _ = done.recv();
        }
    }

    /// The queue's counters.
    pub fn counters(&self) -> &WriterCounters {
        &self.counters
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
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
    policy: WritePolicy,
) {
    while let Ok(job) = rx.recv() {
        let mut batch = Vec::new();
        let mut flushes = Vec::new();
        let mut next = Some(job);
        while let Some(job) = next.take() {
            match job {
                Job::Store(k, mut p) => {
                    payload::seal(&mut p);
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
        for ack in flushes {
            let _ = ack.send(());
        }
    }
}
