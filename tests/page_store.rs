//! `PageStore` against a `HashMap` reference: random puts, gets, prefix lookups and
//! namespace drops on a `DiskTier` directory, with payload files corrupted, truncated,
//! forged (re-sealed under another secret) and swapped for another model's page between
//! the operations. Every lookup either loads exactly the bytes the reference holds or
//! misses, leaving the buffer untouched; a bad payload is never loaded.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvrs::tier::{DiskTier, HostTier, PageStore, Tier};
use kvrs::WritePolicy;
use proptest::prelude::*;

const PAGE: usize = 48;
const SECRET: &[u8] = b"page-store-test-secret-32-bytes!";
const KEYS: [&str; 5] = ["a", "b", "c", "d", "e"];
const NAMESPACES: [&str; 3] = ["", "tenant-1", "tenant-2"];

fn facts(model: &str) -> Vec<(String, String)> {
    [
        ("model", model),
        ("dtype", "bfloat16"),
        ("layout", "page_first"),
        ("page_bytes", "48"),
        ("tp_rank", "0"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn tmpdir(name: &str) -> PathBuf {
    static SERIAL: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "kvrs-pages-{name}-{}-{}",
        std::process::id(),
        SERIAL.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&d);
    d
}

/// The file a `DiskTier` in `dir` keeps tier key `name` in.
fn file_of(dir: &Path, name: &str) -> PathBuf {
    let parts: Vec<&str> = name.strip_prefix("kvrs:").unwrap().split(':').collect();
    let (last, dirs) = parts.split_last().unwrap();
    let mut p = dir.to_path_buf();
    p.extend(dirs);
    p.join(format!("{last}.kvb"))
}

fn page(seed: u8) -> Vec<u8> {
    (0..PAGE)
        .map(|i| seed.wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

#[derive(Clone, Debug)]
enum Fault {
    /// One byte flipped (same length).
    Flip(usize),
    /// Cut to a shorter length.
    Truncate(usize),
    /// The page sealed under another secret, planted at this store's name.
    Forge,
    /// Another model's page for the same key and namespace, planted at this store's name.
    OtherModel,
}

#[derive(Clone, Debug)]
enum Op {
    Put(usize, usize, u8),
    Get(usize, usize),
    Exists(Vec<usize>, usize),
    Drop(usize),
    Corrupt(usize, usize, Fault),
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0..KEYS.len();
    let ns = 0..NAMESPACES.len();
    let fault = prop_oneof![
        (0usize..400).prop_map(Fault::Flip),
        (0usize..150).prop_map(Fault::Truncate),
        Just(Fault::Forge),
        Just(Fault::OtherModel),
    ];
    prop_oneof![
        4 => (k.clone(), ns.clone(), any::<u8>()).prop_map(|(k, n, s)| Op::Put(k, n, s)),
        4 => (k.clone(), ns.clone()).prop_map(|(k, n)| Op::Get(k, n)),
        2 => (prop::collection::vec(k.clone(), 0..5), ns.clone()).prop_map(|(ks, n)| Op::Exists(ks, n)),
        1 => ns.clone().prop_map(Op::Drop),
        2 => (k, ns, fault).prop_map(|(k, n, f)| Op::Corrupt(k, n, f)),
    ]
}

/// What the reference holds for a key: its page, a bad payload of the right length
/// (present to a prefix lookup until a read finds it bad and discards it), or a file of
/// the wrong length (never present, left in place, removed by a namespace drop).
#[derive(Clone, Debug, PartialEq)]
enum Entry {
    Good(Vec<u8>),
    BadSameLength,
    WrongLength,
}

fn store(tier: &Arc<DiskTier>, model: &str, secret: &[u8]) -> PageStore {
    PageStore::new(
        vec![tier.clone() as Arc<dyn Tier>],
        Some(secret),
        &facts(model),
        WritePolicy::All,
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_disk_page_store_matches_a_hashmap_and_never_loads_a_bad_payload(
        ops in prop::collection::vec(op(), 1..40)
    ) {
        let dir = tmpdir("model");
        let tier = Arc::new(DiskTier::open(&dir, 1 << 24).unwrap());
        let s = store(&tier, "llama-3-8b", SECRET);
        // Writers of the faults: another secret, another model (their own directories).
        let forger_dir = tmpdir("forger");
        let forger = store(&Arc::new(DiskTier::open(&forger_dir, 1 << 24).unwrap()), "llama-3-8b", b"not-the-pools-secret-at-all!!");
        let other_dir = tmpdir("other");
        let other = store(&Arc::new(DiskTier::open(&other_dir, 1 << 24).unwrap()), "qwen-7b", SECRET);
        let mut model: HashMap<(usize, usize), Entry> = HashMap::new();
        for op in ops {
            match op {
                Op::Put(k, n, seed) => {
                    let p = page(seed);
                    prop_assert_eq!(s.put_many(&[KEYS[k]], &[&p], NAMESPACES[n]), vec![true]);
                    model.insert((k, n), Entry::Good(p));
                }
                Op::Get(k, n) => {
                    let mut buf = vec![0xEEu8; PAGE];
                    let got = s.get_into(&[KEYS[k]], &mut [&mut buf[..]], NAMESPACES[n]);
                    match model.get(&(k, n)) {
                        Some(Entry::Good(p)) => {
                            prop_assert_eq!(got, vec![true]);
                            prop_assert_eq!(&buf, p);
                        }
                        bad => {
                            prop_assert_eq!(got, vec![false], "{:?}", bad);
                            prop_assert_eq!(&buf, &vec![0xEEu8; PAGE], "a miss leaves the buffer");
                            if bad == Some(&Entry::BadSameLength) {
                                // A bad payload was discarded when read.
                                model.remove(&(k, n));
                                let name = s.tier_key(KEYS[k], NAMESPACES[n]);
                                prop_assert!(!file_of(&dir, &name).exists());
                            }
                        }
                    }
                }
                Op::Exists(ks, n) => {
                    let keys: Vec<&str> = ks.iter().map(|&k| KEYS[k]).collect();
                    let present = |k: usize| {
                        matches!(model.get(&(k, n)), Some(Entry::Good(_) | Entry::BadSameLength))
                    };
                    let want = ks.iter().take_while(|&&k| present(k)).count();
                    prop_assert_eq!(s.exists_prefix(&keys, NAMESPACES[n]), want);
                    let each: Vec<bool> = ks.iter().map(|&k| present(k)).collect();
                    prop_assert_eq!(s.exists_many(&keys, NAMESPACES[n]), each);
                }
                Op::Drop(n) => {
                    let want = model.keys().filter(|(_, m)| *m == n).count();
                    prop_assert_eq!(s.drop_namespace(NAMESPACES[n]), want);
                    model.retain(|(_, m), _| *m != n);
                }
                Op::Corrupt(k, n, fault) => {
                    let name = s.tier_key(KEYS[k], NAMESPACES[n]);
                    let path = file_of(&dir, &name);
                    let Ok(mut bytes) = fs::read(&path) else {
                        prop_assert!(!model.contains_key(&(k, n)));
                        continue;
                    };
                    let was_wrong = model.get(&(k, n)) == Some(&Entry::WrongLength);
                    let entry = match fault {
                        Fault::Flip(_) | Fault::Truncate(_) if bytes.is_empty() => continue,
                        Fault::Flip(i) => {
                            let at = i % bytes.len();
                            bytes[at] ^= 0x10;
                            if was_wrong { Entry::WrongLength } else { Entry::BadSameLength }
                        }
                        Fault::Truncate(len) => {
                            bytes.truncate(len % bytes.len());
                            Entry::WrongLength
                        }
                        Fault::Forge => {
                            let forged = page(0xAB);
                            forger.put_many(&[KEYS[k]], &[&forged], NAMESPACES[n]);
                            let f = file_of(&forger_dir, &forger.tier_key(KEYS[k], NAMESPACES[n]));
                            bytes = fs::read(f).unwrap();
                            Entry::BadSameLength
                        }
                        Fault::OtherModel => {
                            let theirs = page(0xCD);
                            other.put_many(&[KEYS[k]], &[&theirs], NAMESPACES[n]);
                            let f = file_of(&other_dir, &other.tier_key(KEYS[k], NAMESPACES[n]));
                            bytes = fs::read(f).unwrap();
                            Entry::BadSameLength
                        }
                    };
                    fs::write(&path, &bytes).unwrap();
                    model.insert((k, n), entry);
                }
            }
        }
        // Every key and namespace, one batched lookup each: the reference's good pages.
        for (n, ns) in NAMESPACES.iter().enumerate() {
            let mut bufs = vec![vec![0u8; PAGE]; KEYS.len()];
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let got = s.get_into(&KEYS, &mut slices, ns);
            for k in 0..KEYS.len() {
                let good = matches!(model.get(&(k, n)), Some(Entry::Good(_)));
                prop_assert_eq!(got[k], good);
                if let Some(Entry::Good(p)) = model.get(&(k, n)) {
                    prop_assert_eq!(&bufs[k], p);
                }
            }
        }
        for d in [dir, forger_dir, other_dir] {
            let _ = fs::remove_dir_all(d);
        }
    }
}

#[test]
fn a_hit_in_a_slower_tier_is_promoted_and_first_writes_once() {
    let dir = tmpdir("promote");
    let disk = Arc::new(DiskTier::open(&dir, 1 << 20).unwrap());
    let host = Arc::new(HostTier::new(1 << 20));
    let both = PageStore::new(
        vec![host.clone() as Arc<dyn Tier>, disk.clone() as Arc<dyn Tier>],
        Some(SECRET),
        &facts("m"),
        WritePolicy::First,
    )
    .unwrap();
    let disk_only = store(&disk, "m", SECRET);
    let p = page(9);
    assert_eq!(disk_only.put_many(&["k"], &[&p], "t"), [true]);
    assert_eq!(host.used_bytes(), 0);
    assert_eq!(both.exists_prefix(&["k"], "t"), 1);
    let mut buf = vec![0u8; PAGE];
    assert_eq!(both.get_into(&["k"], &mut [&mut buf[..]], "t"), [true]);
    assert_eq!(buf, p);
    assert!(host.used_bytes() > 0, "promoted into the host tier");
    assert_eq!(
        both.counters().promoted.load(Ordering::Relaxed),
        1,
        "one promotion"
    );
    // `first`: a new page goes to the host tier only.
    assert_eq!(both.put_many(&["k2"], &[&p], "t"), [true]);
    assert_eq!(disk_only.exists_prefix(&["k2"], "t"), 0);
    // A page of the wrong length is not stored.
    assert_eq!(both.put_many(&["k3"], &[&p[..10]], "t"), [false]);
    let _ = fs::remove_dir_all(dir);
}
