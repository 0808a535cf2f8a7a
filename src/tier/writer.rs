//! The write-back thread: evicted blocks' payloads go into a bounded queue that a
//! thread owned by the pool drains in batches into the first tier that takes each one,
//! so the caller that evicted a block never waits for a disk or a server.
//!
//! When the queue is full a payload is dropped (counted in `dropped`): a tier is a
//! cache, and generation never waits for one. [`Writer::flush`] waits until everything
//! queued before it has been written or refused; dropping the writer does the same, then
//! stops the thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::Tier;

/// Most payloads written in one batch.
const BATCH: usize = 64;

/// What the thread is asked to do.
enum Job {
    /// Store a payload under a key.
    Store(String, Arc<Vec<u8>>),
    /// Acknowledge once every earlier job is done.
    Flush(mpsc::Sender<()>),
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
    /// Starts the thread writing into `tiers` (first that takes a payload wins), with a
    /// queue of `capacity` payloads.
    pub fn start(tiers: Vec<Arc<dyn Tier>>, capacity: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(capacity.max(1));
        let counters = Arc::new(WriterCounters::default());
        let c = counters.clone();
        let thread = std::thread::Builder::new()
            .name("kvrs-tier-writer".into())
            .spawn(move || drain(&rx, &tiers, &c))?;
        Ok(Writer {
            tx: Some(tx),
            thread: Some(thread),
            counters,
        })
    }

    /// Queues `payload` under `key`; false (and counted) when the queue is full.
    pub fn submit(&self, key: String, payload: Arc<Vec<u8>>) -> bool {
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
/// each tier in turn, and answers flushes, until the queue closes.
fn drain(rx: &Receiver<Job>, tiers: &[Arc<dyn Tier>], counters: &WriterCounters) {
    while let Ok(job) = rx.recv() {
        let mut batch = Vec::new();
        let mut flushes = Vec::new();
        let mut next = Some(job);
        while let Some(job) = next.take() {
            match job {
                Job::Store(k, p) => batch.push((k, p)),
                Job::Flush(ack) => flushes.push(ack),
            }
            if batch.len() < BATCH && flushes.is_empty() {
                next = rx.try_recv().ok();
            }
        }
        for tier in tiers {
            if batch.is_empty() {
                break;
            }
            let taken = tier.put_many(&batch);
            let mut i = 0;
            batch.retain(|_| {
                i += 1;
                !taken[i - 1]
            });
        }
        counters
            .unstored
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        for ack in flushes {
            let _ = ack.send(());
        }
    }
}
