//! The one route from the bindings into a core (a pool, a contiguous or an encoder
//! cache): a lock that no thread waits for while holding the GIL, and under which no
//! Python object is built, read or dropped.
//!
//! Every binding runs its core work as a closure through [`Guarded::read`] or
//! [`Guarded::write`]. The closure is `Send` and returns a `Send` value, so it can hold
//! no `Python` token and no `Bound` object: Python objects are built from its plain
//! result after the lock is released, and a garbage collection can never run (and drop
//! a `Sequence`, which takes the same lock) while the lock is held. When the lock is
//! free the closure runs at once with the GIL held (a decode step's calls cost no GIL
//! round trip); when another thread holds it, the caller releases the GIL before
//! waiting, so the other threads of the interpreter keep running. Calls that move many
//! bytes release the GIL for the whole call.

use parking_lot::{RwLock, RwLockWriteGuard};
use pyo3::prelude::*;

/// Calls that move at least this many bytes run with the GIL released; smaller ones (a
/// decode step's single token) finish faster than releasing and re-taking the GIL would.
pub const DETACH_BYTES: usize = 64 * 1024;

/// A core behind a reader-writer lock, entered only through closures.
#[derive(Debug)]
pub struct Guarded<T> {
    lock: RwLock<T>,
}

impl<T: Send + Sync> Guarded<T> {
    /// Guards `core`.
    pub fn new(core: T) -> Self {
        Guarded {
            lock: RwLock::new(core),
        }
    }

    /// Runs `f` on the core under a shared lock.
    pub fn read<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&T) -> R + Send) -> R {
        self.read_moving(py, 0, f)
    }

    /// Runs `f` on the core under the exclusive lock.
    pub fn write<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> R + Send) -> R {
        self.write_moving(py, 0, f)
    }

    /// [`Guarded::read`] for a call that moves `bytes` bytes: with the GIL released for
    /// the whole call from [`DETACH_BYTES`] on.
    pub fn read_moving<R: Send>(
        &self,
        py: Python<'_>,
        bytes: usize,
        f: impl FnOnce(&T) -> R + Send,
    ) -> R {
        if bytes < DETACH_BYTES {
            if let Some(g) = self.lock.try_read() {
                return f(&g);
            }
        }
        py.detach(|| f(&self.lock.read()))
    }

    /// [`Guarded::write`] for a call that moves `bytes` bytes: with the GIL released for
    /// the whole call from [`DETACH_BYTES`] on.
    pub fn write_moving<R: Send>(
        &self,
        py: Python<'_>,
        bytes: usize,
        f: impl FnOnce(&mut T) -> R + Send,
    ) -> R {
        if bytes < DETACH_BYTES {
            if let Some(mut g) = self.lock.try_write() {
                return f(&mut g);
            }
        }
        py.detach(|| f(&mut self.lock.write()))
    }

    /// Runs `f` under the shared lock, waiting for it: only from code that runs with the
    /// GIL released (inside another core's detached call).
    pub fn read_blocking<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.lock.read())
    }

    /// Runs `f` under the exclusive lock, waiting for it: only from code that runs with
    /// the GIL released (inside another core's detached call).
    pub fn write_blocking<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        f(&mut self.lock.write())
    }

    /// The exclusive lock if no one holds the lock now (for `Drop`, which must not wait).
    pub fn try_write_now(&self) -> Option<RwLockWriteGuard<'_, T>> {
        self.lock.try_write()
    }
}
