//! When a pool's cached blocks reach its tiers: write-through queues each block once, as
//! it becomes cached, and never again on eviction; write-back only on eviction;
//! write-through-selective at the hit threshold; a block loaded from the tiers is not
//! written back; closing stores what is cached, twice is harmless, and a closed pool's
//! later blocks are dropped (counted), never hang.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvrs::tier::{DiskTier, HostTier, Tier};
use kvrs::unstable::{PoolCore, TensorRef};
use kvrs::{
    DType, Device, HashKind, KvLayout, PagedShape, PrefixConfig, SeqId, TierOptions, WriteMode,
};

const BS: usize = 4;

fn pool(tier: Arc<dyn Tier>, mode: Option<WriteMode>) -> PoolCore {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 2,
        v_head_dim: 2,
        block_size: BS,
        num_blocks: 6,
        layout: KvLayout::Nhd,
    };
    let prefix = PrefixConfig {
        hash: HashKind::Xxh3,
        seed: 5,
        partial_hits: true,
        events: false,
    };
    let options = TierOptions {
        mode,
        ..TierOptions::default()
    };
    PoolCore::new(shape, DType::F32, Device::Cpu, Some(prefix))
        .unwrap()
        .with_tiers(vec![tier], "m", &options)
        .unwrap()
}

/// A sequence of `tokens`, computed and committed (its whole blocks cached).
fn run(p: &mut PoolCore, tokens: &[u32]) -> SeqId {
    let id = p.new_sequence_with(tokens, b"", b"");
    let start = p.seq(id).unwrap().seq_len;
    let n = tokens.len() - start;
    if n > 0 {
        let k: Vec<f32> = tokens[start..]
            .iter()
            .flat_map(|&t| [t as f32, -(t as f32)])
            .collect();
        let kt = TensorRef::from_f32(&k, &[n, 1, 2]).unwrap();
        p.append(id, 0, &kt, &kt).unwrap();
        p.advance(id, n as i64, None).unwrap();
    }
    id
}

fn stores(t: &HostTier) -> u64 {
    t.counters().stores.load(Ordering::Relaxed)
}

#[test]
fn write_through_stores_each_cached_block_once() {
    let tier = Arc::new(HostTier::new(1 << 20));
    let mut p = pool(tier.clone(), Some(WriteMode::Through));
    let prompt: Vec<u32> = (1..=9).collect(); // two whole blocks
    let id = run(&mut p, &prompt);
    p.flush_tiers();
    assert_eq!(stores(&tier), 2, "written as they became cached");
    p.free_sequence(id).unwrap();
    p.evict_all();
    p.flush_tiers();
    assert_eq!(stores(&tier), 2, "never written again on eviction");
    // A fresh pool loads them, and does not write them back.
    let mut q = pool(tier.clone(), Some(WriteMode::Through));
    let id = run(&mut q, &prompt);
    assert_eq!(q.seq(id).unwrap().num_cached_tokens, 8);
    q.free_sequence(id).unwrap();
    q.evict_all();
    q.flush_tiers();
    assert_eq!(stores(&tier), 2);
}

#[test]
fn write_back_stores_on_eviction_only() {
    let tier = Arc::new(HostTier::new(1 << 20));
    let mut p = pool(tier.clone(), Some(WriteMode::Back));
    let id = run(&mut p, &(1..=9).collect::<Vec<u32>>());
    p.flush_tiers();
    assert_eq!(stores(&tier), 0);
    p.free_sequence(id).unwrap();
    assert_eq!(p.evict_all(), 2);
    p.flush_tiers();
    assert_eq!(stores(&tier), 2);
}

#[test]
fn write_through_selective_stores_at_the_hit_threshold() {
    let tier = Arc::new(HostTier::new(1 << 20));
    let mut p = pool(tier.clone(), Some(WriteMode::ThroughSelective(2)));
    let prompt: Vec<u32> = (1..=9).collect();
    for (round, want) in [(0, 0), (1, 0), (2, 2), (3, 2)] {
        let id = run(&mut p, &prompt);
        p.flush_tiers();
        assert_eq!(stores(&tier), want, "after round {round}");
        p.free_sequence(id).unwrap();
    }
}

#[test]
fn the_default_writes_through_to_a_persistent_tier_only() {
    let dir = std::env::temp_dir().join(format!("kvrs-write-policy-{}", std::process::id()));
    let disk: Arc<dyn Tier> = Arc::new(DiskTier::open(&dir, 1 << 20).unwrap());
    assert_eq!(pool(disk, None).tier_write_mode(), Some(WriteMode::Through));
    let host: Arc<dyn Tier> = Arc::new(HostTier::new(1 << 20));
    assert_eq!(pool(host, None).tier_write_mode(), Some(WriteMode::Back));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn closing_stores_what_is_cached_and_twice_is_harmless() {
    let tier = Arc::new(HostTier::new(1 << 20));
    let mut p = pool(tier.clone(), Some(WriteMode::Back));
    run(&mut p, &(1..=9).collect::<Vec<u32>>());
    assert_eq!(p.close_tiers(), 2);
    assert_eq!(stores(&tier), 2, "written before close returned");
    assert_eq!(p.close_tiers(), 0);
    // Later blocks are dropped, counted, and nothing waits.
    let id = run(&mut p, &(20..=29).collect::<Vec<u32>>());
    p.free_sequence(id).unwrap();
    p.evict_all();
    p.flush_tiers();
    let ts = p.tiers().unwrap();
    assert_eq!(stores(&tier), 2);
    assert_eq!(ts.writer.counters().dropped.load(Ordering::Relaxed), 2);
}
