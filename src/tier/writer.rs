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

/// When a pool writes its cached blocks to its tiers (SGLang's `--hicache-write-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// Each block once, when it becomes cached (asynchronously: the queue is bounded and
    /// a full queue drops the write, which the block's eviction then makes).
    Through,
    /// A block when it leaves the pool (evicted), or on `store_to_tiers` / `close`.
    Back,
    /// A block once it has been hit this many times while cached (and on eviction
    /// otherwise, as [`WriteMode::Back`]).
    ThroughSelective(u32),
}

impl WriteMode {
    /// The mode of `name` ('write_through', 'write_back', 'write_through_selective': the
    /// latter writes a block at `hits` prefix hits).
    pub fn parse(name: &str, hits: u32) -> crate::error::Result<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "write_through" => Ok(WriteMode::Through),
            "write_back" => Ok(WriteMode::Back),
            "write_through_selective" if hits >= 1 => Ok(WriteMode::ThroughSelective(hits)),
            "write_through_selective" => Err(crate::error::KvError::InvalidArgument {
                name: "tier_write_hits",
                value: hits.to_string(),
                reason: "must be >= 1 (the prefix hits after which a block is written)".into(),
            }),
            _ => Err(crate::error::KvError::InvalidArgument {
                name: "tier_write_policy",
                value: name.to_string(),
                reason: "must be 'write_through', 'write_back' or 'write_through_selective'".into(),
            }),
        }
    }

    /// Its name, as [`WriteMode::parse`] takes it.
    pub fn name(&self) -> &'static str {
        match self {
            WriteMode::Through => "write_through",
            WriteMode::Back => "write_back",
            WriteMode::ThroughSelective(_) => "write_through_selective",
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
    /// Set by [`Writer::close`]: later payloads are dropped (counted), never queued.
    closed: std::sync::atomic::AtomicBool,
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
            closed: std::sync::atomic::AtomicBool::new(false),
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
        let queued = !self.closed.load(Ordering::Acquire)
            && self
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

    /// [`Writer::flush`], giving up at `deadline`; returns whether everything queued
    /// was written in time.
    pub fn flush_until(&self, deadline: std::time::Instant) -> bool {
        let Some(tx) = self.running.with_existing(|r| r.tx.clone()) else {
            return true;
        };
        let (ack, done) = mpsc::channel();
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        // A full queue: the flush job itself waits for room, within the deadline.
        let sent = match tx.try_send(Job::Flush(ack.clone())) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                let (tx, ack) = (tx.clone(), ack.clone());
                std::thread::spawn(move || tx.send(Job::Flush(ack)).is_ok());
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        };
        sent && done.recv_timeout(left).is_ok()
    }

    /// Writes what is queued, then stops the thread: later payloads are dropped
    /// (counted), so a closed pool never writes again. Closing twice is harmless.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(Running { tx, thread, .. }) = self.running.take() {
            drop(tx);
            let _ = thread.join();
        }
    }

    /// Whether [`Writer::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
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

/// The writers of this process's pools, for [`flush_all`] at exit.
static LIVE: parking_lot::Mutex<Vec<std::sync::Weak<Writer>>> = parking_lot::Mutex::new(Vec::new());

/// Records `w` for [`flush_all`] (a pool's writer, once shared).
pub fn register(w: &Arc<Writer>) {
    let mut live = LIVE.lock();
    live.retain(|x| x.strong_count() > 0);
    live.push(Arc::downgrade(w));
}

/// Waits, until `deadline`, for every live writer of this process to write what it
/// queued (what a process about to exit calls: its pools may never be dropped).
/// Returns whether all were written in time.
pub fn flush_all(deadline: std::time::Instant) -> bool {
    let writers: Vec<Arc<Writer>> = LIVE.lock().iter().filter_map(|w| w.upgrade()).collect();
    writers.iter().all(|w| w.flush_until(deadline))
}

/// How long a dropped writer waits for its thread to write what is queued.
pub const DROP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

impl Drop for Writer {
    fn drop(&mut self) {
        // Only the process that started the thread waits for it (to write what was
        // queued, up to a deadline: a dead tier must not hang the process); a forked
        // child forgets the parent's.
        if let Some(Running { tx, thread, .. }) = self.running.take() {
            drop(tx);
            let end = std::time::Instant::now() + DROP_DEADLINE;
            while !thread.is_finished() && std::time::Instant::now() < end {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
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
