//! [`HostTier`]: block payloads in this process's memory, bounded, least recently used
//! out first. For a CUDA pool it is the tier between device memory and disk or Redis (an
//! evicted block is copied to the host once and comes back with one copy); pools of one
//! process can share it.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{Tier, TierCounters};

/// Block payloads in host memory.
#[derive(Debug)]
pub struct HostTier {
    max_bytes: u64,
    inner: Mutex<Inner>,
    counters: TierCounters,
}

/// The payloads by key, and their use order (a tick per use).
#[derive(Debug, Default)]
struct Inner {
    by_key: FxHashMap<String, (Arc<Vec<u8>>, u64)>,
    by_use: BTreeMap<u64, String>,
    used: u64,
    tick: u64,
}

impl Inner {
    /// Marks `key` as used now.
    fn touch(&mut self, key: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((_, t)) = self.by_key.get_mut(key) {
            let old = std::mem::replace(t, tick);
            let k = self.by_use.remove(&old).expect("every key has a tick");
            self.by_use.insert(tick, k);
        }
    }

    /// Removes `key`; its bytes.
    fn remove(&mut self, key: &str) -> u64 {
        match self.by_key.remove(key) {
            Some((p, t)) => {
                self.by_use.remove(&t);
                self.used -= p.len() as u64;
                p.len() as u64
            }
            None => 0,
        }
    }
}

impl HostTier {
    /// An empty tier holding at most `max_bytes` of payloads.
    pub fn new(max_bytes: u64) -> Self {
        HostTier {
            max_bytes,
            inner: Mutex::new(Inner::default()),
            counters: TierCounters::default(),
        }
    }

    /// The size bound in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Bytes of payloads held now.
    pub fn used_bytes(&self) -> u64 {
        self.inner.lock().used
    }
}

impl Tier for HostTier {
    fn name(&self) -> &str {
        "host"
    }

    /// Host memory ends with the process.
    fn persistent(&self) -> bool {
        false
    }

    fn get_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<Option<Vec<u8>>> {
        TierCounters::add(&self.counters.lookups, keys.len() as u64);
        let mut inner = self.inner.lock();
        keys.iter()
            .map(|k| {
                let p = inner.by_key.get(k).map(|(p, _)| p.clone())?;
                if !sizes.contains(&p.len()) {
                    TierCounters::add(&self.counters.rejected, 1);
                    return None;
                }
                inner.touch(k);
                Some(p.as_ref().clone())
            })
            .collect()
    }

    fn contains_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<bool> {
        let inner = self.inner.lock();
        keys.iter()
            .map(|k| {
                inner
                    .by_key
                    .get(k)
                    .is_some_and(|(p, _)| sizes.contains(&p.len()))
            })
            .collect()
    }

    fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
        let mut inner = self.inner.lock();
        items
            .iter()
            .map(|(k, p)| {
                let n = p.len() as u64;
                if n > self.max_bytes {
                    return false;
                }
                inner.remove(k);
                while inner.used + n > self.max_bytes {
                    let (_, oldest) = inner.by_use.pop_first().expect("bytes held");
                    let (old, _) = inner.by_key.remove(&oldest).expect("indexed");
                    inner.used -= old.len() as u64;
                    TierCounters::add(&self.counters.evictions, 1);
                }
                inner.tick += 1;
                let tick = inner.tick;
                inner.by_key.insert(k.clone(), (p.clone(), tick));
                inner.by_use.insert(tick, k.clone());
                inner.used += n;
                TierCounters::add(&self.counters.stores, 1);
                TierCounters::add(&self.counters.store_bytes, n);
                true
            })
            .collect()
    }

    fn drop_prefix(&self, prefix: &str) -> usize {
        let mut inner = self.inner.lock();
        let keys: Vec<String> = inner
            .by_key
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        for k in &keys {
            inner.remove(k);
        }
        keys.len()
    }

    fn discard(&self, key: &str) {
        self.inner.lock().remove(key);
    }

    fn counters(&self) -> &TierCounters {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANY: RangeInclusive<usize> = 0..=usize::MAX;

    #[test]
    fn holds_its_bound_least_recently_used_out_first() {
        let t = HostTier::new(250);
        let item = |k: &str| (k.to_string(), Arc::new(vec![1u8; 100]));
        assert_eq!(t.put_many(&[item("a"), item("b")]), [true, true]);
        assert!(t.get_many(&["a".into()], ANY)[0].is_some()); // b is now the oldest
        assert_eq!(t.put_many(&[item("c")]), [true]);
        let got = t.get_many(&["a".into(), "b".into(), "c".into()], ANY);
        assert_eq!(
            got.iter().map(Option::is_some).collect::<Vec<_>>(),
            [true, false, true]
        );
        assert_eq!(t.used_bytes(), 200);
        assert_eq!(
            t.put_many(&[("big".into(), Arc::new(vec![0; 300]))]),
            [false]
        );
        assert_eq!(t.drop_prefix("a"), 1);
        t.discard("c");
        assert_eq!(t.used_bytes(), 0);
    }
}
