//! [`PageStore`]: an inference engine's own KV pages (opaque bytes of the engine's page
//! layout) in kvrs tiers, each sealed in a kvrs payload envelope.
//!
//! A page is stored as a [`payload`] of one tensor and no tokens: the same magic, header
//! and keyed BLAKE3 MAC as a `BlockPool`'s blocks. What identifies it:
//!
//! - the store's **fingerprint**, made of the engine's facts (model, KV dtype, layout,
//!   page bytes, TP/PP ranks, ...), the secret's public tag and a page-store marker: it
//!   is in every tier key, in every envelope's header and in the MAC key, so a page of
//!   another model, dtype, layout or rank is never found, and one planted under this
//!   store's name fails its header and MAC;
//! - the **namespace** (a tenant's salt), hashed into the tier key and the MAC key;
//! - the engine's **key**, hashed (keyed BLAKE3, 128 bits) into the tier key and the
//!   envelope header.
//!
//! Reads verify before they copy: a page whose length, header or MAC is wrong (torn,
//! truncated, corrupted, forged, or another configuration's) is a miss, discarded from
//! its tier so later lookups do not find it again, and never a byte in the caller's
//! buffer. Stores are as atomic as the tiers make them (a `DiskTier` writes a temporary
//! file and renames it), so a store that fails is never visible.

use std::borrow::Cow;
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::payload::{
    self, BlockMeta, ConfigKey, Fingerprint, MacKey, PayloadShape, TierKey, HEADER,
};
use super::writer::WritePolicy;
use super::{Tier, TierCounters};
use crate::error::{KvError, Result};
use crate::prefix::BlockHash;

/// Counters of a [`PageStore`] (monotonic), beside its tiers' own.
#[derive(Debug, Default)]
pub struct PageCounters {
    /// Pages asked to be stored.
    pub puts: AtomicU64,
    /// Pages some tier took.
    pub stored: AtomicU64,
    /// Pages asked for.
    pub gets: AtomicU64,
    /// Pages found, verified and copied into the caller's buffer.
    pub hits: AtomicU64,
    /// Bytes of those pages.
    pub hit_bytes: AtomicU64,
    /// Payloads found but refused (header, key or MAC mismatch) and discarded.
    pub rejected: AtomicU64,
    /// Pages copied into a faster tier after a hit in a slower one.
    pub promoted: AtomicU64,
}

impl PageCounters {
    /// The counters' values, by name.
    pub fn snapshot(&self) -> [(&'static str, u64); 7] {
        let g = |c: &AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        [
            ("puts", g(&self.puts)),
            ("stored", g(&self.stored)),
            ("gets", g(&self.gets)),
            ("hits", g(&self.hits)),
            ("hit_bytes", g(&self.hit_bytes)),
            ("rejected", g(&self.rejected)),
            ("promoted", g(&self.promoted)),
        ]
    }
}

/// Engine-owned pages in kvrs tiers, sealed and verified (see the module docs).
#[derive(Debug)]
pub struct PageStore {
    tiers: Vec<Arc<dyn Tier>>,
    fp: Fingerprint,
    config: ConfigKey,
    key: TierKey,
    page_bytes: Option<usize>,
    policy: WritePolicy,
    counters: PageCounters,
}

/// A page's envelope but for the page itself and its MAC ([`PageStore::envelope`]); the
/// MAC is computed where the page is stored ([`Tier::put_sealing`]).
#[derive(Debug)]
struct Envelope {
    /// The tier key.
    name: String,
    /// The bytes before the page.
    header: [u8; HEADER],
}

/// What a tier's read of a page came to ([`PageStore::get_into`]): not read (missing,
/// or refused by the tier itself), loaded into its buffer, or refused by its checks.
const UNREAD: u8 = 0;
const LOADED: u8 = 1;
const REFUSED: u8 = 2;

/// The shape of the envelope of a page of `n` bytes.
fn shape(n: usize) -> PayloadShape {
    PayloadShape {
        block_size: 0,
        tensors: 1,
        tensor_bytes: n,
        scale_bytes: 0,
    }
}

/// A 128-bit keyed hash of `bytes` in the domain `context`.
fn hash128(context: &str, bytes: &[u8]) -> BlockHash {
    let k = blake3::derive_key(context, b"");
    let h = blake3::keyed_hash(&k, bytes);
    u128::from_le_bytes(h.as_bytes()[..16].try_into().expect("16 bytes"))
}

/// The root of namespace `ns` (`""`: the default namespace).
/// The first window of keys [`PageStore::exists_prefix`] asks the tiers about.
const PREFIX_WINDOW: usize = 32;

/// Copies `page` into `segments`, in order (their lengths sum to the page's).
fn scatter(page: &[u8], segments: &mut [&mut [u8]]) {
    let mut at = 0;
    for s in segments.iter_mut() {
        s.copy_from_slice(&page[at..at + s.len()]);
        at += s.len();
    }
}

fn namespace_root(ns: &str) -> BlockHash {
    hash128("kvrs 2026-11 page store namespace", ns.as_bytes())
}

/// The hash of the engine's key `key`.
fn key_hash(key: &str) -> BlockHash {
    hash128("kvrs 2026-11 page store key", key.as_bytes())
}

impl PageStore {
    /// A store over `tiers` (fastest first; at least one) whose pages are MACed under
    /// `secret` (at least [`payload::MIN_SECRET`] bytes; `None`: a public key, a
    /// checksum only) and identified by the engine's `facts` (name, value pairs; at
    /// least one; their order does not matter). A fact `page_bytes` makes every page
    /// that length. `policy` says which tiers a page is written to.
    pub fn new(
        tiers: Vec<Arc<dyn Tier>>,
        secret: Option<&[u8]>,
        facts: &[(String, String)],
        policy: WritePolicy,
    ) -> Result<Self> {
        if tiers.is_empty() {
            return Err(KvError::InvalidArgument {
                name: "tiers",
                value: "[]".into(),
                reason: "a page store needs at least one tier".into(),
            });
        }
        if let Some(s) = secret.filter(|s| s.len() < payload::MIN_SECRET) {
            return Err(KvError::InvalidArgument {
                name: "tier_key",
                value: format!("{} bytes", s.len()),
                reason: format!(
                    "must be at least {} bytes (e.g. secrets.token_bytes(32))",
                    payload::MIN_SECRET
                ),
            });
        }
        if facts.is_empty() {
            return Err(KvError::InvalidArgument {
                name: "fingerprint",
                value: "{}".into(),
                reason: "give the engine's facts (model, dtype, layout, page_bytes, tp_rank, ...)"
                    .into(),
            });
        }
        let mut sorted: Vec<&(String, String)> = facts.iter().collect();
        sorted.sort();
        if let Some(w) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(KvError::InvalidArgument {
                name: "fingerprint",
                value: w[0].0.clone(),
                reason: "a fact is given twice".into(),
            });
        }
        let page_bytes = match sorted.iter().find(|(k, _)| k == "page_bytes") {
            None => None,
            Some((_, v)) => match v.parse::<usize>() {
                Ok(n) if n > 0 => Some(n),
                _ => {
                    return Err(KvError::InvalidArgument {
                        name: "fingerprint",
                        value: format!("page_bytes={v}"),
                        reason: "must be a positive integer".into(),
                    })
                }
            },
        };
        let key = TierKey::new(secret);
        let tag = key.tag();
        let fp = payload::fingerprint(
            sorted
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .chain([("kvrs_page_store", "1"), ("tier_key", tag.as_str())]),
        );
        Ok(PageStore {
            config: key.config(&fp),
            tiers,
            fp,
            key,
            page_bytes,
            policy,
            counters: PageCounters::default(),
        })
    }

    /// The tiers, fastest first.
    pub fn tiers(&self) -> &[Arc<dyn Tier>] {
        &self.tiers
    }

    /// The fingerprint's hex (the tier keys' first part).
    pub fn fingerprint_hex(&self) -> String {
        payload::hex(&self.fp)
    }

    /// Whether the MACs are keyed by a secret.
    pub fn is_keyed(&self) -> bool {
        self.key.is_secret()
    }

    /// The page length every page must have, if the facts give one.
    pub fn page_bytes(&self) -> Option<usize> {
        self.page_bytes
    }

    /// What the store did.
    pub fn counters(&self) -> &PageCounters {
        &self.counters
    }

    /// The tier key of page `key` in namespace `ns`.
    pub fn tier_key(&self, key: &str, ns: &str) -> String {
        payload::block_key(&self.fp, namespace_root(ns), key_hash(key))
    }

    /// Checks that a page of `len` bytes is one this store takes.
    pub fn check_len(&self, name: &'static str, index: usize, len: usize) -> Result<()> {
        match self.page_bytes {
            Some(n) if n != len => Err(KvError::InvalidArgument {
                name,
                value: format!("item {index} of {len} bytes"),
                reason: format!("the fingerprint's page_bytes is {n}"),
            }),
            None if len == 0 => Err(KvError::InvalidArgument {
                name,
                value: format!("item {index} of 0 bytes"),
                reason: "a page holds at least one byte".into(),
            }),
            _ => Ok(()),
        }
    }

    /// The envelope lengths a lookup accepts (exact when `page_bytes` is known).
    fn sizes(&self) -> RangeInclusive<usize> {
        match self.page_bytes {
            Some(n) => shape(n).len()..=shape(n).len(),
            None => shape(1).len()..=usize::MAX,
        }
    }

    /// The envelope of a page of `len` bytes under `key` in namespace root `root`: its
    /// tier key and header. The page's bytes stay where they are: the payload is the
    /// header, the page and the MAC of both ([`PageStore::store_sealed`]), byte for byte
    /// what [`payload::seal`] makes of them.
    fn envelope(&self, key: &str, len: usize, root: BlockHash) -> Envelope {
        let k = key_hash(key);
        let meta = BlockMeta {
            key: k,
            parent: 0,
            root,
            first: true,
        };
        Envelope {
            name: payload::block_key(&self.fp, root, k),
            header: payload::header(&self.fp, &shape(len), &meta),
        }
    }

    /// The envelopes of `pages` (keys `keys`) in namespace root `root`.
    fn envelopes(&self, keys: &[&str], pages: &[&[u8]], root: BlockHash) -> Vec<Envelope> {
        keys.iter()
            .zip(pages)
            .map(|(k, p)| self.envelope(k, p.len(), root))
            .collect()
    }

    /// Stores `pages` (in `envelopes`, of namespace root `root`) as the policy says, in
    /// `tiers`; per page, whether some tier took it. Each tier computes the MACs
    /// ([`Tier::put_sealing`]): a tier that writes files computes each on the thread that
    /// writes that page, right before writing it.
    fn store_sealed(
        &self,
        tiers: &[Arc<dyn Tier>],
        envelopes: &[Envelope],
        pages: &[&[u8]],
        root: BlockHash,
    ) -> Vec<bool> {
        let mac: MacKey = self.config.namespace(root);
        let seal = |parts: &[&[u8]]| payload::mac_of(parts, &mac);
        let mut stored = vec![false; pages.len()];
        for tier in tiers {
            let ask: Vec<usize> = (0..pages.len())
                .filter(|&j| self.policy == WritePolicy::All || !stored[j])
                .collect();
            if ask.is_empty() {
                break;
            }
            let batch: Vec<(&str, [&[u8]; 2])> = ask
                .iter()
                .map(|&j| {
                    let e = &envelopes[j];
                    (e.name.as_str(), [&e.header[..], pages[j]])
                })
                .collect();
            for (&j, taken) in ask.iter().zip(tier.put_sealing(&batch, &seal)) {
                stored[j] |= taken;
            }
        }
        stored
    }

    /// Seals and stores `pages` under `keys` in namespace `ns` (as the policy says: every
    /// tier, or the first that takes each); per page, whether some tier took it. The
    /// caller has checked the lengths ([`PageStore::check_len`]); pages of other lengths
    /// than `page_bytes` are not stored. The MACs are computed over the caller's pages
    /// where they lie, and a tier that writes files writes them from there (no sealed
    /// copy), each page MACed by the thread that writes it.
    pub fn put_many(&self, keys: &[&str], pages: &[&[u8]], ns: &str) -> Vec<bool> {
        assert_eq!(keys.len(), pages.len(), "one page per key");
        TierCounters::add(&self.counters.puts, keys.len() as u64);
        let mut stored = vec![false; keys.len()];
        let ok: Vec<usize> = (0..keys.len())
            .filter(|&i| self.check_len("pages", i, pages[i].len()).is_ok())
            .collect();
        let root = namespace_root(ns);
        let ok_keys: Vec<&str> = ok.iter().map(|&i| keys[i]).collect();
        let ok_pages: Vec<&[u8]> = ok.iter().map(|&i| pages[i]).collect();
        let envelopes = self.envelopes(&ok_keys, &ok_pages, root);
        let taken = self.store_sealed(&self.tiers, &envelopes, &ok_pages, root);
        for (&i, t) in ok.iter().zip(taken) {
            stored[i] = t;
        }
        let n = stored.iter().filter(|&&s| s).count();
        TierCounters::add(&self.counters.stored, n as u64);
        stored
    }

    /// Looks `keys` up in namespace `ns`, tier by tier, and copies each page found and
    /// verified into its buffer in `bufs` (whose length is the page's); per key, whether
    /// it was loaded. A buffer is written only with a verified page of its exact length.
    /// A page found in a slower tier is copied into the faster tiers that missed it.
    /// Payloads are read, verified and copied in parallel on this process's pool.
    pub fn get_into(&self, keys: &[&str], bufs: &mut [&mut [u8]], ns: &str) -> Vec<bool> {
        let mut segments: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| vec![&mut **b]).collect();
        self.get_into_segments(keys, &mut segments, ns)
    }

    /// [`PageStore::get_into`] where each key's buffer is given as segments (the page's
    /// bytes in order, e.g. the K and V runs of a page in an engine's host pool): a
    /// verified page is copied straight into them, no buffer of its own in between.
    /// A key's page length is the sum of its segments' lengths.
    pub fn get_into_segments(
        &self,
        keys: &[&str],
        bufs: &mut [Vec<&mut [u8]>],
        ns: &str,
    ) -> Vec<bool> {
        assert_eq!(keys.len(), bufs.len(), "one buffer per key");
        TierCounters::add(&self.counters.gets, keys.len() as u64);
        let root = namespace_root(ns);
        let mac = self.config.namespace(root);
        let lens: Vec<usize> = bufs
            .iter()
            .map(|b| b.iter().map(|s| s.len()).sum())
            .collect();
        let mut loaded = vec![false; keys.len()];
        let ok: Vec<usize> = (0..keys.len())
            .filter(|&i| self.check_len("buffers", i, lens[i]).is_ok())
            .collect();
        let hashes: Vec<BlockHash> = keys.iter().map(|k| key_hash(k)).collect();
        let names: Vec<String> = hashes
            .iter()
            .map(|&h| payload::block_key(&self.fp, root, h))
            .collect();
        // Each buffer behind a lock of its own, so the tier's threads fill them at once.
        let cells: Vec<Mutex<&mut Vec<&mut [u8]>>> = bufs.iter_mut().map(Mutex::new).collect();
        let verdicts: Vec<AtomicU8> = (0..keys.len()).map(|_| AtomicU8::new(UNREAD)).collect();
        // Per tier, the keys it missed (promotion targets).
        let mut missed: Vec<Vec<usize>> = Vec::with_capacity(self.tiers.len());
        for tier in &self.tiers {
            let ask: Vec<usize> = ok.iter().copied().filter(|&i| !loaded[i]).collect();
            if ask.is_empty() {
                break;
            }
            // Per size, one batched request (the sizes a tier accepts are one range).
            let mut by_len: Vec<(usize, Vec<usize>)> = Vec::new();
            for &i in &ask {
                match by_len.iter_mut().find(|(len, _)| *len == lens[i]) {
                    Some((_, v)) => v.push(i),
                    None => by_len.push((lens[i], vec![i])),
                }
            }
            for (n, group) in by_len {
                let sh = shape(n);
                let want: Vec<String> = group.iter().map(|&i| names[i].clone()).collect();
                let check = |j: usize, p: &[u8]| {
                    let i = group[j];
                    let verdict = match payload::decode(p, &self.fp, &sh, hashes[i], &mac) {
                        Ok(c) if c.meta.root == root => {
                            scatter(&p[sh.kv_range(0)], &mut cells[i].lock());
                            LOADED
                        }
                        _ => REFUSED,
                    };
                    verdicts[i].store(verdict, Ordering::Release);
                };
                tier.read_each(&want, sh.len()..=sh.len(), &check);
                for &i in &group {
                    match verdicts[i].swap(UNREAD, Ordering::Acquire) {
                        LOADED => {
                            loaded[i] = true;
                            TierCounters::add(&self.counters.hits, 1);
                            TierCounters::add(&self.counters.hit_bytes, n as u64);
                        }
                        REFUSED => {
                            TierCounters::add(&self.counters.rejected, 1);
                            TierCounters::add(&tier.counters().rejected, 1);
                            tier.discard(&names[i]);
                        }
                        _ => {}
                    }
                }
            }
            missed.push(ask.into_iter().filter(|&i| !loaded[i]).collect());
        }
        drop(cells);
        // Pages served by a slower tier go to the faster ones that missed them.
        for (t, tier_missed) in missed.iter().enumerate() {
            let up: Vec<usize> = tier_missed.iter().copied().filter(|&i| loaded[i]).collect();
            if up.is_empty() {
                continue;
            }
            let up_keys: Vec<&str> = up.iter().map(|&i| keys[i]).collect();
            // A page in segments is joined for its store (promotion is the rare path).
            let joined: Vec<Cow<'_, [u8]>> = up
                .iter()
                .map(|&i| match &bufs[i][..] {
                    [one] => Cow::Borrowed(&**one),
                    segments => Cow::Owned(segments.concat()),
                })
                .collect();
            let up_pages: Vec<&[u8]> = joined.iter().map(|p| &**p).collect();
            let envelopes = self.envelopes(&up_keys, &up_pages, root);
            let n = self
                .store_sealed(&self.tiers[t..=t], &envelopes, &up_pages, root)
                .iter()
                .filter(|&&s| s)
                .count();
            TierCounters::add(&self.counters.promoted, n as u64);
        }
        loaded
    }

    /// The tier keys of `keys` in namespace `ns`.
    fn names(&self, keys: &[&str], ns: &str) -> Vec<String> {
        let root = namespace_root(ns);
        keys.iter()
            .map(|k| payload::block_key(&self.fp, root, key_hash(k)))
            .collect()
    }

    /// Whether each of `keys` is present in namespace `ns` in some tier (a payload of an
    /// accepted length at the key's name; its MAC is checked when it is read, and a page
    /// that fails it is then discarded): one batched request per tier, which asks only
    /// for the keys the tiers before it did not have.
    pub fn exists_many(&self, keys: &[&str], ns: &str) -> Vec<bool> {
        let names = self.names(keys, ns);
        let mut present = vec![false; keys.len()];
        let sizes = self.sizes();
        for tier in &self.tiers {
            let ask: Vec<usize> = (0..keys.len()).filter(|&i| !present[i]).collect();
            if ask.is_empty() {
                break;
            }
            let want: Vec<String> = ask.iter().map(|&i| names[i].clone()).collect();
            for (&i, has) in ask.iter().zip(tier.contains_many(&want, sizes.clone())) {
                present[i] |= has;
            }
        }
        present
    }

    /// How many of `keys`, from the first, are present in namespace `ns` in some tier
    /// (a payload of an accepted length at the key's name; its MAC is checked when it
    /// is read, and a page that fails it is then discarded). Asked in windows of 32
    /// keys growing fourfold, so a miss early in a long prefix is answered without
    /// asking for the keys after it.
    pub fn exists_prefix(&self, keys: &[&str], ns: &str) -> usize {
        let (mut at, mut window) = (0, PREFIX_WINDOW);
        while at < keys.len() {
            let end = keys.len().min(at + window);
            let lead = self
                .exists_many(&keys[at..end], ns)
                .iter()
                .take_while(|&&p| p)
                .count();
            at += lead;
            if at < end {
                break;
            }
            window *= 4;
        }
        at
    }

    /// Removes every page of namespace `ns` (this fingerprint's) from every tier; how
    /// many tier entries were removed.
    pub fn drop_namespace(&self, ns: &str) -> usize {
        let prefix = payload::namespace_prefix(&self.fp, namespace_root(ns));
        self.tiers.iter().map(|t| t.drop_prefix(&prefix)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::HostTier;

    fn facts(model: &str) -> Vec<(String, String)> {
        vec![
            ("model".into(), model.into()),
            ("dtype".into(), "float16".into()),
        ]
    }

    fn store(host: &Arc<HostTier>, model: &str, secret: &[u8]) -> PageStore {
        PageStore::new(
            vec![host.clone() as Arc<dyn Tier>],
            Some(secret),
            &facts(model),
            WritePolicy::All,
        )
        .unwrap()
    }

    #[test]
    fn pages_round_trip_only_for_their_model_secret_and_namespace() {
        let host = Arc::new(HostTier::new(1 << 20));
        let s = store(&host, "m", b"a-sixteen-byte-secret");
        let page = [7u8; 100];
        assert_eq!(s.put_many(&["k1"], &[&page], "t1"), [true]);
        let mut buf = [0u8; 100];
        assert_eq!(s.get_into(&["k1"], &mut [&mut buf], "t1"), [true]);
        assert_eq!(buf, page);
        let mut other = [0u8; 100];
        assert_eq!(s.get_into(&["k1"], &mut [&mut other], "t2"), [false]);
        let m2 = store(&host, "m2", b"a-sixteen-byte-secret");
        assert_eq!(m2.get_into(&["k1"], &mut [&mut other], "t1"), [false]);
        let k2 = store(&host, "m", b"another-16-byte-secret");
        assert_eq!(k2.get_into(&["k1"], &mut [&mut other], "t1"), [false]);
        let mut short = [0u8; 99];
        assert_eq!(s.get_into(&["k1"], &mut [&mut short], "t1"), [false]);
        assert_eq!(other, [0u8; 100]);
        assert_eq!(s.exists_prefix(&["k1", "k2", "k1"], "t1"), 1);
        assert_eq!(s.drop_namespace("t1"), 1);
        assert_eq!(s.exists_prefix(&["k1"], "t1"), 0);
    }

    /// A tier that records the keys of each `contains_many`, over a host tier.
    #[derive(Debug)]
    struct Asked {
        inner: HostTier,
        asked: Mutex<Vec<Vec<String>>>,
    }

    impl Tier for Asked {
        fn name(&self) -> &str {
            "asked"
        }
        fn get_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<Option<Vec<u8>>> {
            self.inner.get_many(keys, sizes)
        }
        fn contains_many(&self, keys: &[String], sizes: RangeInclusive<usize>) -> Vec<bool> {
            self.asked.lock().push(keys.to_vec());
            self.inner.contains_many(keys, sizes)
        }
        fn put_many(&self, items: &[(String, Arc<Vec<u8>>)]) -> Vec<bool> {
            self.inner.put_many(items)
        }
        fn drop_prefix(&self, prefix: &str) -> usize {
            self.inner.drop_prefix(prefix)
        }
        fn discard(&self, key: &str) {
            self.inner.discard(key)
        }
        fn counters(&self) -> &TierCounters {
            self.inner.counters()
        }
    }

    #[test]
    fn exists_many_asks_each_tier_once_for_what_the_faster_ones_missed() {
        let tier = |bytes| {
            Arc::new(Asked {
                inner: HostTier::new(bytes),
                asked: Mutex::new(Vec::new()),
            })
        };
        let (fast, slow) = (tier(1 << 20), tier(1 << 20));
        let facts = facts("m");
        let secret = Some(&b"a-sixteen-byte-secret"[..]);
        let both = PageStore::new(
            vec![fast.clone() as Arc<dyn Tier>, slow.clone() as Arc<dyn Tier>],
            secret,
            &facts,
            WritePolicy::All,
        )
        .unwrap();
        let only_slow = PageStore::new(
            vec![slow.clone() as Arc<dyn Tier>],
            secret,
            &facts,
            WritePolicy::All,
        )
        .unwrap();
        let page = [3u8; 64];
        assert_eq!(both.put_many(&["a", "b"], &[&page, &page], "t"), [true; 2]);
        assert_eq!(only_slow.put_many(&["c"], &[&page], "t"), [true]);
        let keys = ["x", "a", "c", "b", "y", "c"];
        assert_eq!(
            both.exists_many(&keys, "t"),
            [false, true, true, true, false, true]
        );
        // One request per tier; the slow one only for the keys the fast one missed.
        let names = |ks: &[&str]| ks.iter().map(|k| both.tier_key(k, "t")).collect::<Vec<_>>();
        assert_eq!(*fast.asked.lock(), [names(&keys)]);
        assert_eq!(*slow.asked.lock(), [names(&["x", "c", "y", "c"])]);
        // Another namespace, or a store of another model, has none of them.
        assert_eq!(both.exists_many(&keys, "u"), [false; 6]);
        let other = PageStore::new(
            vec![fast.clone() as Arc<dyn Tier>],
            secret,
            &super::tests::facts("m2"),
            WritePolicy::All,
        )
        .unwrap();
        assert_eq!(other.exists_many(&["a"], "t"), [false]);
        assert_eq!(both.exists_many(&[], "t"), Vec::<bool>::new());
    }

    #[test]
    fn bad_arguments_are_refused_by_name() {
        let host = Arc::new(HostTier::new(1 << 20)) as Arc<dyn Tier>;
        let err = |r: Result<PageStore>| r.unwrap_err().to_string();
        assert!(
            err(PageStore::new(vec![], None, &facts("m"), WritePolicy::All)).starts_with("tiers=")
        );
        assert!(err(PageStore::new(
            vec![host.clone()],
            Some(b"short"),
            &facts("m"),
            WritePolicy::All
        ))
        .starts_with("tier_key="));
        assert!(err(PageStore::new(
            vec![host.clone()],
            None,
            &[],
            WritePolicy::All
        ))
        .starts_with("fingerprint="));
        let bad = vec![("page_bytes".to_string(), "x".to_string())];
        assert!(
            err(PageStore::new(vec![host], None, &bad, WritePolicy::All)).contains("page_bytes=x")
        );
    }

    fn tmpdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kvrs-pages-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// The payload the store's earlier path sealed for `page`: a copy of the page in a
    /// buffer [`payload::begin`] started, MACed by [`payload::seal`].
    fn sealed_copy(s: &PageStore, key: &str, page: &[u8], ns: &str) -> Vec<u8> {
        let root = namespace_root(ns);
        let sh = shape(page.len());
        let meta = BlockMeta {
            key: key_hash(key),
            parent: 0,
            root,
            first: true,
        };
        let mut env = payload::begin(&s.fp, &sh, &meta, &[]);
        env[sh.kv_range(0)].copy_from_slice(page);
        payload::seal(&mut env, &s.config.namespace(root));
        env
    }

    /// The file a `DiskTier` in `dir` keeps tier key `name` in.
    fn file_of(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        let parts: Vec<&str> = name.strip_prefix("kvrs:").unwrap().split(':').collect();
        let (last, dirs) = parts.split_last().unwrap();
        let mut p = dir.to_path_buf();
        p.extend(dirs);
        p.join(format!("{last}.kvb"))
    }

    fn page_of(seed: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i.wrapping_mul(131) ^ seed.wrapping_mul(7919)) as u8)
            .collect()
    }

    #[test]
    fn written_parts_are_byte_for_byte_the_sealed_payload_in_every_tier() {
        let dir = tmpdir("parts");
        let disk = Arc::new(crate::tier::DiskTier::open(&dir, 1 << 30).unwrap());
        let host = Arc::new(HostTier::new(1 << 30));
        let s = PageStore::new(
            vec![host.clone() as Arc<dyn Tier>, disk.clone() as Arc<dyn Tier>],
            Some(b"a-sixteen-byte-secret"),
            &facts("m"),
            WritePolicy::All,
        )
        .unwrap();
        // Lengths around BLAKE3's 1 KiB chunks and 64-byte blocks, and a large page.
        let lens = [1, 63, 64, 65, 1023, 1024, 1025, 4096 + 17, 3 << 20];
        let keys: Vec<String> = (0..lens.len()).map(|i| format!("k{i}")).collect();
        let pages: Vec<Vec<u8>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| page_of(i, n))
            .collect();
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ps: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        assert!(s.put_many(&ks, &ps, "ns").iter().all(|&t| t));
        for (k, p) in ks.iter().zip(&ps) {
            let want = sealed_copy(&s, k, p, "ns");
            let name = s.tier_key(k, "ns");
            assert_eq!(std::fs::read(file_of(&dir, &name)).unwrap(), want, "{k}");
            let held = host
                .get_many(&[name], want.len()..=want.len())
                .pop()
                .unwrap();
            assert_eq!(held.as_deref(), Some(&want[..]), "{k}");
        }
        // A payload the earlier path sealed and stored is found and loaded.
        let old = sealed_copy(&s, "old", &pages[4], "ns");
        assert_eq!(
            disk.put_many(&[(s.tier_key("old", "ns"), Arc::new(old))]),
            [true]
        );
        let only_disk = PageStore::new(
            vec![disk.clone() as Arc<dyn Tier>],
            Some(b"a-sixteen-byte-secret"),
            &facts("m"),
            WritePolicy::All,
        )
        .unwrap();
        let mut buf = vec![0u8; pages[4].len()];
        assert_eq!(only_disk.get_into(&["old"], &mut [&mut buf], "ns"), [true]);
        assert_eq!(buf, pages[4]);
        // Storing the same pages again only marks the files used.
        let stores = disk.counters().stores.load(Ordering::Relaxed);
        assert!(only_disk.put_many(&ks, &ps, "ns").iter().all(|&t| t));
        assert_eq!(disk.counters().stores.load(Ordering::Relaxed), stores);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_batch_loads_each_page_into_its_own_buffer_and_refused_ones_stay_untouched() {
        let dir = tmpdir("batch");
        let disk = Arc::new(crate::tier::DiskTier::open(&dir, 1 << 30).unwrap());
        let s = PageStore::new(
            vec![disk.clone() as Arc<dyn Tier>],
            Some(b"a-sixteen-byte-secret"),
            &facts("m"),
            WritePolicy::All,
        )
        .unwrap();
        // Two lengths (two batched reads), the larger read first so that the threads'
        // reused buffers hold a longer page when the shorter ones are read.
        let n = 40;
        let len = |i: usize| if i.is_multiple_of(3) { 300_000 } else { 70_000 };
        let keys: Vec<String> = (0..n).map(|i| format!("page-{i}")).collect();
        let pages: Vec<Vec<u8>> = (0..n).map(|i| page_of(i, len(i))).collect();
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ps: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        assert!(s.put_many(&ks, &ps, "").iter().all(|&t| t));
        // Faults: a flipped byte, a truncation, another key's (valid) payload, a missing
        // file; every other page loads.
        let file = |i: usize| file_of(&dir, &s.tier_key(ks[i], ""));
        let mut flipped = std::fs::read(file(1)).unwrap();
        flipped[HEADER + 5] ^= 1;
        std::fs::write(file(1), flipped).unwrap();
        let cut = std::fs::read(file(4)).unwrap();
        std::fs::write(file(4), &cut[..cut.len() - 100]).unwrap();
        std::fs::copy(file(5), file(2)).unwrap();
        std::fs::remove_file(file(7)).unwrap();
        let faulty = [1, 2, 4, 7];
        for round in 0..2 {
            let mut bufs: Vec<Vec<u8>> = (0..n).map(|i| vec![0xEE; len(i)]).collect();
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            let got = s.get_into(&ks, &mut slices, "");
            for i in 0..n {
                if faulty.contains(&i) {
                    assert!(!got[i], "round {round}: page {i} is refused");
                    assert!(bufs[i].iter().all(|&b| b == 0xEE), "page {i} untouched");
                } else {
                    assert!(got[i], "round {round}: page {i}");
                    assert_eq!(bufs[i], pages[i], "round {round}: page {i}");
                }
            }
        }
        // Refused payloads were discarded (counted once) and are misses now.
        assert_eq!(s.counters().rejected.load(Ordering::Relaxed), 2);
        assert!(!file(1).exists() && !file(2).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn segments_receive_the_page_in_order_and_a_promoted_page_is_whole() {
        let dir = tmpdir("segments");
        let disk = Arc::new(crate::tier::DiskTier::open(&dir, 1 << 30).unwrap());
        let host = Arc::new(HostTier::new(1 << 20));
        let secret = b"a-sixteen-byte-secret";
        let make = |tiers: Vec<Arc<dyn Tier>>| {
            PageStore::new(tiers, Some(secret), &facts("m"), WritePolicy::All).unwrap()
        };
        let on_disk = make(vec![disk.clone() as Arc<dyn Tier>]);
        let (a, b) = (page_of(1, 1000), page_of(2, 1000));
        assert!(on_disk
            .put_many(&["a", "b"], &[&a, &b], "")
            .iter()
            .all(|&t| t));
        let mut flipped = std::fs::read(file_of(&dir, &on_disk.tier_key("b", ""))).unwrap();
        flipped[HEADER + 5] ^= 1;
        std::fs::write(file_of(&dir, &on_disk.tier_key("b", "")), flipped).unwrap();
        // Host (fast, empty) over disk: "a" is served by the disk and promoted.
        let both = make(vec![
            host.clone() as Arc<dyn Tier>,
            disk.clone() as Arc<dyn Tier>,
        ]);
        let mut pool = vec![0xEEu8; 2000];
        let (p0, rest) = pool.split_at_mut(700);
        let (p1, rest) = rest.split_at_mut(800);
        let (p2, p3) = rest.split_at_mut(300);
        // "a" as 300 bytes at 1500.. then 700 at 0..; "b" (refused) as 800 + 200 bytes.
        let mut bufs = vec![vec![p2, p0], vec![p1, p3]];
        let got = both.get_into_segments(&["a", "b"], &mut bufs, "");
        assert_eq!(got, [true, false]);
        drop(bufs);
        assert_eq!(&pool[1500..1800], &a[..300]);
        assert_eq!(&pool[..700], &a[300..]);
        assert!(pool[700..1500]
            .iter()
            .chain(&pool[1800..])
            .all(|&x| x == 0xEE));
        // The promoted copy in the host tier is the whole page, joined from its segments.
        let mut whole = vec![0u8; 1000];
        let host_only = make(vec![host.clone() as Arc<dyn Tier>]);
        assert_eq!(
            host_only.get_into(&["a"], &mut [&mut whole[..]], ""),
            [true]
        );
        assert_eq!(whole, a);
        assert_eq!(both.counters().promoted.load(Ordering::Relaxed), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_long_prefix_counts_up_to_its_first_absent_key_across_windows() {
        let host = Arc::new(HostTier::new(1 << 24));
        let s = store(&host, "m", b"a-sixteen-byte-secret");
        let keys: Vec<String> = (0..300).map(|i| format!("k{i}")).collect();
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let page = page_of(0, 64);
        let stored: Vec<&str> = ks.iter().copied().filter(|k| *k != "k170").collect();
        let pages: Vec<&[u8]> = stored.iter().map(|_| page.as_slice()).collect();
        assert!(s.put_many(&stored, &pages, "").iter().all(|&t| t));
        // Windows 32, 128, 512: the absent key falls in the third.
        assert_eq!(s.exists_prefix(&ks, ""), 170);
        assert_eq!(s.exists_prefix(&ks[..170], ""), 170);
        assert_eq!(s.exists_prefix(&ks[..32], ""), 32);
        assert_eq!(s.exists_prefix(&ks[171..], ""), 129);
        assert_eq!(s.exists_prefix(&["absent", "k0"], ""), 0);
        assert_eq!(s.exists_prefix(&[], ""), 0);
    }
}
