//! [`DiskTier`]: block payloads as files in a directory shared by processes, bounded in
//! size, least recently used first out.
//!
//! A key `kvrs:{fingerprint}:{root}:{block}` is the file `{dir}/{fingerprint}/{root}/{block}.kvb`,
//! so a namespace is one directory. Writes go to a temporary file `.tmp-{pid}-{serial}`
//! in the same directory and are renamed into place, so a reader (in this process or
//! another sharing the directory) sees a whole payload or none.
//!
//! **Reads trust nothing at a path.** A path is opened read-only with `O_NOFOLLOW |
//! O_NONBLOCK` and checked with `fstat` on the open descriptor: a symlink, FIFO, socket,
//! device or directory is refused (counted in `rejected`) without blocking, and so is a
//! file whose length is not one the caller accepts; a file is read for exactly its
//! length, and one that shrinks or grows meanwhile is refused. Reading a payload sets its
//! modification time (the LRU clock) through the read descriptor (`futimens`), never by
//! opening the path for writing. A store over an existing file compares it (opened the
//! same way) with the payload: identical, it is only touched; anything else there (a
//! planted or stale file, a FIFO, a symlink) is replaced atomically.
//!
//! **The bound holds for all processes together.** The directory's byte total is kept in
//! `{dir}/.usage`, read and written under an exclusive `flock` on the directory, which
//! is held for a few system calls (or a rescan), never across a payload write. A store
//! reserves its payload's length there and creates its temporary file at that length
//! (sparse) under the lock before writing it, and renames it into place under the lock.
//! When a reservation would pass `max_bytes`, the directory is rescanned and its least
//! recently used block files are removed until it is at most 90% of the bound with the
//! new payload; if the temporary files of writes in flight leave no room, the store is
//! refused. So: *the lengths of the directory's block and temporary files never exceed
//! `max_bytes`, for all processes of the host sharing it, payloads being written
//! included*, except for files placed or grown there other than by kvrs, which the next
//! full rescan counts (every 256 stores by all processes together, whenever the total
//! says the bound is reached, and when a `DiskTier` is opened). Removals (`drop_prefix`,
//! `discard`, a failed write) subtract only what they removed themselves, and only if no
//! rescan counted the directory meanwhile, so the total never undercounts.
//!
//! **Temporary files of killed writers are swept** by every rescan: one untouched for
//! 10 minutes, or for 10 seconds when no process has its pid (`kill(pid, 0)` says
//! `ESRCH`; a writer in another PID namespace looks dead, hence the grace). Until then
//! they count against the bound.
//!
//! Files are not fsynced: after a crash a file may be cut short, and its MAC then
//! fails and it is discarded.

mod file;
mod usage;

use std::fs;
use std::io::{self, Write};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Tier, TierCounters};
use crate::error::{KvError, Result};
use file::{create_sized, holds, open_regular, read_exact_len, touch, Opened};
use usage::{evict, rescan, scan, DirLock, Scan, Usage, RESCAN_EVERY, TEMP_PREFIX};

/// Block payloads in a size-bounded directory, shared by the processes that open it.
#[derive(Debug)]
pub struct DiskTier {
    name: String,
    dir: PathBuf,
    max_bytes: u64,
    /// Makes temporary file names unique within the process.
    serial: AtomicU64,
    /// When taking the directory's lock last timed out: for [`STUCK_FOR`] after, each
    /// operation tries it once instead of waiting (a held lock costs one wait, not one
    /// per payload).
    stuck_since: parking_lot::Mutex<Option<std::time::Instant>>,
    counters: TierCounters,
}

/// How long after a lock timeout operations only try the lock once.
const STUCK_FOR: std::time::Duration = std::time::Duration::from_secs(10);

impl DiskTier {
    /// A tier in `dir` (created if missing) holding at most `max_bytes` of block and
    /// temporary files. Opening rescans the directory (sweeping dead writers' temporary
    /// files) and corrects its shared total.
    pub fn open(dir: impl Into<PathBuf>, max_bytes: u64) -> Result<Self> {
        let dir: PathBuf = dir.into();
        let io_error = |e: io::Error| KvError::Io {
            path: dir.display().to_string(),
            reason: e.to_string(),
        };
        fs::create_dir_all(&dir).map_err(io_error)?;
        {
            let _lock = DirLock::acquire(&dir).map_err(io_error)?;
            let old = Usage::read(&dir);
            let (usage, _) = rescan(&dir, old);
            // A directory that holds nothing gets no accounting file until a store, and
            // one this process may not write is still read.
            if old.is_some() || usage.total > 0 {
                let _ = usage.write(&dir);
            }
        }
        Ok(DiskTier {
            name: format!("disk:{}", dir.display()),
            dir,
            max_bytes,
            serial: AtomicU64::new(0),
            stuck_since: parking_lot::Mutex::new(None),
            counters: TierCounters::default(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The size bound in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Bytes of block and temporary files in the directory now (every process's),
    /// counted afresh.
    pub fn used_bytes(&self) -> u64 {
        let mut s = Scan::default();
        scan(&self.dir, false, &mut s);
        s.total
    }

    /// The path of `key` (a key is `kvrs:` and colon-separated hex parts), or `None` for
    /// a key that is not one of ours.
    fn path_of(&self, key: &str, file: bool) -> Option<PathBuf> {
        let mut parts = key.strip_prefix("kvrs:")?.split(':');
        let mut path = self.dir.clone();
        let mut last = None;
        for p in parts.by_ref() {
            if p.is_empty() {
                continue;
            }
            if !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            if let Some(prev) = last.replace(p) {
                path.push(prev);
            }
        }
        let last = last?;
        if file {
            path.push(format!("{last}.kvb"));
        } else {
            path.push(last);
        }
        Some(path)
    }

    /// Takes the directory's lock: waiting at most [`usage::LOCK_WAIT`], or trying once
    /// within [`STUCK_FOR`] of the last timeout.
    fn lock(&self) -> io::Result<DirLock> {
        let stuck = self
            .stuck_since
            .lock()
            .is_some_and(|t| t.elapsed() < STUCK_FOR);
        let wait = if stuck {
            std::time::Duration::ZERO
        } else {
            usage::LOCK_WAIT
        };
        let got = DirLock::acquire_within(&self.dir, wait);
        match &got {
            Ok(_) => *self.stuck_since.lock() = None,
            Err(e) if e.kind() == io::ErrorKind::TimedOut && !stuck => {
                *self.stuck_since.lock() = Some(std::time::Instant::now());
            }
            Err(_) => {}
        }
        got
    }

    /// Under the lock: reserves `len` bytes in the shared total (rescanning and evicting
    /// when it would pass the bound) and creates the temporary file `tmp` at that length.
    /// Returns the file and the generation of the reservation, or `None` when the writes
    /// in flight leave no room.
    fn reserve(&self, tmp: &Path, len: u64) -> io::Result<Option<(fs::File, u64)>> {
        let _lock = self.lock()?;
        let old = Usage::read(&self.dir);
        let mut usage = old.unwrap_or(Usage {
            total: 0,
            puts: 0,
            generation: 0,
        });
        let over = |u: &Usage| u.total.saturating_add(len) > self.max_bytes;
        if old.is_none() || usage.puts + 1 >= RESCAN_EVERY || over(&usage) {
            let (fresh, blocks) = rescan(&self.dir, old);
            usage = fresh;
            if over(&usage) {
                let low = self.max_bytes - self.max_bytes / 10;
                let removed = evict(&mut usage, blocks, len, low);
                TierCounters::add(&self.counters.evictions, removed);
            }
            if over(&usage) {
                usage.write(&self.dir)?;
                return Ok(None);
            }
        }
        usage.total += len;
        usage.puts += 1;
        // Counted before the file exists: a crash in between overcounts, never under.
        usage.write(&self.dir)?;
        match create_sized(tmp, len) {
            Ok(f) => Ok(Some((f, usage.generation))),
            Err(e) => {
                // Put back what was there: no accounting file if there was none (the
                // next store rescans), so a store that cannot write leaves nothing.
                if old.is_none() {
                    let _ = fs::remove_file(self.dir.join(usage::USAGE_FILE));
                } else {
                    usage.total -= len;
                    let _ = usage.write(&self.dir);
                }
                Err(e)
            }
        }
    }

    /// Subtracts `bytes` that this process removed from the shared total, unless a
    /// rescan since `generation` (taken before the removal) already counted the
    /// directory without them.
    fn subtract(&self, bytes: u64, generation: Option<u64>) {
        let Some(generation) = generation else { return };
        if bytes == 0 {
            return;
        }
        let Ok(_lock) = self.lock() else {
            return;
        };
        if let Some(mut u) = Usage::read(&self.dir) {
            if u.generation == generation {
                u.total = u.total.saturating_sub(bytes);
                let _ = u.write(&self.dir);
            }
        }
    }

    /// Writes `payload` to `tmp` and renames it to `path`; whether it is stored (`false`:
    /// no room for it now).
    fn write(&self, path: &Path, tmp: &Path, payload: &[u8]) -> io::Result<bool> {
        let len = payload.len() as u64;
        fs::create_dir_all(tmp.parent().expect("a file in a directory"))?;
        let Some((mut f, generation)) = self.reserve(tmp, len)? else {
            return Ok(false);
        };
        let written = f.write_all(payload).and_then(|()| {
            drop(f);
            // Under the lock, so a rescan never sees the file under both names or none.
            let _lock = self.lock()?;
            fs::rename(tmp, path)
        });
        if let Err(e) = written {
            let _ = fs::remove_file(tmp);
            self.subtract(len, Some(generation));
            return Err(e);
        }
        Ok(true)
    }

    /// Stores one payload atomically; whether it is now stored.
    fn put_one(&self, key: &str, payload: &[u8]) -> bool {
        let Some(path) = self.path_of(key, true) else {
            return false;
        };
        if payload.len() as u64 > self.max_bytes {
            return false;
        }
        // The same payload already there is only marked used; anything else at the path
        // (another payload, a planted file, a FIFO, a symlink) is replaced.
        if let Ok(Opened::File(mut f, len)) = open_regular(&path) {
            if holds(&mut f, len, payload) {
                touch(&f);
                return true;
            }
        }
        let tmp = path.with_file_name(format!(
            "{TEMP_PREFIX}{}-{}",
            std::process::id(),
            self.serial.fetch_add(1, Ordering::Relaxed)
        ));
        match self.write(&path, &tmp, payload) {
            Ok(true) => {
                TierCounters::add(&self.counters.stores, 1);
                TierCounters::add(&self.counters.store_bytes, payload.len() as u64);
                true
            }
            Ok(false) => false,
            Err(e) => {
                self.counters
                    .fail(format_args!("writing {}: {e}", path.display()));
                false
            }
        }
    }

    /// The payload of `key` if it is a regular file of a length in `sizes`.
    fn get_one(&self, key: &str, sizes: &RangeInclusive<usize>) -> Option<Vec<u8>> {
        let path = self.path_of(key, true)?;
        let rejected = || {
            TierCounters::add(&self.counters.rejected, 1);
            None
        };
        let failed = |e: std::io::Error| {
            self.counters
                .fail(format_args!("reading {}: {e}", path.display()));
            None
        };
        match open_regular(&path) {
            Ok(Opened::Missing) => None,
            Ok(Opened::NotRegular) => rejected(),
            Ok(Opened::File(mut f, len)) => {
                if !usize::try_from(len).is_ok_and(|l| sizes.contains(&l)) {
                    return rejected();
                }
                match read_exact_len(&mut f, len) {
                    Ok(Some(bytes)) => {
                        touch(&f);
                        Some(bytes)
                    }
                    Ok(None) => rejected(),
                    Err(e) => failed(e),
                }
            }
            Err(e) => failed(e),
        }
    }
}

impl Tier for DiskTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn get_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<Option<Vec<u8>>> {
        TierCounters::add(&self.counters.lookups, keys.len() as u64);
        keys.iter().map(|k| self.get_one(k, &sizes)).collect()
    }

    fn contains_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<bool> {
        keys.iter()
            .map(|k| {
                let Some(path) = self.path_of(k, true) else {
                    return false;
                };
                // Opened as a read is (never following a link, never blocking), not read.
                matches!(open_regular(&path), Ok(Opened::File(_, len))
                    if usize::try_from(len).is_ok_and(|l| sizes.contains(&l)))
            })
            .collect()
    }

    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
        items.iter().map(|(k, p)| self.put_one(k, p)).collect()
    }

    fn drop_prefix(&self, prefix: &str) -> usize {
        let Some(ns) = self.path_of(prefix, false) else {
            return 0;
        };
        let generation = self
            .lock()
            .ok()
            .and_then(|_lock| Usage::read(&self.dir))
            .map(|u| u.generation);
        let mut s = Scan::default();
        scan(&ns, false, &mut s);
        // Only what this call unlinked is subtracted (and counted).
        let (mut removed, mut bytes) = (0, 0);
        for (path, len, _) in &s.blocks {
            if fs::remove_file(path).is_ok() {
                removed += 1;
                bytes += len;
            }
        }
        let _ = fs::remove_dir_all(&ns);
        self.subtract(bytes, generation);
        removed
    }

    fn discard(&self, key: &str) {
        let Some(path) = self.path_of(key, true) else {
            return;
        };
        // On a lookup's path: never waits for the lock. Without it the file is removed
        // and the total overcounts until the next rescan (never under).
        let Ok(_lock) = DirLock::acquire_within(&self.dir, std::time::Duration::ZERO) else {
            let _ = fs::remove_file(&path);
            return;
        };
        let len = fs::symlink_metadata(&path)
            .ok()
            .filter(|m| m.is_file())
            .map_or(0, |m| m.len());
        if fs::remove_file(&path).is_ok() && len > 0 {
            if let Some(mut u) = Usage::read(&self.dir) {
                u.total = u.total.saturating_sub(len);
                let _ = u.write(&self.dir);
            }
        }
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}

#[cfg(test)]
mod tests;
