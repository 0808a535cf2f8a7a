//! Criterion benches of prefix caching: eviction with a million cached blocks, and
//! hashing + matching a 32k-token prompt.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvrs::paged::{KvLayout, PagedShape, PoolCore, PrefixConfig};
use kvrs::prefix::HashKind;
use kvrs::{DType, Device};

const BS: usize = 16;

/// A pool whose `blocks` blocks all hold one cached, unreferenced prompt.
fn cached_pool(blocks: usize, hash: HashKind) -> (PoolCore, Vec<u32>) {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 1,
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
    pool.set_seq_len(id, tokens.len() as i64).unwrap();
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

criterion_group!(benches, eviction, matching);
criterion_main!(benches);
