//! [`DiskTier`]: block payloads as files in a directory, bounded in size, least recently
//! used first out.
//!
//! A key `kvrs:{fingerprint}:{root}:{block}` is the file `{dir}/{fingerprint}/{root}/{block}.kvb`,
//! so a namespace is one directory. Writes go to a temporary file in the same directory
//! and are renamed into place, so a reader (in this process or another sharing the
//! directory) sees a whole payload or none. Reading a payload sets its modification time,
//! the LRU clock. When the directory grows past `max_bytes`, the least recently used
//! files are removed until it is under 90% of it (every process sharing the directory
//! does this over the real directory contents, so the bound holds for them together).
//! Files are not fsynced: after a crash a file may be cut short, and its checksum then
//! fails and it is discarded.

use std::fs;
use std::io::{ErrorKind, Write};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use parking_lot::Mutex;

use super::{Tier, TierCounters};
use crate::error::{KvError, Result};

/// Block payloads in a size-bounded directory.
#[derive(Debug)]
pub struct DiskTier {
    name: String,
    dir: PathBuf,
    max_bytes: u64,
    /// Bytes this process believes the directory holds (recounted when evicting).
    used: AtomicU64,
    /// Serialises this process's evictions.
    evicting: Mutex<()>,
    /// Makes temporary file names unique within the process.
    serial: AtomicU64,
    counters: TierCounters,
}

/// The payload files under `dir`, recursively: (path, size, last use).
fn payload_files(dir: &Path, out: &mut Vec<(PathBuf, u64, SystemTime)>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(meta) = e.metadata() else { continue };
        if meta.is_dir() {
            payload_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "kvb") {
            out.push((
                path,
                meta.len(),
                meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            ));
        }
    }
}

impl DiskTier {
    /// A tier in `dir` (created if missing) holding at most `max_bytes` of payloads.
    pub fn open(dir: impl Into<PathBuf>, max_bytes: u64) -> Result<Self> {
        let dir: PathBuf = dir.into();
        fs::create_dir_all(&dir).map_err(|e| KvError::Io {
            path: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let mut files = Vec::new();
        payload_files(&dir, &mut files);
        Ok(DiskTier {
            name: format!("disk:{}", dir.display()),
            dir,
            max_bytes,
            used: AtomicU64::new(files.iter().map(|f| f.1).sum()),
            evicting: Mutex::new(()),
            serial: AtomicU64::new(0),
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

    /// Bytes of payloads in the directory now.
    pub fn used_bytes(&self) -> u64 {
        let mut files = Vec::new();
        payload_files(&self.dir, &mut files);
        files.iter().map(|f| f.1).sum()
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

    /// Removes the least recently used payloads until the directory is under 90% of its
    /// bound (counted afresh: other processes may share it).
    fn evict(&self) {
        let Some(_guard) = self.evicting.try_lock() else {
            return;
        };
        let mut files = Vec::new();
        payload_files(&self.dir, &mut files);
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        if total > self.max_bytes {
            files.sort_by_key(|f| f.2);
            let low = self.max_bytes / 10 * 9;
            for (path, size, _) in files {
                if total <= low {
                    break;
                }
                if fs::remove_file(&path).is_ok() {
                    TierCounters::add(&self.counters.evictions, 1);
                }
                total -= size;
            }
        }
        self.used.store(total, Ordering::Relaxed);
    }

    /// Writes one payload atomically; whether it is now stored.
    fn put_one(&self, key: &str, payload: &[u8]) -> bool {
        let Some(path) = self.path_of(key, true) else {
            return false;
        };
        if payload.len() as u64 > self.max_bytes {
            return false;
        }
        if path.exists() {
            touch(&path);
            return true;
        }
        let dir = path.parent().expect("a file in a directory");
        let tmp = dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            self.serial.fetch_add(1, Ordering::Relaxed)
        ));
        let write = || -> std::io::Result<()> {
            fs::create_dir_all(dir)?;
            let mut f = fs::File::create(&tmp)?;
            f.write_all(payload)?;
            fs::rename(&tmp, &path)
        };
        if write().is_err() {
            let _ = fs::remove_file(&tmp);
            TierCounters::add(&self.counters.errors, 1);
            return false;
        }
        TierCounters::add(&self.counters.stores, 1);
        TierCounters::add(&self.counters.store_bytes, payload.len() as u64);
        let used =
            self.used.fetch_add(payload.len() as u64, Ordering::Relaxed) + payload.len() as u64;
        if used > self.max_bytes {
            self.evict();
        }
        true
    }
}

/// Marks `path` as used now (the LRU clock); a failure only ages the file.
fn touch(path: &Path) {
    if let Ok(f) = fs::File::options().write(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

impl Tier for DiskTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn get_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<Option<Vec<u8>>> {
        TierCounters::add(&self.counters.lookups, keys.len() as u64);
        keys.iter()
            .map(|k| {
                let path = self.path_of(k, true)?;
                if let Ok(meta) = fs::metadata(&path) {
                    if !sizes.contains(&(meta.len() as usize)) {
                        TierCounters::add(&self.counters.rejected, 1);
                        return None;
                    }
                }
                match fs::read(&path) {
                    Ok(bytes) => {
                        touch(&path);
                        Some(bytes)
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => None,
                    Err(_) => {
                        TierCounters::add(&self.counters.errors, 1);
                        None
                    }
                }
            })
            .collect()
    }

    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
        items.iter().map(|(k, p)| self.put_one(k, p)).collect()
    }

    fn drop_prefix(&self, prefix: &str) -> usize {
        let Some(dir) = self.path_of(prefix, false) else {
            return 0;
        };
        let mut files = Vec::new();
        payload_files(&dir, &mut files);
        let _ = fs::remove_dir_all(&dir);
        let removed: u64 = files.iter().map(|f| f.1).sum();
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(removed))
            });
        files.len()
    }

    fn discard(&self, key: &str) {
        if let Some(path) = self.path_of(key, true) {
            let _ = fs::remove_file(path);
        }
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvrs-disk-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn stores_reads_bounds_and_drops_namespaces() {
        let dir = tmpdir("basic");
        let t = DiskTier::open(&dir, 1000).unwrap();
        let item = |k: &str, n: usize| (k.to_string(), Arc::new(vec![n as u8; n]));
        let taken = t.put_many(&[
            item("kvrs:aa:01:10", 300),
            item("kvrs:aa:02:11", 300),
            item("kvrs:aa:01:12", 2000),
        ]);
        assert_eq!(
            taken,
            [true, true, false],
            "a payload past the bound is not taken"
        );
        let got = t.get_many(
            &[
                "kvrs:aa:01:10".into(),
                "kvrs:aa:01:99".into(),
                "../x".into(),
            ],
            0..=usize::MAX,
        );
        assert_eq!(got[0].as_deref(), Some(&[44u8; 300][..]));
        assert!(got[1].is_none() && got[2].is_none());
        // 10 was just read: the LRU victim of the next overflow is 11.
        std::thread::sleep(std::time::Duration::from_millis(20));
        t.get_many(&["kvrs:aa:01:10".into()], 0..=usize::MAX);
        t.put_many(&[item("kvrs:aa:01:13", 300), item("kvrs:aa:01:14", 300)]);
        assert!(t.used_bytes() <= 1000);
        assert!(t.get_many(&["kvrs:aa:02:11".into()], 0..=usize::MAX)[0].is_none());
        assert!(t.get_many(&["kvrs:aa:01:14".into()], 0..=usize::MAX)[0].is_some());
        assert!(t.counters().evictions.load(Ordering::Relaxed) >= 1);
        // A restart finds what is there.
        let again = DiskTier::open(&dir, 1000).unwrap();
        assert!(again.get_many(&["kvrs:aa:01:14".into()], 0..=usize::MAX)[0].is_some());
        assert!(again.drop_prefix("kvrs:aa:01:") >= 1);
        assert!(again.get_many(&["kvrs:aa:01:14".into()], 0..=usize::MAX)[0].is_none());
        let _ = fs::remove_dir_all(&dir);
    }
}
