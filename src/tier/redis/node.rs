//! One Redis server (a standalone server, or one node of a cluster): its pooled
//! connections and whether it is usable. A request to it is bounded whole by a deadline
//! and in bytes ([`conn`](super::conn)); after a failure the node is skipped for
//! `retry_after`, then one caller at a time probes it.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::Value;

use super::conn::{Conn, Target};
use crate::tier::TierCounters;

/// A server, its idle connections and its health.
pub(super) struct Node {
    target: Target,
    max_idle: usize,
    retry_after: Duration,
    idle: Mutex<Vec<Conn>>,
    health: Mutex<Health>,
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

/// Why a request to a node brought nothing back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// The node is marked down: skipped at once.
    Down,
    /// The request failed (I/O, the deadline, a malformed or short reply).
    Failed,
}

/// The deadline `timeout` from now (a timeout past the clock's range waits a century).
pub(super) fn deadline_in(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

impl Node {
    /// A node at `target`; no connection is made yet.
    pub(super) fn new(target: Target, max_idle: usize, retry_after: Duration) -> Self {
        Node {
            target,
            max_idle,
            retry_after,
            idle: Mutex::new(Vec::new()),
            health: Mutex::new(Health::default()),
        }
    }

    /// The node's target (its address and login).
    pub(super) fn target(&self) -> &Target {
        &self.target
    }

    /// Whether the node is marked down now (a failure less than `retry_after` ago).
    pub(super) fn is_down(&self) -> bool {
        let h = self.health.lock();
        h.down_since
            .is_some_and(|since| since.elapsed() < self.retry_after)
    }

    /// Whether a request may go to the node now: `Some(probing)`, or `None` while the
    /// node is marked down (or another caller of this process is probing it).
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

    /// Ends a request: marks the node up or down and ends this caller's probe.
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
    /// its `replies` (at least one) replies read, all before `deadline` and within `cap`
    /// bytes; `check` turns the replies into the result, or `None` for a reply that makes no sense. On
    /// any failure the connection is dropped, an error counted in `counters`, the node
    /// marked down, and the result is `Failed`; while it is down, `Down` at once (counted
    /// too).
    pub(super) fn request<R>(
        &self,
        packed: &[u8],
        replies: usize,
        cap: usize,
        deadline: Instant,
        counters: &TierCounters,
        check: impl FnOnce(Vec<Value>) -> Option<R>,
    ) -> Result<R, Failure> {
        self.request_parts(&[packed], replies, cap, deadline, counters, check)
    }

    /// [`Node::request`] of the commands whose encoding is the concatenation of
    /// `segments` ([`Segments`](super::resp::Segments)), sent in one vectored write,
    /// each segment from where it lies.
    pub(super) fn request_parts<R>(
        &self,
        segments: &[&[u8]],
        replies: usize,
        cap: usize,
        deadline: Instant,
        counters: &TierCounters,
        check: impl FnOnce(Vec<Value>) -> Option<R>,
    ) -> Result<R, Failure> {
        let mut values = Vec::with_capacity(replies);
        let mut check = Some(check);
        let mut result = None;
        let window = segments.len();
        self.request_each(segments, window, replies, cap, deadline, counters, |v| {
            values.push(v);
            if values.len() == replies {
                result = check.take().and_then(|c| c(std::mem::take(&mut values)));
                return result.is_some();
            }
            true
        })?;
        result.ok_or(Failure::Failed)
    }

    /// One request as [`Node::request`] of `commands` sent `window` at a time
    /// ([`Conn::exchange`]), handing each reply to `each` as it arrives (a reply `each`
    /// refuses, returning `false`, fails the request).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn request_each(
        &self,
        commands: &[&[u8]],
        window: usize,
        replies: usize,
        cap: usize,
        deadline: Instant,
        counters: &TierCounters,
        each: impl FnMut(Value) -> bool,
    ) -> Result<(), Failure> {
        let Some(probing) = self.admit() else {
            // In its back-off after a failure: counted, and that failure's text is kept.
            TierCounters::add(&counters.errors, 1);
            return Err(Failure::Down);
        };
        let conn = match self.pooled() {
            Some(c) => Ok(c),
            None => Conn::open(&self.target, deadline),
        };
        let got = conn.and_then(|mut c| {
            c.exchange(commands, window, replies, cap, deadline, each)
                .map(|()| c)
        });
        self.finish(probing, got.is_ok());
        match got {
            Ok(c) => {
                let mut idle = self.idle.lock();
                if idle.len() < self.max_idle {
                    idle.push(c);
                }
                Ok(())
            }
            Err(e) => {
                let at = self.target.tcp().map_or_else(
                    || "the Unix socket".to_string(),
                    |(h, p)| format!("{h}:{p}"),
                );
                counters.fail(format_args!("{at}: {e}"));
                // Connections made before the failure may be dead too.
                self.idle.lock().clear();
                Err(Failure::Failed)
            }
        }
    }
}
