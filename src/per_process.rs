//! [`PerProcess`]: a value that belongs to the process that made it, such as a thread
//! and the channel that feeds it. A child made by `fork()` has none of its parent's
//! threads, so it makes its own value on first use; the parent's copy is forgotten:
//! never used, dropped or joined (its threads and locks are the parent's, and its
//! pending work is the parent's to finish).

use parking_lot::Mutex;

/// A value of the current process, made on first use.
#[derive(Debug)]
pub struct PerProcess<T> {
    /// The value and the id of the process that made it.
    slot: Mutex<Option<(u32, T)>>,
}

impl<T> Default for PerProcess<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> PerProcess<T> {
    /// No value yet.
    pub const fn new() -> Self {
        PerProcess {
            slot: Mutex::new(None),
        }
    }

    /// Runs `f` on this process's value, made by `make` first when there is none (in a
    /// child after a fork, the parent's is forgotten first). `f` runs under a short
    /// lock: it must not wait.
    pub fn with<R, E>(
        &self,
        make: impl FnOnce() -> Result<T, E>,
        f: impl FnOnce(&T) -> R,
    ) -> Result<R, E> {
        let pid = std::process::id();
        let mut slot = self.slot.lock();
        if slot.as_ref().is_some_and(|(owner, _)| *owner != pid) {
            std::mem::forget(slot.take());
        }
        if slot.is_none() {
            *slot = Some((pid, make()?));
        }
        Ok(f(&slot.as_ref().expect("made above").1))
    }

    /// Runs `f` on this process's value if it has one (never makes one).
    pub fn with_existing<R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        let slot = self.slot.lock();
        match slot.as_ref() {
            Some((owner, value)) if *owner == std::process::id() => Some(f(value)),
            _ => None,
        }
    }

    /// Takes this process's value (to shut it down); a value inherited from a parent
    /// process is forgotten instead.
    pub fn take(&self) -> Option<T> {
        let mut slot = self.slot.lock();
        match slot.take() {
            Some((owner, value)) if owner == std::process::id() => Some(value),
            inherited => {
                std::mem::forget(inherited);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_made_once_per_process_and_taken_by_its_owner() {
        let p: PerProcess<Vec<u8>> = PerProcess::new();
        assert_eq!(p.with_existing(|v| v.len()), None);
        let made = std::cell::Cell::new(0);
        for _ in 0..3 {
            let n = p
                .with(
                    || {
                        made.set(made.get() + 1);
                        Ok::<_, ()>(vec![1, 2])
                    },
                    |v| v.len(),
                )
                .unwrap();
            assert_eq!(n, 2);
        }
        assert_eq!(made.get(), 1);
        assert_eq!(p.take(), Some(vec![1, 2]));
        assert_eq!(p.take(), None);
        // A value recorded for another process is never handed out.
        *p.slot.lock() = Some((std::process::id().wrapping_add(1), vec![9]));
        assert_eq!(p.with_existing(|v| v[0]), None);
        assert_eq!(p.with(|| Ok::<_, ()>(vec![7]), |v| v[0]), Ok(7));
    }
}
