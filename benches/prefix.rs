//! Criterion benches of prefix caching: eviction with a million cached blocks, hashing +
//! matching a 32k-token prompt, and a partial match among 100 and 40k root children.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvrs::unstable::PoolCore;
use kvrs::{DType, Device, HashKind, KvLayout, PagedShape, PrefixConfig};

const BS: usize = 16;

/// A pool whose `blocks` blocks all hold one cached, unreferenced prompt.
fn cached_pool(blocks: usize, hash: HashKind) -> (PoolCore, Vec<u32>) {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 1,
        v_head_dim: 1,
        block_size: BS,
        num_blocks: blocks,
        layout: KvLayout::Nhd,
    };
    let cfg = PrefixConfig {
        hash,
        seed: 0,
        partial_hits: true,
        events: false,
    };
    let mut pool = PoolCore::new(shape, DType::F16, Device::Cpu, Some(cfg)).unwrap();
    let tokens: Vec<u32> = (0..(blocks * BS) as u32)
        .map(|i| i.wrapping_mul(2654435761) % 128_000)
        .collect();
    let id = pool.new_sequence_with(&tokens, b"", b"");
    // Reserved positions are the holder's (a kernel would write them); committing them
    // caches every block.
    pool.reserve(&[id], &[tokens.len() as i64]).unwrap();
    pool.advance(id, tokens.len() as i64, None).unwrap();
    pool.free_sequence(id).unwrap();
    (pool, tokens)
}

fn eviction(c: &mut Criterion) {
    let mut group = c.benchmark_group("evict_1m_cached_blocks");
    group.sample_size(10);
    group.throughput(Throughput::Elements(1 << 20));
    group.bench_function("evict_all", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (mut pool, _) = cached_pool(1 << 20, HashKind::Xxh3);
                let t = Instant::now();
                assert_eq!(pool.evict_all(), 1 << 20);
                total += t.elapsed();
            }
            total
        })
    });
    group.finish();
}

fn matching(c: &mut Criterion) {
    let mut group = c.benchmark_group("match_prefix_32k_tokens");
    group.throughput(Throughput::Elements(32768));
    for hash in [HashKind::Blake3, HashKind::Xxh3] {
        let (pool, mut tokens) = cached_pool(2048, hash);
        tokens.push(1);
        group.bench_function(hash.to_string(), |b| {
            b.iter(|| assert_eq!(pool.match_prefix(&tokens, b"", b""), 32768))
        });
    }
    group.finish();
}

/// A pool caching `n` one-block prompts, each a child of the root (they differ in their
/// first token), filled as a server fills it: the prompt's ids, `reserve`, `advance`.
fn root_children(n: usize) -> (PoolCore, Vec<u32>) {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 1,
        v_head_dim: 1,
        block_size: BS,
        num_blocks: n + 8,
        layout: KvLayout::Nhd,
    };
    let cfg = PrefixConfig {
        hash: HashKind::Blake3,
        seed: 0,
        partial_hits: true,
        events: false,
    };
    let mut pool = PoolCore::new(shape, DType::F16, Device::Cpu, Some(cfg)).unwrap();
    let prompt = |i: usize| -> Vec<u32> {
        std::iter::once(1_000_000 + i as u32)
            .chain(1..BS as u32)
            .collect()
    };
    for i in 0..n {
        let id = pool.new_sequence_with(&prompt(i), b"", b"");
        pool.reserve(&[id], &[BS as i64]).unwrap();
        pool.advance(id, BS as i64, None).unwrap();
        pool.free_sequence(id).unwrap();
    }
    let mut partial = prompt(n / 2)[..BS / 2].to_vec();
    partial.extend(500..500 + 2 * BS as u32);
    (pool, partial)
}

fn partial_matching(c: &mut Criterion) {
    let mut group = c.benchmark_group("partial_match_among_root_children");
    for n in [100, 40_000] {
        let (pool, partial) = root_children(n);
        group.bench_function(n.to_string(), |b| {
            b.iter(|| assert_eq!(pool.match_prefix(&partial, b"", b""), BS / 2))
        });
    }
    group.finish();
}

/// The MAC of one tier payload (sealing on write-back, checking on load), for the block
/// of `benches/bench_tiers.py`'s model: 16 tokens x 8 layers x 2 KV heads x 32, float32
/// K and V (64 KiB), and for a 1 MiB block.
fn payload_mac(c: &mut Criterion) {
    use kvrs::unstable::payload::{self, BlockMeta, PayloadShape, TierKey};
    let mut group = c.benchmark_group("tier_payload_mac");
    for (name, tensor_bytes) in [("64KiB", 16 * 2 * 2 * 32 * 4), ("1MiB", 1 << 17)] {
        let shape = PayloadShape {
            block_size: 16,
            tensors: 8,
            tensor_bytes,
            scale_bytes: 0,
        };
        let fp = payload::fingerprint([("bench", "1")]);
        let mac = TierKey::new(Some(b"bench-secret-of-the-pools"))
            .config(&fp)
            .namespace(7);
        let meta = BlockMeta {
            key: 9,
            parent: 7,
            root: 7,
            first: true,
        };
        let tokens: Vec<u32> = (0..16).collect();
        let mut p = payload::begin(&fp, &shape, &meta, &tokens);
        group.throughput(Throughput::Bytes(p.len() as u64));
        group.bench_function(format!("seal/{name}"), |b| {
            b.iter(|| payload::seal(&mut p, &mac))
        });
        group.bench_function(format!("check/{name}"), |b| {
            b.iter(|| payload::decode(&p, &fp, &shape, 9, &mac).expect("sealed"))
        });
    }
    group.finish();
}

criterion_group!(benches, eviction, matching, partial_matching, payload_mac);
criterion_main!(benches);
