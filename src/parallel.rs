//! The threads that parallel work (attention, large gathers, tier payload checks) runs
//! on: a rayon pool of this process, made again in a child after `fork()`.
//!
//! A forked child has only the thread that called `fork()`: the threads of a pool the
//! parent built are gone, and work handed to them would wait forever. So the pool is
//! recorded with the process id that built it, and a process that finds another id
//! builds its own (the parent's pool is forgotten, never joined nor dropped: its threads
//! and locks are the parent's).

use std::sync::Arc;

use rayon::ThreadPool;

use crate::per_process::PerProcess;

/// The pool of this process.
static POOL: PerProcess<Arc<ThreadPool>> = PerProcess::new();

/// This process's pool (built on first use, and again after a fork); `None` only when
/// no thread could be started.
fn pool() -> Option<Arc<ThreadPool>> {
    POOL.with(
        || {
            rayon::ThreadPoolBuilder::new()
                .thread_name(|i| format!("kvrs-worker-{i}"))
                .build()
                .map(Arc::new)
        },
        Arc::clone,
    )
    .ok()
}

/// Runs `f` with this process's pool as the one its parallel iterators use (on the
/// calling thread, inline, when no thread could be started).
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// Runs `f` on the calling thread with a scope whose spawned work runs on this process's
/// pool, and returns when `f` and that work are done; `None` (without running `f`) when
/// this process could start no pool: the caller then does the work inline.
pub fn in_place_scope<'s, R>(f: impl FnOnce(&rayon::Scope<'s>) -> R) -> Option<R> {
    pool().map(|p| p.in_place_scope(f))
}

/// The threads of this process's pool (1 when it has none).
pub fn threads() -> usize {
    pool().map_or(1, |p| p.current_num_threads())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn parallel_work_runs_on_the_processs_pool() {
        let n = threads();
        assert!(n >= 1);
        let sum: u64 = install(|| (0..10_000u64).into_par_iter().sum());
        assert_eq!(sum, 10_000 * 9_999 / 2);
        let inside = install(rayon::current_num_threads);
        assert_eq!(inside, n);
    }
}
