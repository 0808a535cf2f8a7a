//! [`RedisTier`] against stand-in servers (a thread on a loopback listener) that
//! misbehave: a reply trickled byte by byte, a short `MGET` reply, a huge bulk length;
//! and cluster stand-ins (a redirection loop, a slow node).

use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redis::Value;

use super::RedisTier;
use crate::tier::Tier;

/// A stand-in server: accepts one connection and hands it to `serve` with a reader of
/// the client's commands; the commands' names come back on the channel.
fn stand_in(
    serve: impl FnOnce(&mut TcpStream, &mut dyn FnMut() -> Option<Vec<Vec<u8>>>) + Send + 'static,
) -> (String, mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}/0", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut reader = BufReader::new(s.try_clone().unwrap());
        let mut parser = redis::Parser::new();
        let mut next = move || {
            let Ok(Value::Array(args)) = parser.parse_value(&mut reader) else {
                return None;
            };
            let args: Vec<Vec<u8>> = args
                .into_iter()
                .filter_map(|a| match a {
                    Value::BulkString(b) => Some(b),
                    _ => None,
                })
                .collect();
            tx.send(String::from_utf8_lossy(&args[0]).to_uppercase())
                .ok();
            Some(args)
        };
        serve(&mut s, &mut next);
    });
    (url, rx)
}

fn tier(url: &str, timeout_ms: u64) -> RedisTier {
    RedisTier::new(
        url,
        Duration::from_millis(timeout_ms),
        None,
        4,
        Duration::from_secs(5),
    )
    .unwrap()
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("k{i}")).collect()
}

fn errors(t: &RedisTier) -> u64 {
    t.counters().snapshot()[6].1
}

#[test]
fn a_trickled_reply_is_bounded_by_the_timeout_not_by_each_read() {
    let (url, _) = stand_in(|s, next| {
        next().unwrap();
        for b in b"*2\r\n$3\r\nabc\r\n$3\r\nabc\r\n" {
            if s.write_all(&[*b]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
    });
    let t = tier(&url, 200);
    let t0 = Instant::now();
    let got = t.get_many(&keys(2), 0..=100);
    let took = t0.elapsed();
    assert_eq!(got, vec![None, None]);
    assert!(took < Duration::from_millis(350), "{took:?}");
    assert_eq!(errors(&t), 1);
    // Marked down: the next request is skipped at once, and counted.
    let t0 = Instant::now();
    assert_eq!(t.get_many(&keys(2), 0..=100), vec![None, None]);
    assert!(t0.elapsed() < Duration::from_millis(20));
    assert_eq!(errors(&t), 2);
}

#[test]
fn a_short_mget_reply_is_an_error_and_every_key_misses() {
    let (url, commands) = stand_in(|s, next| {
        let args = next().unwrap();
        assert_eq!(args.len(), 4); // MGET k0 k1 k2
        s.write_all(b"*2\r\n$3\r\nabc\r\n$3\r\nabc\r\n").unwrap();
        while next().is_some() {
            s.write_all(b":1\r\n").unwrap();
        }
    });
    let t = tier(&url, 2000);
    assert_eq!(t.get_many(&keys(3), 0..=100), vec![None, None, None]);
    assert_eq!(errors(&t), 1);
    assert_eq!(t.counters().snapshot()[3], ("rejected", 0));
    drop(t);
    let seen: Vec<String> = commands.iter().collect();
    assert_eq!(seen, ["MGET"]);
}

#[test]
fn values_of_other_sizes_are_rejected_and_a_full_reply_is_served() {
    let (url, _) = stand_in(|s, next| {
        next().unwrap();
        s.write_all(b"*3\r\n$3\r\nabc\r\n$-1\r\n$5\r\nabcde\r\n")
            .unwrap();
        next();
    });
    let t = tier(&url, 2000);
    let got = t.get_many(&keys(3), 3..=3);
    assert_eq!(got, vec![Some(b"abc".to_vec()), None, None]);
    assert_eq!(errors(&t), 0);
    assert_eq!(t.counters().snapshot()[3], ("rejected", 1));
}

#[test]
fn a_huge_bulk_length_is_refused_without_reading_it() {
    let (url, _) = stand_in(|s, next| {
        next().unwrap();
        s.write_all(b"*1\r\n$1000000000\r\n").unwrap();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..4 {
            if s.write_all(&zeros).is_err() {
                return;
            }
        }
        thread::sleep(Duration::from_secs(3));
    });
    let t = tier(&url, 2000);
    let t0 = Instant::now();
    assert_eq!(t.get_many(&keys(1), 0..=1000), vec![None]);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(errors(&t), 1);
}

#[test]
fn a_new_connection_logs_in_within_the_request() {
    let (url, commands) = stand_in(|s, next| {
        assert_eq!(
            next().unwrap(),
            [b"AUTH".to_vec(), b"u".to_vec(), b"pw".to_vec()]
        );
        assert_eq!(next().unwrap(), [b"SELECT".to_vec(), b"3".to_vec()]);
        next().unwrap();
        s.write_all(b"+OK\r\n+OK\r\n*1\r\n$-1\r\n").unwrap();
        next();
    });
    let url = url.replace("redis://", "redis://u:pw@").replace("/0", "/3");
    let t = tier(&url, 2000);
    assert_eq!(t.get_many(&keys(1), 0..=10), vec![None]);
    assert_eq!(errors(&t), 0);
    assert!(!format!("{t:?}").contains("pw@"));
    assert!(t.url().starts_with("redis://u:***@127.0.0.1:") && t.url().ends_with("/3"));
    drop(t);
    let seen: Vec<String> = commands.iter().collect();
    assert_eq!(seen, ["AUTH", "SELECT", "MGET"]);
}

#[test]
fn passwords_stay_out_of_names_urls_and_errors() {
    let t = tier("redis://user:s3cret@127.0.0.1:1/2", 100);
    assert_eq!(t.url(), "redis://user:***@127.0.0.1:1/2");
    assert_eq!(t.name(), "redis://127.0.0.1:1/2");
    assert!(!format!("{t:?}").contains("s3cret"));
    let t = tier("redis://:s3cret@127.0.0.1:1/0", 100);
    assert_eq!(t.url(), "redis://:***@127.0.0.1:1/0");
    for bad in [
        "redis://user:s3cret@127.0.0.1:notaport/0",
        "redis://user:s3cret@127.0.0.1:1/notadb",
        "http://user:s3cret@example.com",
    ] {
        let e = RedisTier::new(bad, Duration::from_secs(1), None, 1, Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("url") && !e.contains("s3cret"), "{e}");
    }
}

#[test]
fn a_server_that_is_down_is_probed_by_one_caller_at_a_time() {
    // Nothing listens on port 1: each probe fails at once; while marked down, skipped.
    let t = RedisTier::new(
        "redis://127.0.0.1:1/0",
        Duration::from_millis(100),
        None,
        1,
        Duration::from_millis(50),
    )
    .unwrap();
    assert_eq!(t.put_many(&[("k".into(), vec![1u8].into())]), vec![false]);
    assert_eq!(t.get_many(&keys(1), 0..=1), vec![None]);
    assert_eq!(errors(&t), 2);
    thread::sleep(Duration::from_millis(60));
    assert_eq!(t.drop_prefix("k"), 0);
    assert_eq!(errors(&t), 3);
}

#[test]
fn cluster_seeds_are_checked_and_their_passwords_never_shown() {
    let t = RedisTier::cluster(
        &[
            "redis://u:s3cret@127.0.0.1:7000",
            "redis://u:s3cret@127.0.0.1:7001/0",
        ],
        Duration::from_secs(1),
        None,
        1,
        Duration::from_secs(1),
    )
    .unwrap();
    assert!(t.is_cluster());
    assert_eq!(t.name(), "redis-cluster://127.0.0.1:7000,127.0.0.1:7001");
    assert_eq!(
        t.url(),
        "redis://u:***@127.0.0.1:7000/0,redis://u:***@127.0.0.1:7001/0"
    );
    assert!(!format!("{t:?}").contains("s3cret"));
    for bad in [
        &[][..],
        &["redis://u:s3cret@127.0.0.1:7000/2"],
        &["redis+unix:///tmp/r.sock?pass=s3cret"],
        &["redis://127.0.0.1:7000", "http://u:s3cret@x"],
    ] {
        let e = RedisTier::cluster(bad, Duration::from_secs(1), None, 1, Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("url") && !e.contains("s3cret"), "{e}");
    }
}

#[test]
fn a_cluster_nobody_answers_for_misses_within_the_timeout() {
    // Nothing listens on port 1: no slot map, every key misses, counted; at once.
    let t = RedisTier::cluster(
        &["redis://127.0.0.1:1"],
        Duration::from_millis(200),
        None,
        1,
        Duration::from_millis(50),
    )
    .unwrap();
    let t0 = Instant::now();
    assert_eq!(t.get_many(&keys(3), 0..=10), vec![None, None, None]);
    assert_eq!(t.put_many(&[("k".into(), vec![1u8].into())]), vec![false]);
    assert_eq!(t.drop_prefix("k"), 0);
    assert!(t0.elapsed() < Duration::from_millis(300));
    assert!(errors(&t) >= 3);
}

/// A stand-in cluster of one node: it answers `CLUSTER SLOTS` with every slot its own,
/// then hands each later command to `answer` (with its own port); the commands' names
/// come back on the channel.
fn cluster_stand_in(
    answer: impl Fn(&[Vec<u8>], u16) -> Vec<u8> + Send + 'static,
) -> (String, mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let tx = tx.clone();
            let mut reader = BufReader::new(s.try_clone().unwrap());
            let mut parser = redis::Parser::new();
            while let Ok(Value::Array(args)) = parser.parse_value(&mut reader) {
                let args: Vec<Vec<u8>> = args
                    .into_iter()
                    .filter_map(|a| match a {
                        Value::BulkString(b) => Some(b),
                        _ => None,
                    })
                    .collect();
                tx.send(String::from_utf8_lossy(&args[0]).to_uppercase())
                    .ok();
                let out = if args[0].eq_ignore_ascii_case(b"CLUSTER") {
                    format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{port}\r\n")
                        .into_bytes()
                } else {
                    answer(&args, port)
                };
                if s.write_all(&out).is_err() {
                    break;
                }
            }
        }
    });
    (format!("redis://127.0.0.1:{port}"), rx)
}

fn cluster_tier(url: &str, timeout_ms: u64) -> RedisTier {
    RedisTier::cluster(
        &[url],
        Duration::from_millis(timeout_ms),
        None,
        4,
        Duration::from_secs(5),
    )
    .unwrap()
}

#[test]
fn a_cluster_key_redirected_twice_misses_without_looping() {
    let (url, commands) = cluster_stand_in(|args, port| {
        let slot = super::slots::key_slot(&args[1]);
        format!("-MOVED {slot} 127.0.0.1:{port}\r\n").into_bytes()
    });
    let t = cluster_tier(&url, 2000);
    let t0 = Instant::now();
    assert_eq!(t.get_many(&keys(3), 0..=10), vec![None, None, None]);
    assert!(t0.elapsed() < Duration::from_millis(500));
    drop(t);
    thread::sleep(Duration::from_millis(50));
    let seen: Vec<String> = commands.try_iter().collect();
    // The map, the keys, the keys once more after MOVED: then misses.
    assert_eq!(seen, ["CLUSTER", "GET", "GET", "GET", "GET", "GET", "GET"]);
}

#[test]
fn a_slow_cluster_node_is_bounded_by_the_timeout() {
    let (url, _) = cluster_stand_in(|args, _| {
        if args[1] == b"k0" {
            thread::sleep(Duration::from_millis(400));
        }
        b"$3\r\nabc\r\n".to_vec()
    });
    let t = cluster_tier(&url, 200);
    let t0 = Instant::now();
    assert_eq!(t.get_many(&keys(2), 0..=10), vec![None, None]);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(350), "{took:?}");
    assert!(errors(&t) >= 1);
}

/// The bytes that reach a stand-in's socket within `quiet` of silence.
fn read_quiet(s: &mut TcpStream, quiet: Duration) -> Vec<u8> {
    use std::io::Read;
    s.set_read_timeout(Some(quiet)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// How many `MGET` commands `bytes` hold.
fn mgets(bytes: &[u8]) -> usize {
    bytes.windows(4).filter(|w| w == b"MGET").count()
}

/// A lookup sends its `MGET`s two at a time (then one more per reply), and hands each
/// reply's payloads on before the last reply arrives.
#[test]
fn a_lookup_streams_its_mgets_two_at_a_time() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}/0", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let quiet = Duration::from_millis(150);
        let mut seen = vec![mgets(&read_quiet(&mut s, quiet))];
        s.write_all(b"*2\r\n$3\r\nab0\r\n$3\r\nab1\r\n").unwrap();
        seen.push(mgets(&read_quiet(&mut s, quiet)));
        // The first reply was handed on while this one was still due.
        let handed: Vec<usize> = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        s.write_all(b"*2\r\n$3\r\nab2\r\n$-1\r\n").unwrap();
        s.write_all(b"*1\r\n$3\r\nab4\r\n").unwrap();
        (seen, handed)
    });
    let t = tier(&url, 5000);
    let mut batches = Vec::new();
    // Payloads of up to 512 KiB: two keys per MGET.
    t.get_each(&keys(5), 3..=(512 << 10), &mut |batch| {
        let idx: Vec<usize> = batch.iter().map(|(i, _)| *i).collect();
        if batches.is_empty() {
            tx.send(idx.clone()).unwrap();
        }
        for (i, p) in &batch {
            assert_eq!(p, format!("ab{i}").as_bytes());
        }
        batches.push(idx);
    });
    let (seen, handed) = server.join().unwrap();
    assert_eq!(seen, [2, 1]);
    assert_eq!(handed, [0, 1]);
    assert_eq!(batches, [vec![0, 1], vec![2], vec![4]]);
    assert_eq!(errors(&t), 0);
}

/// A short reply midway through a lookup's stream keeps what earlier replies brought;
/// the rest misses, one error is counted and nothing is rejected (deleted).
#[test]
fn a_short_reply_midway_keeps_the_earlier_replies() {
    let (url, _) = stand_in(|s, next| {
        next().unwrap();
        next().unwrap();
        s.write_all(b"*2\r\n$3\r\nab0\r\n$3\r\nab1\r\n").unwrap();
        next().unwrap();
        s.write_all(b"*1\r\n$3\r\nab2\r\n").unwrap();
        while next().is_some() {}
    });
    let t = tier(&url, 2000);
    let mut got = Vec::new();
    t.get_each(&keys(6), 3..=(512 << 10), &mut |batch| got.extend(batch));
    let ab = |i: usize| (i, format!("ab{i}").into_bytes());
    assert_eq!(got, vec![ab(0), ab(1)]);
    assert_eq!(errors(&t), 1);
    assert_eq!(t.counters().snapshot()[3], ("rejected", 0));
}

#[test]
fn parts_are_stored_as_one_value_each_with_their_ttl() {
    let (tx, rx) = mpsc::channel();
    let (url, _) = stand_in(move |s, next| {
        for _ in 0..5 {
            let Some(args) = next() else { return };
            tx.send(args).unwrap();
            s.write_all(b"+OK\r\n").unwrap();
        }
    });
    let t = RedisTier::new(
        &url,
        Duration::from_secs(5),
        Some(60),
        4,
        Duration::from_secs(5),
    )
    .unwrap();
    let page: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let heads: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 112]).collect();
    let mac = [9u8; 32];
    let ks = keys(3);
    let items: Vec<(&str, crate::tier::Parts<'_>)> = ks
        .iter()
        .zip(&heads)
        .map(|(k, h)| (k.as_str(), [&h[..], &page[..], &mac[..]]))
        .collect();
    assert_eq!(t.put_parts(&items), [true; 3]);
    for (k, h) in ks.iter().zip(&heads) {
        let args = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let value = [&h[..], &page, &mac].concat();
        let want: Vec<&[u8]> = vec![b"SET", k.as_bytes(), &value, b"EX", b"60"];
        assert_eq!(args, want);
    }
    let stats = t.counters().snapshot();
    assert_eq!(stats[4], ("stores", 3));
    assert_eq!(stats[5], ("store_bytes", 3 * (112 + 300_000 + 32)));
    // Sealed: each value is its parts and the trailer computed from them.
    let seal = |parts: &[&[u8]]| {
        let mut h = blake3::Hasher::new();
        parts.iter().for_each(|p| {
            h.update(p);
        });
        *h.finalize().as_bytes()
    };
    let sealing: Vec<(&str, [&[u8]; 2])> = ks[..2]
        .iter()
        .zip(&heads)
        .map(|(k, h)| (k.as_str(), [&h[..], &page[..]]))
        .collect();
    assert_eq!(t.put_sealing(&sealing, &seal), [true; 2]);
    for (k, h) in ks.iter().zip(&heads).take(2) {
        let args = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let value = [&h[..], &page, &seal(&[h, &page])].concat();
        let want: Vec<&[u8]> = vec![b"SET", k.as_bytes(), &value, b"EX", b"60"];
        assert_eq!(args, want);
    }
}
