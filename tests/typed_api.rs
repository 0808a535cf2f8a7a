//! Property tests of the crate-root Rust API against simple references.
//!
//! `KvCache`: random stores, appends, commits, rollbacks and block injections, checked
//! after every step against a model of every layer's K/V (`keys_for`, `values_for`,
//! `extract_block`, lengths). `BlockPool`: prompts sharing beginnings are prefilled,
//! decoded, forked, truncated and freed with prefix caching on and a small pool; as in a
//! real model the K/V at position `p` is a function of tokens `..=p`, so every live
//! sequence's `read` must equal that function of its tokens, whatever was shared.

use half::{bf16, f16};
use kvrs::{BlockPool, Element, KvCache, KvError, PoolConfig, SeqId};
use proptest::prelude::*;

const L: usize = 2;
const H: usize = 2;
const D: usize = 3;
const MAX: usize = 12;

/// Every stored element of a `KvCache`: `[layer][kv][head][pos * D + d]`, and lengths.
#[derive(Clone, Debug)]
struct Model {
    data: Vec<[Vec<Vec<f32>>; 2]>,
    layer_len: Vec<usize>,
    seq_len: usize,
}

impl Model {
    fn new() -> Self {
        let side = || vec![vec![0.0; MAX * D]; H];
        Model {
            data: (0..L).map(|_| [side(), side()]).collect(),
            layer_len: vec![0; L],
            seq_len: 0,
        }
    }

    /// A store at `pos` of `layer`: zero what it brings in, then write the vector.
    fn store(&mut self, kv: usize, layer: usize, head: usize, pos: usize, x: &[f32]) {
        let held = self.layer_len[layer];
        if pos >= held {
            for side in &mut self.data[layer] {
                for h in side.iter_mut() {
                    h[held * D..(pos + 1) * D].fill(0.0);
                }
            }
            self.layer_len[layer] = pos + 1;
        }
        self.data[layer][kv][head][pos * D..(pos + 1) * D].copy_from_slice(x);
    }
}

#[derive(Clone, Debug)]
enum CacheOp {
    Store {
        kv: usize,
        layer: usize,
        head: usize,
        pos: usize,
        x: f32,
    },
    Append {
        layer: usize,
        n: usize,
        x: f32,
    },
    Advance {
        n: usize,
    },
    Truncate {
        n: usize,
    },
    Inject {
        layer: usize,
        start: usize,
        size: usize,
        x: f32,
    },
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    let x = (-8i32..8).prop_map(|v| v as f32 * 0.5);
    prop_oneof![
        (0..2usize, 0..L, 0..H, 0..MAX + 2, x.clone()).prop_map(|(kv, layer, head, pos, x)| {
            CacheOp::Store {
                kv,
                layer,
                head,
                pos,
                x,
            }
        }),
        (0..L, 0..4usize, x.clone()).prop_map(|(layer, n, x)| CacheOp::Append { layer, n, x }),
        (0..3usize).prop_map(|n| CacheOp::Advance { n }),
        (0..MAX + 1).prop_map(|n| CacheOp::Truncate { n }),
        (0..L + 1, 0..MAX + 1, 1..5usize, x).prop_map(|(layer, start, size, x)| CacheOp::Inject {
            layer,
            start,
            size,
            x
        }),
    ]
}

/// Applies `op` to the cache and the model; the model changes only when the cache
/// accepts, and the cache must refuse exactly what the model says is invalid.
fn apply(c: &mut KvCache<f32>, m: &mut Model, op: &CacheOp) {
    match *op {
        CacheOp::Store {
            kv,
            layer,
            head,
            pos,
            x,
        } => {
            let v: Vec<f32> = (0..D).map(|d| x + d as f32).collect();
            let r = if kv == 0 {
                c.try_store_key(layer, head, pos, &v)
            } else {
                c.try_store_value(layer, head, pos, &v)
            };
            assert_eq!(r.is_ok(), pos < MAX, "{r:?}");
            if r.is_ok() {
                m.store(kv, layer, head, pos, &v);
            }
        }
        CacheOp::Append { layer, n, x } => {
            let k: Vec<f32> = (0..n * H * D).map(|i| x + i as f32).collect();
            let v: Vec<f32> = k.iter().map(|a| -a).collect();
            let at = m.layer_len[layer];
            let r = c.append(layer, &k, &v);
            if at + n > MAX {
                assert!(matches!(r, Err(KvError::CacheFull { .. })), "{r:?}");
                return;
            }
            assert_eq!(r, Ok(at));
            for t in 0..n {
                for h in 0..H {
                    let src = (t * H + h) * D;
                    let dst = (at + t) * D;
                    m.data[layer][0][h][dst..dst + D].copy_from_slice(&k[src..src + D]);
                    m.data[layer][1][h][dst..dst + D].copy_from_slice(&v[src..src + D]);
                }
            }
            m.layer_len[layer] = at + n;
        }
        CacheOp::Advance { n } => {
            let ok = m.layer_len.iter().all(|&l| l >= m.seq_len + n);
            let r = c.advance_by(n);
            assert_eq!(r.is_ok(), ok, "{r:?}");
            if ok {
                m.seq_len += n;
            }
        }
        CacheOp::Truncate { n } => {
            c.truncate(n).unwrap();
            if n < m.seq_len {
                m.seq_len = n;
                m.layer_len.fill(n);
            }
        }
        CacheOp::Inject {
            layer,
            start,
            size,
            x,
        } => {
            let keys: Vec<f32> = (0..H * size * D).map(|i| x * i as f32).collect();
            let values: Vec<f32> = keys.iter().map(|a| a + 1.0).collect();
            let r = c.try_inject_block(layer, start, size, &keys, &values);
            let ok = layer < L && start < MAX;
            assert_eq!(r.is_ok(), ok, "{r:?}");
            if ok {
                let inside = size.min(MAX - start);
                for h in 0..H {
                    for p in 0..inside {
                        let src = (h * size + p) * D;
                        let dst = (start + p) * D;
                        m.data[layer][0][h][dst..dst + D].copy_from_slice(&keys[src..src + D]);
                        m.data[layer][1][h][dst..dst + D].copy_from_slice(&values[src..src + D]);
                    }
                }
            }
        }
    }
}

fn check(c: &KvCache<f32>, m: &Model) {
    assert_eq!(c.seq_len(), m.seq_len);
    for layer in 0..L {
        assert_eq!(c.layer_len(layer), m.layer_len[layer]);
        for head in 0..H {
            assert_eq!(c.keys_for(layer, head, MAX), &m.data[layer][0][head][..]);
            assert_eq!(c.values_for(layer, head, MAX), &m.data[layer][1][head][..]);
        }
        let (k, v) = c.extract_block(layer, 0, MAX);
        assert_eq!(k, m.data[layer][0].concat());
        assert_eq!(v, m.data[layer][1].concat());
    }
}

/// The K (or V, `kv = 1`) of every head at `pos` after `tokens[..=pos]`.
fn kv_of(tokens: &[u32], pos: usize, layer: usize, kv: usize) -> Vec<f32> {
    let mut h: u64 = 0xcbf29ce484222325;
    for &t in &tokens[..=pos] {
        h = (h ^ t as u64).wrapping_mul(0x100000001b3);
    }
    (0..H * D)
        .map(|i| {
            ((h.wrapping_add((layer * 31 + kv * 7 + i) as u64)
                .wrapping_mul(0x9e3779b97f4a7c15)
                >> 58) as f32)
                - 32.0
        })
        .collect()
}

/// `[n, H, D]` keys or values of positions `start..start + n`.
fn kv_span(tokens: &[u32], start: usize, n: usize, layer: usize, kv: usize) -> Vec<f32> {
    (start..start + n)
        .flat_map(|p| kv_of(tokens, p, layer, kv))
        .collect()
}

#[derive(Clone, Debug)]
enum PoolOp {
    /// A prompt: `shared` tokens of a common preamble, then `suffix` from a vocabulary of 2.
    Start {
        shared: usize,
        suffix: usize,
        seed: u32,
    },
    Decode {
        seq: usize,
        token: u32,
    },
    Fork {
        seq: usize,
    },
    Truncate {
        seq: usize,
        n: usize,
    },
    Free {
        seq: usize,
    },
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        (0..12usize, 1..6usize, any::<u32>()).prop_map(|(shared, suffix, seed)| PoolOp::Start {
            shared,
            suffix,
            seed
        }),
        (0..8usize, 0..3u32).prop_map(|(seq, token)| PoolOp::Decode { seq, token }),
        (0..8usize).prop_map(|seq| PoolOp::Fork { seq }),
        (0..8usize, 0..16usize).prop_map(|(seq, n)| PoolOp::Truncate { seq, n }),
        (0..8usize).prop_map(|seq| PoolOp::Free { seq }),
    ]
}

/// Writes positions `from..tokens.len()` of every layer and commits them; on a full
/// pool, leaves the sequence as it was and says so.
fn fill(pool: &mut BlockPool<f32>, seq: SeqId, tokens: &[u32], from: usize) -> bool {
    let n = tokens.len() - from;
    for layer in 0..L {
        let r = pool.append(
            seq,
            layer,
            &kv_span(tokens, from, n, layer, 0),
            &kv_span(tokens, from, n, layer, 1),
        );
        if let Err(e) = r {
            assert!(matches!(e, KvError::CacheFull { .. }), "{e}");
            pool.truncate(seq, from).unwrap();
            return false;
        }
    }
    pool.advance_tokens(seq, &tokens[from..]).unwrap();
    true
}

fn run_pool(ops: &[PoolOp]) {
    let mut pool =
        BlockPool::<f32>::new(PoolConfig::new(L, H, D, 4, 12).prefix_caching(3)).unwrap();
    let mut live: Vec<(SeqId, Vec<u32>)> = Vec::new();
    for op in ops {
        match *op {
            PoolOp::Start {
                shared,
                suffix,
                seed,
            } => {
                let mut tokens: Vec<u32> = (1..=shared as u32).collect();
                tokens.extend((0..suffix as u32).map(|i| 100 + (seed.rotate_left(i) & 1)));
                let seq = pool.new_sequence_with_prompt(&tokens);
                let cached = pool.num_cached_tokens(seq).unwrap();
                assert_eq!(pool.seq_len(seq).unwrap(), cached);
                assert!(cached < tokens.len());
                if fill(&mut pool, seq, &tokens, cached) {
                    live.push((seq, tokens));
                } else {
                    pool.free(seq).unwrap();
                }
            }
            PoolOp::Decode { seq, token } if seq < live.len() => {
                let (id, mut tokens) = live[seq].clone();
                tokens.push(token);
                if fill(&mut pool, id, &tokens, tokens.len() - 1) {
                    live[seq].1 = tokens;
                }
            }
            PoolOp::Fork { seq } if seq < live.len() => {
                let child = pool.fork(live[seq].0).unwrap();
                live.push((child, live[seq].1.clone()));
            }
            PoolOp::Truncate { seq, n } if seq < live.len() => {
                pool.truncate(live[seq].0, n).unwrap();
                live[seq].1.truncate(n);
            }
            PoolOp::Free { seq } if seq < live.len() => {
                pool.free(live.remove(seq).0).unwrap();
            }
            _ => {}
        }
        pool.core().check_invariants().unwrap();
        for (id, tokens) in &live {
            assert_eq!(pool.seq_len(*id).unwrap(), tokens.len());
            for layer in 0..L {
                let (k, v) = pool.read(*id, layer).unwrap();
                let n = tokens.len();
                // `read` is head-major: [H, n, D]; the reference is [n, H, D].
                let head_major = |x: Vec<f32>| -> Vec<f32> {
                    (0..H)
                        .flat_map(|h| (0..n).flat_map(move |p| (0..D).map(move |d| (p, h, d))))
                        .map(|(p, h, d)| x[(p * H + h) * D + d])
                        .collect()
                };
                assert_eq!(k, head_major(kv_span(tokens, 0, n, layer, 0)));
                assert_eq!(v, head_major(kv_span(tokens, 0, n, layer, 1)));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn kv_cache_matches_its_model(ops in prop::collection::vec(cache_op(), 1..40)) {
        let mut c = KvCache::<f32>::new(L, H, D, MAX);
        let mut m = Model::new();
        for op in &ops {
            apply(&mut c, &mut m, op);
            check(&c, &m);
        }
    }

    #[test]
    fn pool_kv_is_a_function_of_the_token_prefix(ops in prop::collection::vec(pool_op(), 1..40)) {
        run_pool(&ops);
    }
}

/// Stores of `T` read back bit for bit, and attention over one position returns its value.
fn half_round_trip<T: Element + PartialEq + std::fmt::Debug>(from: fn(f32) -> T) {
    let mut c = KvCache::<T>::zeros(1, 1, 4, 8);
    let v: Vec<T> = [0.5f32, -1.25, 3.0, 1e-3].into_iter().map(from).collect();
    c.store_key(0, 0, 0, &v);
    c.store_value(0, 0, 0, &v);
    c.advance();
    assert_eq!(c.keys_for(0, 0, 1), &v[..]);
    let q: Vec<T> = vec![from(1.0); 8];
    let mut out = vec![T::default(); 8];
    c.attention(0, 2, &q, &mut out).unwrap();
    assert_eq!(out, [v.clone(), v].concat());
}

#[test]
fn f16_and_bf16_caches_store_their_own_elements() {
    half_round_trip(f16::from_f32);
    half_round_trip(bf16::from_f32);
    let c = KvCache::<f16>::zeros(2, 2, 8, 4);
    assert_eq!(c.memory_bytes(), 2 * 2 * 2 * 4 * 8 * 2);
}

#[test]
fn bad_sizes_and_shapes_are_errors_not_panics() {
    assert!(matches!(
        KvCache::<f32>::try_new(0, 1, 1, 1),
        Err(KvError::InvalidArgument {
            name: "num_layers",
            ..
        })
    ));
    assert!(matches!(
        KvCache::<bf16>::try_zeros(1, 0, 1, 1),
        Err(KvError::InvalidArgument {
            name: "num_kv_heads",
            ..
        })
    ));
    assert!(BlockPool::<f32>::new(PoolConfig::new(1, 1, 4, 0, 8)).is_err());
    let mut pool = BlockPool::<f32>::new(PoolConfig::new(1, 2, 4, 4, 2)).unwrap();
    let s = pool.new_sequence();
    let err = pool.append(s, 0, &[0.0; 7], &[0.0; 7]).unwrap_err();
    assert!(matches!(err, KvError::Shape { name: "k", .. }), "{err}");
    let err = pool.append(s, 0, &[0.0; 9 * 8], &[0.0; 9 * 8]).unwrap_err();
    assert!(matches!(err, KvError::CacheFull { .. }), "{err}");
    assert_eq!(pool.layer_span(s, 0).unwrap(), 0..0);
    assert!(matches!(
        pool.layer_span(s, 1),
        Err(KvError::OutOfRange { name: "layer", .. })
    ));
    pool.free(s).unwrap();
    assert!(pool.seq_len(s).is_err());
}

#[test]
fn a_handle_of_another_pool_is_refused_everywhere() {
    let mut p = BlockPool::<f32>::new(PoolConfig::new(1, 1, 2, 4, 4)).unwrap();
    let mut q = BlockPool::<f32>::new(PoolConfig::new(1, 1, 2, 4, 4)).unwrap();
    let mine = p.new_sequence();
    let theirs = q.new_sequence();
    // Both are sequence 0 of their pool; p must not take q's handle for its own.
    assert_eq!((mine.number(), theirs.number()), (0, 0));
    assert_ne!(mine, theirs);
    let another = |e: KvError| {
        assert!(
            matches!(&e, KvError::InvalidArgument { name: "seq", reason, .. } if reason.contains("another pool")),
            "{e}"
        )
    };
    another(p.append(theirs, 0, &[1.0; 2], &[1.0; 2]).unwrap_err());
    another(p.seq_len(theirs).unwrap_err());
    another(p.fork(theirs).unwrap_err());
    another(p.free(theirs).unwrap_err());
    assert_eq!(p.seq_len(mine).unwrap(), 0);
    assert_eq!(q.layer_span(theirs, 0).unwrap(), 0..0);
}

#[test]
fn huge_sizes_are_errors_not_aborts_or_panics() {
    let invalid = |r: Result<(), KvError>, arg: &str| match r {
        Err(KvError::InvalidArgument { name, .. }) if name == arg => {}
        other => panic!("expected an invalid {arg}, got {other:?}"),
    };
    // Used to panic in KvScales::unit ("capacity overflow"): a block's size wrapped.
    invalid(
        BlockPool::<f32>::new(PoolConfig::new(1, 1 << 62, 4, 1, 1)).map(drop),
        "num_kv_heads",
    );
    invalid(
        BlockPool::<f32>::new(PoolConfig::new(1, 1, 1 << 62, 2, 1)).map(drop),
        "head_dim",
    );
    invalid(
        KvCache::<f32>::try_new(1 << 32, 1, 1, 1).map(drop),
        "num_layers",
    );
    invalid(
        KvCache::<f32>::try_new(1, 1, 1, usize::MAX / 2).map(drop),
        "max_seq_len",
    );
    let tier: std::sync::Arc<dyn kvrs::tier::Tier> =
        std::sync::Arc::new(kvrs::tier::HostTier::new(1 << 20));
    for queue in [0, (1 << 20) + 1, 1 << 62] {
        let mut config = PoolConfig::new(1, 1, 4, 4, 4)
            .prefix_caching(1)
            .tiers(vec![tier.clone()], "m");
        config.tiers.as_mut().unwrap().options.queue = queue;
        invalid(BlockPool::<f32>::new(config).map(drop), "tier_queue");
    }
}

/// Runs the test `name` of this binary again in a child process under an address-space
/// limit of `mib` MiB and checks that it passed; true in the parent (which then
/// returns), false in the child (which then runs the test's body).
fn in_limited_child(name: &str, mib: u64) -> bool {
    if std::env::var_os("KVRS_LIMITED_CHILD").is_some() {
        return false;
    }
    let child = std::process::Command::new("sh")
        .args([
            "-c",
            "ulimit -v $2 && exec \"$0\" --exact \"$1\" --test-threads=1",
        ])
        .arg(std::env::current_exe().unwrap())
        .arg(name)
        .arg((mib * 1024).to_string())
        .env("KVRS_LIMITED_CHILD", "1")
        .output()
        .unwrap();
    assert!(
        child.status.success(),
        "{name} under a {mib} MiB limit: {}\n{}{}",
        child.status,
        String::from_utf8_lossy(&child.stdout),
        String::from_utf8_lossy(&child.stderr)
    );
    true
}

#[test]
fn allocations_the_host_refuses_are_errors_not_aborts() {
    if in_limited_child("allocations_the_host_refuses_are_errors_not_aborts", 1024) {
        return;
    }
    let oom = |r: Result<(), KvError>, what: &str| match r {
        Err(KvError::OutOfMemory { what: w, .. }) if w.starts_with(what) => {}
        other => panic!("expected OutOfMemory for {what}, got {other:?}"),
    };
    // PoolConfig::new(1, 1, 1, 1, 700_000_000) under 8 GiB aborted ("memory allocation of
    // 2800000000 bytes failed": the block counts). Scaled down: the bookkeeping (800 MB
    // of counts, as much of generations and of free list) does not fit.
    let config = PoolConfig::new(1, 1, 1, 1, 200_000_000).storage(kvrs::DType::F8E4M3);
    oom(BlockPool::<f32>::new(config).map(drop), "the block ");
    oom(
        KvCache::<f32>::try_new(1, 1 << 40, 1, 1).map(drop),
        "the K/V storage (host memory)",
    );
}

/// What a pool storing `dtype` returns for `x` (rows of `d`): int8 rows quantized with
/// their own scale, fp8 elements divided by `scale`, rounded, multiplied back.
fn stored(x: &[f32], d: usize, dtype: kvrs::DType, scale: f32) -> Vec<f32> {
    use kvrs::unstable::{dequantize_row_i8, quantize_row_i8};
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks(d).zip(out.chunks_mut(d)) {
        match dtype.fp8() {
            Some(f) => {
                let mut codes = vec![0u8; d];
                f.quantize_row(&mut codes, row, scale);
                f.dequantize_row(o, &codes, scale);
            }
            None => {
                let mut codes = vec![0i8; d];
                let s = quantize_row_i8(&mut codes, row);
                dequantize_row_i8(o, &codes, s);
            }
        }
    }
    out
}

#[test]
fn eight_bit_pools_take_and_return_floats_and_attend_over_what_they_hold() {
    use kvrs::{DType, KvScales};
    let (heads, dim, n) = (2, 8, 11);
    let x: Vec<f32> = (0..n * heads * dim)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.13)
        .collect();
    for dtype in [DType::F8E4M3, DType::F8E5M2, DType::I8] {
        let scale = if dtype == DType::I8 { 1.0 } else { 0.25 };
        let mut config = PoolConfig::new(1, heads, dim, 4, 8).storage(dtype);
        if dtype != DType::I8 {
            config = config.scales(KvScales::new(1, heads, &[scale], &[scale]).unwrap());
        }
        let mut pool = BlockPool::<f32>::new(config).unwrap();
        let seq = pool.new_sequence();
        pool.append(seq, 0, &x, &x).unwrap();
        pool.advance(seq, n).unwrap();
        let (keys, _) = pool.read(seq, 0).unwrap();
        // `read` is [heads, n, dim]; the reference goes token by token ([n, heads, dim]).
        let want = stored(&x, dim, dtype, scale);
        for t in 0..n {
            for h in 0..heads {
                let got = &keys[(h * n + t) * dim..][..dim];
                assert_eq!(
                    got,
                    &want[(t * heads + h) * dim..][..dim],
                    "{dtype} token {t} head {h}"
                );
            }
        }
        // Attention over the 8-bit blocks equals attention over their values in f32.
        let mut exact = BlockPool::<f32>::new(PoolConfig::new(1, heads, dim, 4, 8)).unwrap();
        let twin = exact.new_sequence();
        exact.append(twin, 0, &want, &want).unwrap();
        exact.advance(twin, n).unwrap();
        let q: Vec<f32> = (0..4 * dim).map(|i| (i as f32 * 0.7).sin()).collect();
        let (mut a, mut b) = (vec![0f32; 4 * dim], vec![0f32; 4 * dim]);
        pool.attention(seq, 0, 4, &q, &mut a).unwrap();
        exact.attention(twin, 0, 4, &q, &mut b).unwrap();
        for (p, r) in a.iter().zip(&b) {
            assert!((p - r).abs() < 1e-5, "{dtype}: {p} vs {r}");
        }
        assert_eq!(
            pool.bytes_per_block(),
            2 * 4 * heads * dtype.bytes_per_vector(dim)
        );
    }
    // Scales belong to fp8 pools only.
    let config = PoolConfig::new(1, 2, 8, 4, 8)
        .storage(DType::I8)
        .scales(KvScales::new(1, 2, &[0.5], &[1.0]).unwrap());
    assert!(matches!(
        BlockPool::<f32>::new(config),
        Err(KvError::InvalidArgument { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A latent (MLA) pool: keys and values of different sizes read back as written
    /// through forks, and latent attention matches a direct softmax over `[c, r]`.
    #[test]
    fn latent_pools_store_and_attend_like_a_reference(
        rank in 1usize..9,
        rope in 1usize..5,
        lens in proptest::collection::vec(1usize..7, 1..4),
        heads in 1usize..4,
        seed in 0u32..1000,
    ) {
        let mut pool = BlockPool::<f32>::new(PoolConfig::new(1, 1, rank, 3, 32).v_head_dim(rope)).unwrap();
        let seq = pool.new_sequence();
        let val = |i: usize| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 17) as f32 / 8.0 - 1.0;
        let (mut ck, mut cr) = (Vec::new(), Vec::new());
        let mut forked = None;
        for (step, &n) in lens.iter().enumerate() {
            let k: Vec<f32> = (0..n * rank).map(|i| val(ck.len() + i)).collect();
            let v: Vec<f32> = (0..n * rope).map(|i| val(1000 + cr.len() + i)).collect();
            pool.append(seq, 0, &k, &v).unwrap();
            pool.advance(seq, n).unwrap();
            ck.extend(k);
            cr.extend(v);
            if step == 0 {
                forked = Some((pool.fork(seq).unwrap(), ck.clone(), cr.clone()));
            }
        }
        let (keys, values) = pool.read(seq, 0).unwrap();
        prop_assert_eq!(&keys, &ck);
        prop_assert_eq!(&values, &cr);
        let (f, fk, fv) = forked.unwrap();
        prop_assert_eq!(pool.read(f, 0).unwrap(), (fk, fv));
        let t = ck.len() / rank;
        let q: Vec<f32> = (0..heads * (rank + rope)).map(|i| val(5000 + i)).collect();
        let mut out = vec![0f32; heads * rank];
        let opts = kvrs::AttnOptions { scale: Some(0.5), latent: true, ..Default::default() };
        pool.attention_with(seq, 0, heads, &q, &mut out, &opts).unwrap();
        for h in 0..heads {
            let qh = &q[h * (rank + rope)..(h + 1) * (rank + rope)];
            let s: Vec<f64> = (0..t)
                .map(|p| {
                    let c = &ck[p * rank..(p + 1) * rank];
                    let r = &cr[p * rope..(p + 1) * rope];
                    let dot: f32 = qh[..rank].iter().zip(c).map(|(a, b)| a * b).sum::<f32>()
                        + qh[rank..].iter().zip(r).map(|(a, b)| a * b).sum::<f32>();
                    0.5 * dot as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for d in 0..rank {
                let want: f64 = (0..t).map(|p| w[p] / z * ck[p * rank + d] as f64).sum();
                prop_assert!((out[h * rank + d] as f64 - want).abs() < 1e-4, "{} vs {}", out[h * rank + d], want);
            }
        }
    }
}

/// Elements per int8 scale of keys of `d` and values of `dv` elements.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Fails unless `got` is `want` quantized to int8 with a scale per `unit` elements
/// (`amax / 127` of each chunk): within half a step of each chunk's scale.
fn within_int8(got: &[f32], want: &[f32], unit: usize) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for (g, w) in got.chunks(unit).zip(want.chunks(unit)) {
        let step = w.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
        for (a, b) in g.iter().zip(w) {
            prop_assert!(
                (a - b).abs() <= step / 2.0 + 1e-6,
                "{} vs {} (step {})",
                a,
                b,
                step
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// An int8 pool of keys and values of different head sizes (a scale per
    /// gcd(head_dim, v_head_dim) elements): reads are the writes within int8 error,
    /// forks keep their blocks through copy-on-write, and attention (plain and latent)
    /// equals attention in f32 over the values the pool holds.
    #[test]
    fn int8_pools_of_two_head_sizes_match_a_float_reference(
        dims in prop_oneof![Just((8usize, 4usize)), Just((4, 8)), Just((12, 8)), Just((6, 4)), Just((3, 2)), Just((8, 8))],
        heads in 1usize..3,
        lens in proptest::collection::vec(1usize..6, 1..4),
        q_heads in 1usize..3,
        seed in 0u32..1000,
    ) {
        let (d, dv) = dims;
        let unit = gcd(d, dv);
        let config = PoolConfig::new(1, heads, d, 3, 32).v_head_dim(dv).storage(kvrs::DType::I8);
        let mut pool = BlockPool::<f32>::new(config).unwrap();
        prop_assert_eq!(pool.bytes_per_block(), 3 * heads * (d + dv + 4 * (d + dv) / unit));
        let seq = pool.new_sequence();
        let val = |i: usize| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 29) as f32 / 7.0 - 2.0;
        // Token-major [n, heads, dim] inputs; `read` gives [heads, n, dim].
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        let mut forked = None;
        for (step, &n) in lens.iter().enumerate() {
            let k: Vec<f32> = (0..n * heads * d).map(|i| val(ks.len() + i)).collect();
            let v: Vec<f32> = (0..n * heads * dv).map(|i| val(7000 + vs.len() + i)).collect();
            pool.append(seq, 0, &k, &v).unwrap();
            pool.advance(seq, n).unwrap();
            ks.extend(k);
            vs.extend(v);
            if step == 0 {
                let f = pool.fork(seq).unwrap();
                forked = Some((f, pool.read(f, 0).unwrap()));
            }
        }
        let t = ks.len() / (heads * d);
        let to_heads = |x: &[f32], dim: usize| -> Vec<f32> {
            (0..heads)
                .flat_map(|h| (0..t).flat_map(move |p| x[(p * heads + h) * dim..][..dim].to_vec()))
                .collect()
        };
        let (keys, values) = pool.read(seq, 0).unwrap();
        within_int8(&keys, &to_heads(&ks, d), unit)?;
        within_int8(&values, &to_heads(&vs, dv), unit)?;
        // The fork still holds what it held (copy-on-write of the shared last block),
        // and writing to it leaves the original alone.
        let (f, before) = forked.unwrap();
        prop_assert_eq!(&pool.read(f, 0).unwrap(), &before);
        let fk: Vec<f32> = (0..heads * d).map(|i| val(90000 + i) * 3.0).collect();
        let fv: Vec<f32> = (0..heads * dv).map(|i| val(95000 + i) * 3.0).collect();
        pool.append(f, 0, &fk, &fv).unwrap();
        pool.advance(f, 1).unwrap();
        prop_assert_eq!(&pool.read(seq, 0).unwrap(), &(keys.clone(), values.clone()));
        // The twin in f32 of what the int8 pool holds, token-major again.
        let to_tokens = |x: &[f32], dim: usize| -> Vec<f32> {
            (0..t)
                .flat_map(|p| (0..heads).flat_map(move |h| x[(h * t + p) * dim..][..dim].to_vec()))
                .collect()
        };
        let mut exact = BlockPool::<f32>::new(PoolConfig::new(1, heads, d, 3, 32).v_head_dim(dv)).unwrap();
        let twin = exact.new_sequence();
        exact.append(twin, 0, &to_tokens(&keys, d), &to_tokens(&values, dv)).unwrap();
        exact.advance(twin, t).unwrap();
        let qh = heads * q_heads;
        let q: Vec<f32> = (0..qh * d).map(|i| val(50000 + i)).collect();
        let (mut a, mut b) = (vec![0f32; qh * dv], vec![0f32; qh * dv]);
        pool.attention(seq, 0, qh, &q, &mut a).unwrap();
        exact.attention(twin, 0, qh, &q, &mut b).unwrap();
        for (x, y) in a.iter().zip(&b) {
            prop_assert!((x - y).abs() < 1e-4, "{} vs {}", x, y);
        }
        if heads == 1 {
            // Latent attention: queries of d + dv, outputs of d.
            let q: Vec<f32> = (0..q_heads * (d + dv)).map(|i| val(60000 + i)).collect();
            let (mut a, mut b) = (vec![0f32; q_heads * d], vec![0f32; q_heads * d]);
            let opts = kvrs::AttnOptions { scale: Some(0.5), latent: true, ..Default::default() };
            pool.attention_with(seq, 0, q_heads, &q, &mut a, &opts).unwrap();
            exact.attention_with(twin, 0, q_heads, &q, &mut b, &opts).unwrap();
            for (x, y) in a.iter().zip(&b) {
                prop_assert!((x - y).abs() < 1e-4, "{} vs {}", x, y);
            }
        }
    }
}
