//! Recurrent state slots of a pool with state layers against a simple reference: every
//! live sequence's states equal what the reference recorded (zeros when started, a copy
//! at a fork, what was written since), slots are never shared, and room is counted.

use std::collections::BTreeMap;

use kvrs::unstable::{PoolCore, StateConfig, StateSpec, TensorMut, TensorRef};
use kvrs::{DType, Device, KvError, KvLayout, PagedShape, SeqId};
use proptest::prelude::*;

const LAYERS: usize = 2;
const SLOTS: usize = 4;
/// (name, elements, dtype) of each state.
const SPECS: [(&str, usize, DType); 2] = [("conv", 6, DType::BF16), ("recurrent", 8, DType::F32)];

#[derive(Clone, Debug)]
enum Op {
    New,
    Fork(usize),
    Free(usize),
    Write(usize, usize, usize, i8),
    Pack(Vec<usize>),
    CopyPrefix(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::New),
        2 => any::<usize>().prop_map(Op::Fork),
        2 => any::<usize>().prop_map(Op::Free),
        4 => (any::<usize>(), 0..LAYERS, 0..SPECS.len(), any::<i8>())
            .prop_map(|(i, l, s, v)| Op::Write(i, l, s, v)),
        1 => prop::collection::vec(any::<usize>(), 0..4).prop_map(Op::Pack),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::CopyPrefix(a, b)),
    ]
}

/// Each live sequence's states: [layer][state] -> values.
type Reference = BTreeMap<SeqId, Vec<Vec<Vec<f32>>>>;

fn pool(device: Device) -> PoolCore {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 4,
        v_head_dim: 4,
        block_size: 4,
        num_blocks: 8,
        layout: KvLayout::Nhd,
    };
    let config = StateConfig {
        layers: LAYERS,
        slots: SLOTS,
        checkpoints: 0,
        specs: SPECS
            .iter()
            .map(|&(name, n, dtype)| StateSpec {
                name: name.into(),
                dims: vec![n],
                dtype,
            })
            .collect(),
    };
    PoolCore::new(shape, DType::F32, device, None)
        .unwrap()
        .with_states(config)
        .unwrap()
}

fn zeros() -> Vec<Vec<Vec<f32>>> {
    vec![SPECS.iter().map(|&(_, n, _)| vec![0.0; n]).collect(); LAYERS]
}

fn read(pool: &PoolCore, id: SeqId, layer: usize, s: usize) -> Vec<f32> {
    let mut out = vec![0f32; SPECS[s].1];
    let mut t = TensorMut::from_f32_mut(&mut out, &[SPECS[s].1, 1, 1]).unwrap();
    pool.read_state(id, layer as i64, SPECS[s].0, &mut t)
        .unwrap();
    out
}

fn pick(live: &Reference, i: usize) -> Option<SeqId> {
    (!live.is_empty()).then(|| *live.keys().nth(i % live.len()).unwrap())
}

fn run(device: Device, ops: &[Op]) {
    let mut pool = pool(device);
    let mut live: Reference = BTreeMap::new();
    for op in ops {
        match op {
            Op::New => {
                if pool.check_state_room(1, String::new).is_ok() {
                    live.insert(pool.new_sequence(), zeros());
                } else {
                    assert_eq!(live.len(), SLOTS);
                }
            }
            Op::Fork(i) => {
                if let Some(src) = pick(&live, *i) {
                    match pool.fork(src) {
                        Ok(id) => {
                            live.insert(id, live[&src].clone());
                        }
                        Err(KvError::CacheFull { free: 0, .. }) => assert_eq!(live.len(), SLOTS),
                        Err(e) => panic!("fork: {e}"),
                    }
                }
            }
            Op::Free(i) => {
                if let Some(id) = pick(&live, *i) {
                    pool.free_sequence(id).unwrap();
                    live.remove(&id);
                }
            }
            Op::Write(i, layer, s, v) => {
                if let Some(id) = pick(&live, *i) {
                    let n = SPECS[*s].1;
                    // Small integers: exact in bfloat16 too.
                    let vals: Vec<f32> = (0..n).map(|j| f32::from(*v) + j as f32).collect();
                    let t = TensorRef::from_f32(&vals, &[n, 1, 1]).unwrap();
                    pool.write_state(id, *layer as i64, SPECS[*s].0, &t)
                        .unwrap();
                    live.get_mut(&id).unwrap()[*layer][*s] = vals;
                }
            }
            Op::Pack(picks) => {
                let mut ids: Vec<SeqId> = picks.iter().filter_map(|&i| pick(&live, i)).collect();
                ids.dedup();
                let mut seen = std::collections::BTreeSet::new();
                ids.retain(|id| seen.insert(*id));
                if !ids.is_empty() {
                    match pool.pack_states(&ids) {
                        Ok(first) => {
                            for (k, id) in ids.iter().enumerate() {
                                assert_eq!(
                                    pool.seq(*id).unwrap().state_slot,
                                    Some(first + k as u32)
                                );
                            }
                        }
                        Err(KvError::CacheFull { .. }) => {
                            // Only when every run of that length has a slot of another sequence.
                            let others: Vec<u32> = live
                                .keys()
                                .filter(|id| !ids.contains(id))
                                .map(|&id| pool.seq(id).unwrap().state_slot.unwrap())
                                .collect();
                            let n = ids.len() as u32;
                            assert!((0..=SLOTS as u32 - n)
                                .all(|f| others.iter().any(|&o| (f..f + n).contains(&o))));
                        }
                        Err(e) => panic!("pack_states: {e}"),
                    }
                }
            }
            Op::CopyPrefix(a, b) => {
                if let (Some(src), Some(dst)) = (pick(&live, *a), pick(&live, *b)) {
                    if src != dst {
                        // Every committed position (0 here): the state is copied.
                        pool.copy_prefix(src, dst, 0).unwrap();
                        live.insert(dst, live[&src].clone());
                    }
                }
            }
        }
        pool.check_invariants().unwrap();
        let stats = pool.stats().states.unwrap();
        assert_eq!(stats.free_slots, SLOTS - live.len());
        for (&id, states) in &live {
            for (layer, row) in states.iter().enumerate() {
                for (s, want) in row.iter().enumerate() {
                    assert_eq!(
                        &read(&pool, id, layer, s),
                        want,
                        "sequence {id} layer {layer} state {s}"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn state_slots_match_reference(ops in prop::collection::vec(op(), 1..60)) {
        run(Device::Cpu, &ops);
    }
}

// The same on the simulated CUDA device (`--features cuda-sim`): the states live in CUDA
// storages, zeroed, copied and moved by its kernels and copies.
#[cfg(feature = "cuda-sim")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    #[test]
    fn state_slots_on_cuda_match_reference(ops in prop::collection::vec(op(), 1..40)) {
        run(Device::Cuda(0), &ops);
    }
}

#[test]
fn state_pools_without_checkpoints_refuse_rollbacks_but_to_zero() {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 2,
        v_head_dim: 2,
        block_size: 2,
        num_blocks: 4,
        layout: KvLayout::Nhd,
    };
    let config = StateConfig {
        layers: 1,
        slots: 1,
        checkpoints: 0,
        specs: vec![StateSpec {
            name: "s".into(),
            dims: vec![3],
            dtype: DType::F32,
        }],
    };
    let prefix = kvrs::PrefixConfig {
        hash: kvrs::HashKind::Blake3,
        seed: 1,
        partial_hits: true,
        events: false,
    };
    let cached = PoolCore::new(shape, DType::F32, Device::Cpu, Some(prefix)).unwrap();
    assert!(matches!(
        cached.with_states(config.clone()),
        Err(KvError::InvalidArgument {
            name: "state_checkpoints",
            ..
        })
    ));
    let mut pool = PoolCore::new(shape, DType::F32, Device::Cpu, None)
        .unwrap()
        .with_states(config)
        .unwrap();
    let id = pool.new_sequence();
    let kv = [1f32, 2.0, 3.0, 4.0];
    let t = TensorRef::from_f32(&kv, &[2, 1, 2]).unwrap();
    pool.append(id, 0, &t, &t).unwrap();
    pool.advance(id, 2, None).unwrap();
    assert!(matches!(
        pool.truncate(id, 1),
        Err(KvError::NotSupported(_))
    ));
    assert!(matches!(
        pool.set_seq_len(id, 1),
        Err(KvError::NotSupported(_))
    ));
    assert!(matches!(
        pool.shift(id, 1, None, -1),
        Err(KvError::NotSupported(_))
    ));
    assert!(matches!(
        pool.remove(id, 0, Some(1)),
        Err(KvError::NotSupported(_))
    ));
    assert_eq!(pool.seq(id).unwrap().seq_len, 2);
    // One slot: a fork needs a second.
    assert!(matches!(
        pool.fork(id),
        Err(KvError::CacheFull {
            needed: 1,
            free: 0,
            capacity: 1,
            ..
        })
    ));
    // Back to position 0 the state is known: zeros.
    pool.write_state(
        id,
        0,
        "s",
        &TensorRef::from_f32(&[5.0; 3], &[3, 1, 1]).unwrap(),
    )
    .unwrap();
    pool.truncate(id, 0).unwrap();
    let mut st = [1f32; 3];
    pool.read_state(
        id,
        0,
        "s",
        &mut TensorMut::from_f32_mut(&mut st, &[3, 1, 1]).unwrap(),
    )
    .unwrap();
    assert_eq!(st, [0.0; 3]);
    pool.check_invariants().unwrap();
}
