//! The directory's shared accounting: an exclusive `flock` on the directory itself, and
//! under it the file `.usage` holding the byte total of every process's block and
//! temporary files, with a full rescan (sweeping dead writers' temporary files) and the
//! LRU eviction over the real directory contents.

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::file::{open_regular, pid_alive, Opened};

/// The accounting file's name, in the tier's directory.
pub(super) const USAGE_FILE: &str = ".usage";
/// The prefix of temporary files: `.tmp-{pid}-{serial}`.
pub(super) const TEMP_PREFIX: &str = ".tmp-";
/// A temporary file untouched this long is a dead writer's, whatever its pid says (the
/// pid may have been reused).
pub(super) const TEMP_MAX_AGE: Duration = Duration::from_secs(600);
/// A temporary file whose writer's pid is gone is swept once untouched this long (a
/// writer in another PID namespace looks dead: this spares one that is still writing).
pub(super) const TEMP_DEAD_GRACE: Duration = Duration::from_secs(10);
/// Puts (by all processes together) between two full rescans, which correct the total
/// for files added or removed outside kvrs.
pub(super) const RESCAN_EVERY: u64 = 256;

/// An exclusive `flock` on the directory, released when dropped. Each lock opens the
/// directory afresh, so it excludes other threads of this process as well as other
/// processes, and it is the directory now at the path that is locked.
pub(super) struct DirLock {
    _dir: File,
}

/// The longest wait for the directory's lock: every cooperating holder keeps it for a
/// few system calls or a rescan, so a lock held longer is a stopped process or another
/// user of the directory holding it on purpose, and the operation gives up (a miss or a
/// dropped write, counted as an error) instead of hanging its caller.
pub(super) const LOCK_WAIT: Duration = Duration::from_secs(2);

impl DirLock {
    /// Takes the lock on `dir`, waiting at most [`LOCK_WAIT`] (`TimedOut` after).
    pub(super) fn acquire(dir: &Path) -> io::Result<DirLock> {
        Self::acquire_within(dir, LOCK_WAIT)
    }

    /// Takes the lock on `dir`, waiting at most `wait` (`TimedOut` after; zero: one try).
    pub(super) fn acquire_within(dir: &Path, wait: Duration) -> io::Result<DirLock> {
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NONBLOCK)
            .open(dir)?;
        let deadline = std::time::Instant::now() + wait;
        let mut pause = Duration::from_micros(50);
        loop {
            // SAFETY: the descriptor is open for the call.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(DirLock { _dir: f });
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                ErrorKind::Interrupted => continue,
                ErrorKind::WouldBlock if std::time::Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(5));
                }
                ErrorKind::WouldBlock => {
                    return Err(io::Error::new(
                        ErrorKind::TimedOut,
                        "the directory's lock was held too long",
                    ))
                }
                _ => return Err(e),
            }
        }
    }
}

/// The shared accounting (read and written under [`DirLock`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Usage {
    /// Bytes of block and temporary files (their lengths), in-flight writes included.
    pub total: u64,
    /// Puts since the last rescan.
    pub puts: u64,
    /// Changes at every rescan: an amount removed under a generation is subtracted only
    /// if no rescan (which counted the directory afresh) came between.
    pub generation: u64,
}

impl Usage {
    /// The accounting of `dir`, or `None` if it is missing or unreadable (rescan).
    pub(super) fn read(dir: &Path) -> Option<Usage> {
        let Ok(Opened::File(f, 24)) = open_regular(&dir.join(USAGE_FILE)) else {
            return None;
        };
        let mut b = [0u8; 24];
        f.read_exact_at(&mut b, 0).ok()?;
        let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        Some(Usage {
            total: word(0),
            puts: word(1),
            generation: word(2),
        })
    }

    /// Stores the accounting of `dir` (24 bytes, little-endian). Anything but a regular
    /// file at its path is replaced.
    pub(super) fn write(&self, dir: &Path) -> io::Result<()> {
        let path = dir.join(USAGE_FILE);
        let open = |new: bool| {
            OpenOptions::new()
                .write(true)
                .create(!new)
                .create_new(new)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&path)
        };
        let f = match open(false) {
            Ok(f) if f.metadata()?.is_file() => f,
            _ => {
                let _ = fs::remove_file(&path);
                open(true)?
            }
        };
        let mut b = [0u8; 24];
        for (i, w) in [self.total, self.puts, self.generation].iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        f.write_all_at(&b, 0)?;
        f.set_len(24)
    }
}

/// A block file seen by a scan: path, length, last use.
pub(super) type Block = (PathBuf, u64, SystemTime);

/// What a scan of the directory found.
#[derive(Debug, Default)]
pub(super) struct Scan {
    /// Lengths of block and (live) temporary files.
    pub total: u64,
    /// The block files.
    pub blocks: Vec<Block>,
}

/// Whether a temporary file named `name` (`.tmp-{pid}-{serial}`), last modified at
/// `modified`, belongs to a writer that is gone.
fn stale_temp(name: &str, modified: SystemTime) -> bool {
    let age = SystemTime::now()
        .duration_since(modified)
        .unwrap_or_default();
    if age >= TEMP_MAX_AGE {
        return true;
    }
    let pid = name
        .strip_prefix(TEMP_PREFIX)
        .and_then(|r| r.split('-').next())
        .and_then(|p| p.parse::<u32>().ok());
    match pid {
        Some(pid) if pid == std::process::id() => false,
        Some(pid) => age >= TEMP_DEAD_GRACE && !pid_alive(pid),
        None => false,
    }
}

/// Scans `dir` recursively (never following symlinks): block files (`*.kvb`) and
/// temporary files, regular files only, counted by length. With `sweep`, temporary
/// files of dead writers are removed (and not counted).
pub(super) fn scan(dir: &Path, sweep: bool, out: &mut Scan) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        // `DirEntry::metadata` does not follow a symlink.
        let Ok(meta) = e.metadata() else { continue };
        let path = e.path();
        if meta.is_dir() {
            scan(&path, sweep, out);
            continue;
        }
        if !meta.is_file() {
            continue;
        }
        let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(TEMP_PREFIX) {
            if sweep && stale_temp(&name, modified) && fs::remove_file(&path).is_ok() {
                continue;
            }
            out.total += meta.len();
        } else if name.ends_with(".kvb") {
            out.total += meta.len();
            out.blocks.push((path, meta.len(), modified));
        }
    }
}

/// Under the lock: a full rescan of `dir` (sweeping dead writers' temporary files);
/// returns the fresh accounting (a new generation) and the block files.
pub(super) fn rescan(dir: &Path, old: Option<Usage>) -> (Usage, Vec<Block>) {
    let mut s = Scan::default();
    scan(dir, true, &mut s);
    let generation = match old {
        Some(u) => u.generation.wrapping_add(1),
        // A fresh generation unlike any a writer may still hold.
        None => SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    };
    let usage = Usage {
        total: s.total,
        puts: 0,
        generation,
    };
    (usage, s.blocks)
}

/// Under the lock, after a rescan: removes the least recently used `blocks` until
/// `usage.total + incoming <= target`; returns how many files were removed. Only
/// removals that succeed are subtracted (a file another process removed first is its
/// to account for).
pub(super) fn evict(usage: &mut Usage, mut blocks: Vec<Block>, incoming: u64, target: u64) -> u64 {
    blocks.sort_by_key(|b| b.2);
    let mut removed = 0;
    for (path, len, _) in blocks {
        if usage.total.saturating_add(incoming) <= target {
            break;
        }
        if fs::remove_file(&path).is_ok() {
            usage.total = usage.total.saturating_sub(len);
            removed += 1;
        }
    }
    removed
}
