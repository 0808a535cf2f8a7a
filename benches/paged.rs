//! Criterion benches of the paged pool: block allocation and release, and a decode
//! scheduling step for 256 sequences (reserve one token each, then the page table).

use criterion::{criterion_group, criterion_main, Criterion};
use kvrs::unstable::{BlockAllocator, PoolCore};
use kvrs::{DType, Device, KvLayout, PagedShape};

fn alloc_free(c: &mut Criterion) {
    let mut a = BlockAllocator::new(1 << 20).unwrap();
    // Keep half the pool in use so the free list is neither full nor empty.
    let held: Vec<_> = (0..1 << 19).map(|_| a.allocate().unwrap()).collect();
    c.bench_function("block_alloc_free", |b| {
        b.iter(|| {
            let x = a.allocate().unwrap();
            if a.release(std::hint::black_box(x)) {
                a.push_free(x);
            }
        })
    });
    drop(held);
}

fn schedule(c: &mut Criterion) {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 8,
        v_head_dim: 8,
        block_size: 16,
        num_blocks: 256 * 64,
        layout: KvLayout::Nhd,
    };
    c.bench_function("decode_schedule_256_seqs", |b| {
        b.iter_batched_ref(
            || {
                let mut pool = PoolCore::new(shape, DType::F16, Device::Cpu, None).unwrap();
                let ids: Vec<_> = (0..256).map(|_| pool.new_sequence()).collect();
                pool.reserve(&ids, &[100; 256]).unwrap();
                (pool, ids)
            },
            |(pool, ids)| {
                for _ in 0..64 {
                    let slots = pool.reserve(ids, &[1; 256]).unwrap();
                    let table = pool.page_table(ids, 0).unwrap();
                    std::hint::black_box((slots, table));
                }
            },
            criterion::BatchSize::LargeInput,
        )
    });
}

criterion_group!(benches, alloc_free, schedule);
criterion_main!(benches);
