use super::usage::Usage;
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

fn key_path(dir: &Path, block: &str) -> PathBuf {
    dir.join("aa").join("01").join(format!("{block}.kvb"))
}

fn put(t: &DiskTier, key: &str, payload: Vec<u8>) -> bool {
    t.put_many(&[(key.to_string(), Arc::new(payload))])[0]
}

fn get(t: &DiskTier, key: &str, sizes: RangeInclusive<usize>) -> Option<Vec<u8>> {
    t.get_many(&[key.to_string()], sizes).pop().unwrap()
}

fn rejected(t: &DiskTier) -> u64 {
    t.counters().rejected.load(Ordering::Relaxed)
}

/// The lookup, on another thread: panics if it has not returned within 5 s (the old
/// code blocked forever opening or reading a FIFO).
fn get_within_5s(t: &Arc<DiskTier>, key: &str, fifo: &Path) -> Option<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (t2, key) = (Arc::clone(t), key.to_string());
    std::thread::spawn(move || tx.send(get(&t2, &key, 0..=usize::MAX)));
    match rx.recv_timeout(std::time::Duration::from_secs(5)) {
        Ok(got) => got,
        Err(_) => {
            // Unblock the stuck reader before failing.
            let _ = fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(fifo);
            panic!("a lookup of a FIFO blocked");
        }
    }
}

use std::os::unix::fs::OpenOptionsExt;

fn mkfifo(path: &Path) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

#[test]
fn a_fifo_at_a_block_path_is_refused_at_once_and_replaced_by_a_store() {
    let dir = tmpdir("fifo");
    let t = Arc::new(DiskTier::open(&dir, 10_000).unwrap());
    let fifo = key_path(&dir, "10");
    mkfifo(&fifo);
    // A presence check looks without opening: no wait, and a FIFO is not a page.
    assert_eq!(
        t.contains_many(&["kvrs:aa:01:10".into()], 0..=usize::MAX),
        [false]
    );
    assert_eq!(get_within_5s(&t, "kvrs:aa:01:10", &fifo), None);
    assert_eq!(rejected(&t), 1);
    assert!(
        put(&t, "kvrs:aa:01:10", vec![7; 100]),
        "a store replaces the FIFO"
    );
    assert_eq!(get(&t, "kvrs:aa:01:10", 100..=100), Some(vec![7; 100]));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_symlink_at_a_block_path_is_refused() {
    let dir = tmpdir("symlink");
    let t = DiskTier::open(&dir, 10_000).unwrap();
    let target = dir.join("outside");
    fs::write(&target, [1u8; 100]).unwrap();
    fs::create_dir_all(key_path(&dir, "10").parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(&target, key_path(&dir, "10")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", key_path(&dir, "11")).unwrap();
    let names = ["kvrs:aa:01:10".to_string(), "kvrs:aa:01:11".to_string()];
    assert_eq!(t.contains_many(&names, 0..=usize::MAX), [false, false]);
    assert_eq!(get(&t, "kvrs:aa:01:10", 100..=100), None);
    assert_eq!(get(&t, "kvrs:aa:01:11", 0..=usize::MAX), None);
    assert_eq!(rejected(&t), 2);
    // A store replaces the link, not what it points to.
    assert!(put(&t, "kvrs:aa:01:10", vec![2; 100]));
    assert_eq!(fs::read(&target).unwrap(), [1u8; 100]);
    assert_eq!(get(&t, "kvrs:aa:01:10", 100..=100), Some(vec![2; 100]));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_file_of_another_length_is_refused_unread_and_one_that_changes_is_a_miss() {
    let dir = tmpdir("length");
    let t = DiskTier::open(&dir, 10_000).unwrap();
    let path = key_path(&dir, "10");
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    // 64 GiB, sparse: read whole it would exhaust the memory.
    fs::File::create(&path).unwrap().set_len(64 << 30).unwrap();
    let start = std::time::Instant::now();
    assert_eq!(get(&t, "kvrs:aa:01:10", 416..=416), None);
    assert!(start.elapsed().as_millis() < 1000);
    assert_eq!(rejected(&t), 1);
    // A file that shrinks or grows after its fstat is a miss.
    for new_len in [50, 150] {
        fs::write(&path, [3u8; 100]).unwrap();
        let Opened::File(mut f, len) = open_regular(&path).unwrap() else {
            panic!("a regular file")
        };
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(new_len)
            .unwrap();
        assert_eq!(read_exact_len(&mut f, len).unwrap(), None);
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_read_marks_the_file_used_without_opening_it_for_writing() {
    let dir = tmpdir("touch");
    let t = DiskTier::open(&dir, 10_000).unwrap();
    assert!(put(&t, "kvrs:aa:01:10", vec![5; 100]));
    let path = key_path(&dir, "10");
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(old)
        .unwrap();
    assert!(get(&t, "kvrs:aa:01:10", 100..=100).is_some());
    assert!(fs::metadata(&path).unwrap().modified().unwrap() > old);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_planted_file_is_replaced_by_the_genuine_block() {
    let dir = tmpdir("planted");
    let t = DiskTier::open(&dir, 10_000).unwrap();
    let path = key_path(&dir, "10");
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    for planted in [vec![6u8; 100], vec![6u8; 40], vec![6u8; 300]] {
        fs::write(&path, &planted).unwrap();
        assert!(put(&t, "kvrs:aa:01:10", vec![1; 100]));
        assert_eq!(fs::read(&path).unwrap(), vec![1; 100]);
    }
    assert_eq!(t.counters().stores.load(Ordering::Relaxed), 3);
    // The same payload is only marked used.
    assert!(put(&t, "kvrs:aa:01:10", vec![1; 100]));
    assert_eq!(t.counters().stores.load(Ordering::Relaxed), 3);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn two_tiers_on_one_directory_keep_its_bound_together() {
    let dir = tmpdir("shared");
    let a = DiskTier::open(&dir, 10_000).unwrap();
    let b = DiskTier::open(&dir, 10_000).unwrap();
    for i in 0..40 {
        let t = if i % 2 == 0 { &a } else { &b };
        assert!(put(t, &format!("kvrs:aa:01:{i:x}"), vec![i as u8; 1000]));
        assert!(a.used_bytes() <= 10_000, "{} after {i}", a.used_bytes());
    }
    // At once, from two threads, each with its own tier.
    let dir2 = dir.clone();
    std::thread::scope(|s| {
        for n in 0..2u32 {
            let dir = &dir2;
            s.spawn(move || {
                let t = DiskTier::open(dir, 10_000).unwrap();
                for i in 0..60 {
                    assert!(put(&t, &format!("kvrs:bb:{n}:{i:x}"), vec![1; 700]));
                }
            });
        }
    });
    assert!(a.used_bytes() <= 10_000);
    assert_eq!(Usage::read(&dir).unwrap().total, a.used_bytes(), "no drift");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn discard_and_drop_prefix_keep_the_shared_total() {
    let dir = tmpdir("removals");
    let t = DiskTier::open(&dir, 100_000).unwrap();
    for i in 0..10 {
        assert!(put(&t, &format!("kvrs:aa:0{}:{i:x}", i % 2), vec![1; 500]));
    }
    let total = || Usage::read(&dir).unwrap().total;
    assert_eq!(total(), 5000);
    t.discard("kvrs:aa:00:0");
    assert_eq!((total(), t.used_bytes()), (4500, 4500));
    assert_eq!(t.drop_prefix("kvrs:aa:01:"), 5);
    assert_eq!((total(), t.used_bytes()), (2000, 2000));
    let _ = fs::remove_dir_all(&dir);
}

/// A temporary file, `age` old.
fn temp_file(dir: &Path, name: &str, len: usize, age: u64) -> PathBuf {
    let path = dir.join("aa").join("01").join(name);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(&path, vec![0u8; len]).unwrap();
    let when = std::time::SystemTime::now() - std::time::Duration::from_secs(age);
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(when)
        .unwrap();
    path
}

#[test]
fn dead_writers_temporary_files_are_swept_and_live_ones_counted() {
    let dir = tmpdir("temps");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let me = std::process::id();
    let killed = temp_file(&dir, &format!(".tmp-{dead}-3"), 500, 60);
    let ancient = temp_file(&dir, &format!(".tmp-{me}-99998"), 500, 3600);
    let live = temp_file(&dir, &format!(".tmp-{me}-99999"), 600, 0);
    let young = temp_file(&dir, &format!(".tmp-{dead}-4"), 100, 0);
    let t = DiskTier::open(&dir, 1000).unwrap();
    assert!(!killed.exists() && !ancient.exists(), "swept when opened");
    assert!(
        live.exists() && young.exists(),
        "a writer may still be at work"
    );
    assert_eq!(t.used_bytes(), 700, "temporary files count");
    fs::remove_file(&young).unwrap();
    for i in 0..4 {
        assert!(put(&t, &format!("kvrs:aa:01:{i:x}"), vec![1; 150]));
        assert!(t.used_bytes() <= 1000, "{}", t.used_bytes());
    }
    assert!(t.counters().evictions.load(Ordering::Relaxed) >= 1);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_lock_held_by_another_process_costs_one_bounded_wait_and_never_blocks_a_lookup() {
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};
    let dir = tmpdir("held-lock");
    let t = DiskTier::open(&dir, 1 << 20).unwrap();
    assert!(put(&t, "kvrs:aa:01:10", vec![1; 100]));
    // Anyone who can open the directory can hold its flock.
    let holder = fs::File::open(&dir).unwrap();
    // SAFETY: the descriptor is open for the call.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
    let t0 = Instant::now();
    assert!(
        !put(&t, "kvrs:aa:01:11", vec![2; 100]),
        "no store without the lock"
    );
    let first = t0.elapsed();
    assert!(first >= usage::LOCK_WAIT && first < usage::LOCK_WAIT + Duration::from_secs(1));
    let t1 = Instant::now();
    assert!(!put(&t, "kvrs:aa:01:12", vec![3; 100]));
    assert!(
        t1.elapsed() < Duration::from_millis(200),
        "one wait, not one per store"
    );
    // Lookups and discards never wait for it.
    let t2 = Instant::now();
    assert_eq!(get(&t, "kvrs:aa:01:10", 100..=100), Some(vec![1; 100]));
    t.discard("kvrs:aa:01:10");
    assert!(t2.elapsed() < Duration::from_millis(200));
    assert_eq!(get(&t, "kvrs:aa:01:10", 100..=100), None);
    drop(holder);
    assert!(
        put(&t, "kvrs:aa:01:13", vec![4; 100]),
        "back once the lock is free"
    );
    let _ = fs::remove_dir_all(&dir);
}

/// The names of the files under `dir`, recursively (temporary ones included).
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.file_name().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_write_that_fails_part_way_is_never_visible_and_gives_its_room_back() {
    let dir = tmpdir("torn");
    let t = DiskTier::open(&dir, 1 << 20).unwrap();
    assert!(put(&t, "kvrs:aa:01:10", vec![1; 1000]));
    let before = Usage::read(&dir).unwrap().total;
    // Writes in namespace 02 fail after their first part: in one batch with writes that
    // succeed, given as parts.
    inject::fail_writes_in(&dir.join("aa").join("02"), true);
    let (head, body, mac) = (vec![7u8; 112], vec![8u8; 5000], vec![9u8; 32]);
    let parts: Parts<'_> = [&head, &body, &mac];
    let keys = [
        "kvrs:aa:01:11",
        "kvrs:aa:02:12",
        "kvrs:aa:01:13",
        "kvrs:aa:02:10",
    ];
    let items: Vec<(&str, Parts<'_>)> = keys.iter().map(|&k| (k, parts)).collect();
    assert_eq!(t.put_parts(&items), [true, false, true, false]);
    let whole = [&head[..], &body, &mac].concat();
    for k in ["kvrs:aa:01:11", "kvrs:aa:01:13"] {
        assert_eq!(get(&t, k, 0..=usize::MAX).as_deref(), Some(&whole[..]));
    }
    // The failed ones: no file under the name, no temporary file left, the bytes
    // they reserved given back, each failure counted.
    for k in ["kvrs:aa:02:12", "kvrs:aa:02:10"] {
        assert_eq!(get(&t, k, 0..=usize::MAX), None);
    }
    assert!(!files_under(&dir).iter().any(|f| f.starts_with(TEMP_PREFIX)));
    assert!(!dir.join("aa/02/12.kvb").exists());
    assert_eq!(
        Usage::read(&dir).unwrap().total,
        before + 2 * whole.len() as u64
    );
    assert_eq!(t.counters().errors.load(Ordering::Relaxed), 2);
    assert!(t.counters().last_error().unwrap().contains("injected"));
    // A failed replacement leaves the payload that was there.
    inject::fail_writes_in(&dir.join("aa").join("01"), true);
    assert!(!put(&t, "kvrs:aa:01:10", vec![2; 1000]));
    assert_eq!(
        get(&t, "kvrs:aa:01:10", 0..=usize::MAX),
        Some(vec![1; 1000])
    );
    inject::fail_writes_in(&dir.join("aa").join("01"), false);
    inject::fail_writes_in(&dir.join("aa").join("02"), false);
    assert!(t.put_parts(&items[1..2])[0]);
    assert_eq!(get(&t, "kvrs:aa:02:12", 0..=usize::MAX), Some(whole));
    assert_eq!(t.used_bytes(), Usage::read(&dir).unwrap().total);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_batch_larger_than_the_bound_is_stored_in_rounds_evicting_as_single_stores_do() {
    let dir = tmpdir("rounds");
    let t = DiskTier::open(&dir, 1000).unwrap();
    let items: Vec<(String, Arc<Vec<u8>>)> = (0..5)
        .map(|i| (format!("kvrs:aa:01:{i:02}"), Arc::new(vec![i as u8; 400])))
        .collect();
    // Two fit at once: the third waits for them to be in place (evictable).
    assert_eq!(t.put_many(&items), [true; 5]);
    assert!(t.used_bytes() <= 1000);
    assert_eq!(get(&t, "kvrs:aa:01:04", 0..=usize::MAX), Some(vec![4; 400]));
    assert!(t.counters().evictions.load(Ordering::Relaxed) >= 3);
    // One larger than the bound is refused; the others of its batch are stored.
    let mixed = vec![
        ("kvrs:aa:01:10".to_string(), Arc::new(vec![1u8; 2000])),
        ("kvrs:aa:01:11".to_string(), Arc::new(vec![2u8; 300])),
    ];
    assert_eq!(t.put_many(&mixed), [false, true]);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_threads_reused_buffer_never_hands_out_a_previous_payload() {
    let dir = tmpdir("scratch");
    let t = DiskTier::open(&dir, 1 << 30).unwrap();
    let big = vec![0xAB; 200_000];
    assert!(put(&t, "kvrs:aa:01:10", big.clone()));
    assert!(put(&t, "kvrs:aa:01:11", vec![0xCD; 1000]));
    let seen = parking_lot::Mutex::new(Vec::new());
    let keys = ["kvrs:aa:01:10".to_string(), "kvrs:aa:01:11".to_string()];
    for sizes in [0..=usize::MAX, 1000..=1000] {
        t.read_each(&keys, sizes, &|i, p| seen.lock().push((i, p.to_vec())));
    }
    let mut seen = seen.into_inner();
    seen.sort();
    assert_eq!(
        seen,
        [(0, big), (1, vec![0xCD; 1000]), (1, vec![0xCD; 1000])]
    );
    // A file that shrinks or grows after its fstat is never handed out: not the bytes
    // read so far, nor what the buffer held before.
    let path = key_path(&dir, "12");
    for new_len in [500, 1500] {
        fs::write(&path, [3u8; 1000]).unwrap();
        let Opened::File(mut f, len) = open_regular(&path).unwrap() else {
            panic!("a regular file")
        };
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(new_len)
            .unwrap();
        let mut buf = vec![0xAB; 200_000];
        assert_eq!(read_exact_len_into(&mut f, len, &mut buf).unwrap(), None);
    }
    // Read whole, a file is exactly its bytes, whatever the buffer held.
    fs::write(&path, [3u8; 1000]).unwrap();
    let Opened::File(mut f, len) = open_regular(&path).unwrap() else {
        panic!("a regular file")
    };
    let mut buf = vec![0xAB; 200_000];
    assert_eq!(
        read_exact_len_into(&mut f, len, &mut buf).unwrap(),
        Some(&[3u8; 1000][..])
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn parts_are_written_as_their_concatenation() {
    let dir = tmpdir("writev");
    let path = dir.join("f");
    fs::create_dir_all(&dir).unwrap();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    for parts in [
        vec![&b"head"[..], &big[..], &b"tail"[..]],
        vec![&[][..], &b"x"[..], &[][..]],
        vec![&big[..17]],
    ] {
        let mut f = fs::File::create(&path).unwrap();
        file::write_parts(&mut f, &parts).unwrap();
        drop(f);
        assert_eq!(fs::read(&path).unwrap(), parts.concat());
        let Opened::File(mut f, len) = open_regular(&path).unwrap() else {
            panic!("a regular file")
        };
        assert!(holds(&mut f, len, &parts));
        let Opened::File(mut f, len) = open_regular(&path).unwrap() else {
            panic!("a regular file")
        };
        assert!(!holds(&mut f, len, &[&parts.concat()[1..], &b"!"[..]]));
    }
    let _ = fs::remove_dir_all(&dir);
}

/// A trailer for the tests: the first 32 bytes of BLAKE3 of the parts.
fn test_trailer(parts: &[&[u8]]) -> [u8; TRAILER] {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(p);
    }
    *h.finalize().as_bytes()
}

#[test]
fn sealed_payloads_are_written_with_their_trailer_computed_once_each() {
    let dir = tmpdir("sealing");
    let t = DiskTier::open(&dir, 1 << 20).unwrap();
    let sealed = std::sync::atomic::AtomicUsize::new(0);
    let seal = |parts: &[&[u8]]| {
        sealed.fetch_add(1, Ordering::Relaxed);
        test_trailer(parts)
    };
    let heads: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 112]).collect();
    let body: Vec<u8> = (0..70_000u32).map(|i| (i % 253) as u8).collect();
    let keys: Vec<String> = (0..6).map(|i| format!("kvrs:aa:01:{i:02}")).collect();
    let items: Vec<(&str, [&[u8]; 2])> = keys
        .iter()
        .zip(&heads)
        .map(|(k, h)| (k.as_str(), [&h[..], &body[..]]))
        .collect();
    assert_eq!(t.put_sealing(&items, &seal), [true; 6]);
    assert_eq!(sealed.load(Ordering::Relaxed), 6, "one trailer per payload");
    for (k, h) in keys.iter().zip(&heads) {
        let want = [&h[..], &body, &test_trailer(&[h, &body])].concat();
        assert_eq!(get(&t, k, 0..=usize::MAX), Some(want));
    }
    // The same payloads again are only marked used (each compared with its trailer).
    let stores = t.counters().stores.load(Ordering::Relaxed);
    assert_eq!(t.put_sealing(&items, &seal), [true; 6]);
    assert_eq!(t.counters().stores.load(Ordering::Relaxed), stores);
    assert_eq!(t.used_bytes(), Usage::read(&dir).unwrap().total);
    // A file of another length at a name is replaced without computing a trailer to
    // compare it with.
    fs::write(key_path(&dir, "00"), b"short").unwrap();
    sealed.store(0, Ordering::Relaxed);
    assert_eq!(t.put_sealing(&items[..1], &seal), [true]);
    assert_eq!(sealed.load(Ordering::Relaxed), 1);
    // A sealed write that fails part way is never visible and gives its room back.
    inject::fail_writes_in(&dir.join("aa").join("02"), true);
    let k2 = "kvrs:aa:02:01";
    assert_eq!(t.put_sealing(&[(k2, items[0].1)], &seal), [false]);
    assert_eq!(get(&t, k2, 0..=usize::MAX), None);
    inject::fail_writes_in(&dir.join("aa").join("02"), false);
    assert!(!files_under(&dir).iter().any(|f| f.starts_with(TEMP_PREFIX)));
    // (The replaced file is still counted until a rescan: over, never under.)
    assert!(t.used_bytes() <= Usage::read(&dir).unwrap().total);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_sealed_batch_past_the_bound_is_stored_in_rounds_and_the_total_stays_exact() {
    let dir = tmpdir("sealing-rounds");
    let len = 112 + 400 + TRAILER;
    let t = DiskTier::open(&dir, 3 * len as u64 + 10).unwrap();
    let (head, body) = (vec![1u8; 112], vec![2u8; 400]);
    let keys: Vec<String> = (0..10).map(|i| format!("kvrs:aa:01:{i:02}")).collect();
    let items: Vec<(&str, [&[u8]; 2])> = keys
        .iter()
        .map(|k| (k.as_str(), [&head[..], &body[..]]))
        .collect();
    assert_eq!(t.put_sealing(&items, &test_trailer), [true; 10]);
    assert!(t.used_bytes() <= t.max_bytes());
    assert_eq!(t.used_bytes(), Usage::read(&dir).unwrap().total);
    assert!(t.counters().evictions.load(Ordering::Relaxed) >= 7);
    let last = get(&t, &keys[9], 0..=usize::MAX).unwrap();
    assert_eq!(last.len(), len);
    assert!(!files_under(&dir).iter().any(|f| f.starts_with(TEMP_PREFIX)));
    let _ = fs::remove_dir_all(&dir);
}

/// Writes that fail part way, for the tests: a temporary file under a directory named
/// here gets its first part written, then an error.
pub(super) mod inject {
    use std::path::{Path, PathBuf};

    static FAILING: parking_lot::Mutex<Vec<PathBuf>> = parking_lot::Mutex::new(Vec::new());

    /// Whether the write of `tmp` fails.
    pub(in crate::tier::disk) fn write_fails(tmp: &Path) -> bool {
        FAILING.lock().iter().any(|d| tmp.starts_with(d))
    }

    /// Makes the writes of temporary files under `dir` fail (`false`: succeed again).
    pub(super) fn fail_writes_in(dir: &Path, fail: bool) {
        let mut f = FAILING.lock();
        f.retain(|d| d != dir);
        if fail {
            f.push(dir.to_path_buf());
        }
    }
}

#[test]
fn a_file_this_process_cannot_read_is_present_only_if_open_would_succeed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmpdir("unreadable");
    let t = DiskTier::open(&dir, 10_000).unwrap();
    assert!(put(&t, "kvrs:aa:01:10", vec![3; 100]));
    let path = key_path(&dir, "10");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o000)).unwrap();
    // Root reads it anyway; anyone else cannot, and must not be told it is there (every
    // read would fail and the page would never go away).
    let readable = fs::File::open(&path).is_ok();
    assert_eq!(
        t.contains_many(&["kvrs:aa:01:10".into()], 0..=usize::MAX),
        [readable]
    );
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        t.contains_many(&["kvrs:aa:01:10".into()], 0..=usize::MAX),
        [true]
    );
    let _ = fs::remove_dir_all(&dir);
}
