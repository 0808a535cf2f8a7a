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
//! **Batches.** A batch of stores is done in rounds: the temporary files of a round are
//! reserved (the shared total written once for the round) and created under one hold of
//! the lock, written in parallel on this process's pool (a payload given as parts, such
//! as a page's header, the page where the caller keeps it and its MAC, is written with
//! `writev`, never joined; a MAC left to the tier, [`Tier::put_sealing`], is computed by
//! the thread that writes that payload, right before writing it), and renamed into place
//! under one hold of the lock. A round ends before a payload for which its
//! own temporary files leave no room, so the next round can evict them once they are in
//! place, as single stores would. Lookups of a batch ([`Tier::read_each`]) are read in
//! parallel, each into its thread's reused buffer.
//!
//! Files are not fsynced: after a crash a file may be cut short, and its MAC then
//! fails and it is discarded.

mod file;
mod usage;

use std::fs;
use std::io;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use super::{Parts, Seal, Tier, TierCounters, TRAILER};
use crate::error::{KvError, Result};
use file::{
    create_sized, holds, open_regular, read_exact_len, read_exact_len_into, touch, with_scratch,
    write_parts, Opened,
};
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
        Self::subtract_locked(&self.dir, &[(bytes, generation)]);
    }

    /// Under the lock: subtracts each `(bytes, generation)` as [`DiskTier::subtract`]
    /// does, with one read and one write of the total.
    fn subtract_locked(dir: &Path, removed: &[(u64, u64)]) {
        if removed.is_empty() {
            return;
        }
        if let Some(mut u) = Usage::read(dir) {
            let bytes: u64 = removed
                .iter()
                .filter(|&&(_, g)| g == u.generation)
                .map(|&(b, _)| b)
                .sum();
            if bytes > 0 {
                u.total = u.total.saturating_sub(bytes);
                let _ = u.write(dir);
            }
        }
    }

    /// What a store does with `payload` (of `len` bytes) of `key`, before any lock:
    /// nothing (not one of our keys, or longer than the bound), only mark it used (the
    /// same bytes are already there), or write it through a temporary file.
    fn plan(&self, key: &str, payload: Payload<'_>, len: u64) -> Plan {
        let Some(path) = self.path_of(key, true) else {
            return Plan::Refused;
        };
        if len > self.max_bytes {
            return Plan::Refused;
        }
        // The same payload already there is only marked used; anything else at the path
        // (another payload, a planted file, a FIFO, a symlink) is replaced.
        // (A sealed payload's trailer is computed only when a file of its length is there.)
        if let Ok(Opened::File(mut f, flen)) = open_regular(&path) {
            if flen == len && payload.with_parts(|parts| holds(&mut f, flen, parts)) {
                touch(&f);
                return Plan::Held;
            }
        }
        if let Err(e) = fs::create_dir_all(path.parent().expect("a file in a directory")) {
            return Plan::Failed(format!("writing {}: {e}", path.display()));
        }
        let tmp = path.with_file_name(format!(
            "{TEMP_PREFIX}{}-{}",
            std::process::id(),
            self.serial.fetch_add(1, Ordering::Relaxed)
        ));
        Plan::Write { path, tmp }
    }

    /// Under one hold of the lock: reserves in the shared total, in order, the payloads
    /// of `todo` (index, length, temporary path) and creates their temporary files at
    /// their lengths, as many as fit. Returns one outcome per payload it got to (a
    /// prefix of `todo`): it stops before a payload for which the temporary files of
    /// this round leave no room (the next round, once they are renamed into place and
    /// evictable, starts with it); a payload that does not fit with none of this round
    /// in flight is refused, as a single store would be. The total is written once for
    /// the round, before any of its files is created (a crash in between overcounts,
    /// never under), and once more only if a file could not be created.
    fn reserve_round(&self, todo: &[(usize, u64, &Path)]) -> Vec<Reserve> {
        let lock = match self.lock() {
            Ok(l) => l,
            Err(e) => {
                let why = format!("locking {}: {e}", self.dir.display());
                return todo.iter().map(|_| Reserve::Failed(why.clone())).collect();
            }
        };
        let old = Usage::read(&self.dir);
        let (mut usage, fits) = self.fit_round(old, todo);
        if let Err(e) = usage.write(&self.dir) {
            let why = format!("writing {}: {e}", self.dir.display());
            return fits
                .iter()
                .map(|&fit| {
                    if fit {
                        Reserve::Failed(why.clone())
                    } else {
                        Reserve::Refused
                    }
                })
                .collect();
        }
        let mut out: Vec<Reserve> = Vec::with_capacity(fits.len());
        let mut unmade = 0;
        for (&fit, &(_, len, tmp)) in fits.iter().zip(todo) {
            if !fit {
                out.push(Reserve::Refused);
                continue;
            }
            match create_sized(tmp, len) {
                Ok(f) => out.push(Reserve::Reserved(f, usage.generation)),
                Err(e) => {
                    unmade += len;
                    out.push(Reserve::Failed(format!("writing {}: {e}", tmp.display())));
                }
            }
        }
        if unmade > 0 {
            // Take back what was not created: no accounting file if there was none and
            // nothing was created (the next store rescans), so a store that cannot write
            // leaves nothing.
            usage.total -= unmade;
            let made = out.iter().any(|r| matches!(r, Reserve::Reserved(..)));
            if old.is_none() && !made {
                let _ = fs::remove_file(self.dir.join(usage::USAGE_FILE));
            } else {
                let _ = usage.write(&self.dir);
            }
        }
        drop(lock);
        out
    }

    /// Under the lock, with the shared total `old` (`None`: missing): which payloads of
    /// `todo`, in order, this round reserves (`true`) or refuses (`false`), rescanning
    /// (and evicting) when the total is missing, due for a rescan or short of room; and
    /// the total with them counted. Stops before a payload for which this round's own
    /// reservations leave no room. A rescan counts the directory as it is, so the
    /// round's reservations so far (whose files are not created yet) are added to it.
    fn fit_round(&self, old: Option<Usage>, todo: &[(usize, u64, &Path)]) -> (Usage, Vec<bool>) {
        let mut fresh = old.is_none();
        let mut usage = old.unwrap_or(Usage {
            total: 0,
            puts: 0,
            generation: 0,
        });
        let mut fits: Vec<bool> = Vec::with_capacity(todo.len());
        let mut pending = 0u64;
        for &(_, len, _) in todo {
            let over = |u: &Usage| u.total.saturating_add(len) > self.max_bytes;
            if fresh || usage.puts + 1 >= RESCAN_EVERY || over(&usage) {
                let (mut scanned, blocks) = rescan(&self.dir, (!fresh).then_some(usage));
                fresh = false;
                scanned.total = scanned.total.saturating_add(pending);
                usage = scanned;
                if over(&usage) {
                    let low = self.max_bytes - self.max_bytes / 10;
                    let removed = evict(&mut usage, blocks, len, low);
                    TierCounters::add(&self.counters.evictions, removed);
                }
                if over(&usage) {
                    if pending > 0 {
                        break;
                    }
                    fits.push(false);
                    continue;
                }
            }
            usage.total += len;
            usage.puts += 1;
            pending += len;
            fits.push(true);
        }
        (usage, fits)
    }

    /// Stores each payload (given as its parts, concatenated) atomically; per item,
    /// whether it is now stored. The temporary files of a round are reserved under one
    /// hold of the directory's lock, written in parallel on this process's pool (never
    /// under the lock), then renamed into place under one hold of the lock.
    fn store(&self, items: &[(&str, Payload<'_>)]) -> Vec<bool> {
        let lens: Vec<u64> = items.iter().map(|(_, p)| p.len()).collect();
        let plans: Vec<Plan> = crate::parallel::install(|| {
            items
                .par_iter()
                .zip(&lens)
                .with_max_len(1)
                .map(|(&(key, payload), &len)| self.plan(key, payload, len))
                .collect()
        });
        let mut taken: Vec<bool> = plans.iter().map(|p| matches!(p, Plan::Held)).collect();
        let mut todo: Vec<(usize, u64, &Path)> = Vec::with_capacity(items.len());
        for (i, plan) in plans.iter().enumerate() {
            match plan {
                Plan::Write { tmp, .. } => todo.push((i, lens[i], tmp.as_path())),
                Plan::Failed(why) => self.counters.fail(why),
                Plan::Held | Plan::Refused => {}
            }
        }
        let mut at = 0;
        while at < todo.len() {
            let reserved = self.reserve_round(&todo[at..]);
            let round = &todo[at..at + reserved.len()];
            at += reserved.len().max(1);
            // Write each reserved temporary file, in parallel, without the lock.
            let written: Vec<Option<(io::Result<()>, u64)>> = crate::parallel::install(|| {
                round
                    .par_iter()
                    .zip(reserved)
                    .with_max_len(1)
                    .map(|(&(i, _, tmp), r)| match r {
                        Reserve::Reserved(mut f, generation) => {
                            Some((write_file(&mut f, tmp, items[i].1), generation))
                        }
                        Reserve::Refused => None,
                        Reserve::Failed(why) => {
                            self.counters.fail(why);
                            None
                        }
                    })
                    .collect()
            });
            self.finish_round(round, written, &plans, &mut taken);
        }
        taken
    }

    /// Renames the temporary files of a round that were written whole into place, under
    /// one hold of the lock (so a rescan never sees a file under both names or none);
    /// removes the others and takes their bytes back from the shared total.
    fn finish_round(
        &self,
        round: &[(usize, u64, &Path)],
        written: Vec<Option<(io::Result<()>, u64)>>,
        plans: &[Plan],
        taken: &mut [bool],
    ) {
        if written.iter().all(Option::is_none) {
            return;
        }
        let lock = self.lock();
        let mut removed: Vec<(u64, u64)> = Vec::new();
        for (&(i, len, tmp), w) in round.iter().zip(written) {
            let Some((result, generation)) = w else {
                continue;
            };
            let Plan::Write { path, .. } = &plans[i] else {
                unreachable!("only planned writes are reserved")
            };
            let result = result.and_then(|()| match &lock {
                Ok(_) => fs::rename(tmp, path),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            });
            match result {
                Ok(()) => {
                    taken[i] = true;
                    TierCounters::add(&self.counters.stores, 1);
                    TierCounters::add(&self.counters.store_bytes, len);
                }
                Err(e) => {
                    let _ = fs::remove_file(tmp);
                    removed.push((len, generation));
                    self.counters
                        .fail(format_args!("writing {}: {e}", path.display()));
                }
            }
        }
        // Without the lock nothing is taken back: the total overcounts until the next
        // rescan, never under.
        if lock.is_ok() {
            Self::subtract_locked(&self.dir, &removed);
        }
    }

    /// Opens the payload file of `key` for reading if it is a regular file of a length
    /// in `sizes` (counting a refusal or a failure); its path, file and length.
    fn open_payload(
        &self,
        key: &str,
        sizes: &RangeInclusive<usize>,
    ) -> Option<(PathBuf, fs::File, u64)> {
        let path = self.path_of(key, true)?;
        match open_regular(&path) {
            Ok(Opened::Missing) => None,
            Ok(Opened::NotRegular) => {
                TierCounters::add(&self.counters.rejected, 1);
                None
            }
            Ok(Opened::File(f, len)) => {
                if !usize::try_from(len).is_ok_and(|l| sizes.contains(&l)) {
                    TierCounters::add(&self.counters.rejected, 1);
                    return None;
                }
                Some((path, f, len))
            }
            Err(e) => {
                self.counters
                    .fail(format_args!("reading {}: {e}", path.display()));
                None
            }
        }
    }

    /// The payload of `key` if it is a regular file of a length in `sizes`.
    fn get_one(&self, key: &str, sizes: &RangeInclusive<usize>) -> Option<Vec<u8>> {
        let (path, mut f, len) = self.open_payload(key, sizes)?;
        match read_exact_len(&mut f, len) {
            Ok(Some(bytes)) => {
                touch(&f);
                Some(bytes)
            }
            Ok(None) => {
                TierCounters::add(&self.counters.rejected, 1);
                None
            }
            Err(e) => {
                self.counters
                    .fail(format_args!("reading {}: {e}", path.display()));
                None
            }
        }
    }

    /// Reads the payload of `key` (if it is a regular file of a length in `sizes`) into
    /// this thread's scratch buffer and hands it to `check`.
    fn read_one(&self, key: &str, sizes: &RangeInclusive<usize>, check: impl FnOnce(&[u8])) {
        let Some((path, mut f, len)) = self.open_payload(key, sizes) else {
            return;
        };
        with_scratch(len as usize, |buf| {
            match read_exact_len_into(&mut f, len, buf) {
                Ok(Some(bytes)) => {
                    touch(&f);
                    check(bytes);
                }
                Ok(None) => TierCounters::add(&self.counters.rejected, 1),
                Err(e) => self
                    .counters
                    .fail(format_args!("reading {}: {e}", path.display())),
            }
        });
    }
}

/// What a store does with one payload ([`DiskTier::plan`]).
#[derive(Debug)]
enum Plan {
    /// Nothing: not one of our keys, or longer than the bound.
    Refused,
    /// Nothing: the same bytes are there (now marked used).
    Held,
    /// Could not prepare its directory (the failure, for the counters).
    Failed(String),
    /// Write it to `tmp`, then rename that to `path`.
    Write { path: PathBuf, tmp: PathBuf },
}

/// A reservation's outcome ([`DiskTier::reserve_round`]).
#[derive(Debug)]
enum Reserve {
    /// Counted, its temporary file created at its length: the file and the generation
    /// of the total it was counted in.
    Reserved(fs::File, u64),
    /// No room for it.
    Refused,
    /// The lock, the total or the file could not be had (the failure).
    Failed(String),
}

/// A payload to store: its parts, in order, and the seal that computes its last part
/// (its MAC) from them, if that part is not given.
#[derive(Clone, Copy)]
struct Payload<'a> {
    parts: &'a [&'a [u8]],
    seal: Option<Seal<'a>>,
}

impl Payload<'_> {
    /// Its length in bytes, the trailer included.
    fn len(&self) -> u64 {
        let given: usize = self.parts.iter().map(|p| p.len()).sum();
        (given + if self.seal.is_some() { TRAILER } else { 0 }) as u64
    }

    /// Runs `f` with every part, the trailer computed (on this thread) if it is sealed.
    fn with_parts<R>(&self, f: impl FnOnce(&[&[u8]]) -> R) -> R {
        let Some(seal) = self.seal else {
            return f(self.parts);
        };
        let trailer = seal(self.parts);
        let mut all: [&[u8]; 4] = [&[]; 4];
        assert!(
            self.parts.len() < all.len(),
            "at most 3 parts and a trailer"
        );
        all[..self.parts.len()].copy_from_slice(self.parts);
        all[self.parts.len()] = &trailer;
        f(&all[..=self.parts.len()])
    }
}

/// Writes `payload` to the temporary file `f` (at `tmp`) from its start: a sealed one's
/// trailer is computed here, on the writing thread, while its parts are read into the
/// CPU's cache once for both.
fn write_file(f: &mut fs::File, tmp: &Path, payload: Payload<'_>) -> io::Result<()> {
    payload.with_parts(|parts| {
        #[cfg(test)]
        if tests::inject::write_fails(tmp) {
            // A writer that dies or fills the disk part way: some bytes, then an error.
            write_parts(f, &parts[..1])?;
            return Err(io::Error::other("injected write failure"));
        }
        let _ = tmp;
        write_parts(f, parts)
    })
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
                // An lstat (never follows a link, never opens, so never blocks on a
                // FIFO): a regular file of an accepted length, that this process may
                // read (else every read would fail without it going away). What it
                // holds is verified when it is read.
                fs::symlink_metadata(&path).is_ok_and(|m| {
                    m.is_file()
                        && usize::try_from(m.len()).is_ok_and(|l| sizes.contains(&l))
                        && file::readable(&path)
                })
            })
            .collect()
    }

    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
        let parts: Vec<[&[u8]; 1]> = items.iter().map(|(_, p)| [p.as_slice()]).collect();
        let items: Vec<(&str, Payload<'_>)> = items
            .iter()
            .zip(&parts)
            .map(|((k, _), p)| {
                (
                    k.as_str(),
                    Payload {
                        parts: p,
                        seal: None,
                    },
                )
            })
            .collect();
        self.store(&items)
    }

    /// Writes each payload's parts straight from where they lie (`writev`), never
    /// joined into one buffer.
    fn put_parts(&self, items: &[(&str, Parts<'_>)]) -> Vec<bool> {
        let items: Vec<(&str, Payload<'_>)> = items
            .iter()
            .map(|(k, p)| {
                (
                    *k,
                    Payload {
                        parts: p,
                        seal: None,
                    },
                )
            })
            .collect();
        self.store(&items)
    }

    /// Writes each payload's parts straight from where they lie (`writev`), its trailer
    /// computed by the thread that writes it, right before the write (the batch in one
    /// round where the bound allows, the payloads written in parallel on this process's
    /// pool).
    fn put_sealing(&self, items: &[(&str, [&[u8]; 2])], seal: Seal<'_>) -> Vec<bool> {
        let items: Vec<(&str, Payload<'_>)> = items
            .iter()
            .map(|(k, p)| {
                let payload = Payload {
                    parts: p,
                    seal: Some(seal),
                };
                (*k, payload)
            })
            .collect();
        self.store(&items)
    }

    /// Reads the payloads in parallel on this process's pool, each into its thread's
    /// scratch buffer (reused: no allocation, page fault or zeroing per payload).
    fn read_each(
        &self,
        keys: &[String],
        sizes: RangeInclusive<usize>,
        check: &(dyn Fn(usize, &[u8]) + Sync),
    ) {
        TierCounters::add(&self.counters.lookups, keys.len() as u64);
        crate::parallel::install(|| {
            keys.par_iter()
                .enumerate()
                .with_max_len(1)
                .for_each(|(i, k)| self.read_one(k, &sizes, |p| check(i, p)))
        });
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
