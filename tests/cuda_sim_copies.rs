//! The copy kernels on the simulated device (`cargo test --features cuda-sim`): the
//! one-launch multi-layer write against per-layer writes and the host storage, the
//! launch words passed in a parameter and through a pointer, and copy-on-write of every
//! forked block of a step in one launch.
#![cfg(feature = "cuda-sim")]

use kvrs::unstable::cuda::sim_launches;
use kvrs::unstable::{PoolCore, TensorMut, TensorRef};
use kvrs::{Attention, DType, Device, KvLayout, LayerKind, PagedShape, SeqId};
use proptest::prelude::*;

const CUDA: Device = Device::Cuda(0);

/// Every byte of a pool's storage (codes, then int8's scales).
fn storage_bytes(p: &PoolCore) -> Vec<u8> {
    let bytes = p.stats().bytes_total;
    let codes = match p.row_scales() {
        Some(sc) => bytes - 4 * sc.len,
        None => bytes,
    };
    // SAFETY: the simulated device's memory is host memory of the storage's size.
    let mut out = unsafe { std::slice::from_raw_parts(p.data_ptr(), codes) }.to_vec();
    if let Some(sc) = p.row_scales() {
        // SAFETY: as above, the scales.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(sc.ptr as *const u8, 4 * sc.len)
        });
    }
    out
}

fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((seed as usize * 7919 + i * 104_729) % 193) as f32 / 16.0 - 6.0)
        .collect()
}

/// `v` as float32 or float16 elements (bytes) of a tensor.
fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        _ => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
    }
}

fn shape(layout: KvLayout, head_dim: usize, num_blocks: usize) -> PagedShape {
    PagedShape {
        num_layers: 3,
        num_kv_heads: 2,
        head_dim,
        v_head_dim: head_dim,
        block_size: 4,
        num_blocks,
        layout,
    }
}

/// A pool on `device` whose layers 0 and 2 are full attention and layer 1 sliding (two
/// block tables) when `groups`, else all full.
fn pool(sh: PagedShape, dtype: DType, device: Device, groups: bool) -> PoolCore {
    let attention = Attention {
        kinds: if groups {
            vec![LayerKind::Full, LayerKind::Sliding, LayerKind::Full]
        } else {
            vec![LayerKind::Full; 3]
        },
        sliding_window: groups.then_some(8),
        chunk_size: None,
        swa_memory: 2,
    };
    PoolCore::with_attention(sh, attention, dtype, device, None).unwrap()
}

/// Writes `n` tokens of every layer through `write_layers` into pool `a` and through
/// per-layer `write` into pool `b` (same slots); inputs are stacked `[layers, n, H, D]`
/// with `pad` elements between layers, of `input` dtype, on each pool's device.
fn write_both(
    a: &mut PoolCore,
    b: &mut PoolCore,
    n: usize,
    input: DType,
    pad: usize,
    skip: &[bool],
) -> SeqId {
    let sh = a.shape();
    let (h, d) = (sh.num_kv_heads, sh.head_dim);
    let layer = n * h * d + pad;
    let keys = encode(&values(1, sh.num_layers * layer), input);
    let vals = encode(&values(2, sh.num_layers * layer), input);
    let mut slot_sets = Vec::new();
    let mut ids = Vec::new();
    for p in [&mut *a, &mut *b] {
        let id: SeqId = p.new_sequence();
        ids.push(id);
        let mut slots = p.reserve(&[id], &[n as i64]).unwrap();
        let groups = slots.len() / n.max(1);
        for g in 0..groups {
            for (t, &s) in skip.iter().enumerate().take(n) {
                if s {
                    slots[g * n + t] = -1;
                }
            }
        }
        slot_sets.push(slots);
    }
    assert_eq!(slot_sets[0], slot_sets[1]);
    fn views(
        bytes: &[u8],
        sh: PagedShape,
        n: usize,
        layer: usize,
        input: DType,
        device: Device,
    ) -> Vec<TensorRef<'_>> {
        let (h, d, es) = (sh.num_kv_heads, sh.head_dim, input.size());
        (0..sh.num_layers)
            .map(|l| {
                let at = &bytes[l * layer * es..(l * layer + n * h * d) * es];
                TensorRef::from_bytes(at, input, &[n, h, d])
                    .unwrap()
                    .on(device)
            })
            .collect()
    }
    let views = |bytes, device| views(bytes, sh, n, layer, input, device);
    let dev_a = a.device();
    a.write_layers(&views(&keys, dev_a), &views(&vals, dev_a), &slot_sets[0])
        .unwrap();
    let dev_b = b.device();
    let (kb, vb) = (views(&keys, dev_b), views(&vals, dev_b));
    let groups = slot_sets[1].len() / n.max(1);
    for l in 0..sh.num_layers {
        let g = if groups > 1 {
            b.group_for(Some(l as i64)).unwrap()
        } else {
            0
        };
        b.write(l as i64, &kb[l], &vb[l], &slot_sets[1][g * n..(g + 1) * n])
            .unwrap();
    }
    ids[0]
}

fn layout() -> impl Strategy<Value = KvLayout> {
    prop_oneof![Just(KvLayout::Nhd), Just(KvLayout::Hnd)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// One launch for every layer writes what a write per layer writes, on the device
    /// and on the host, whatever the alignment (odd head_dim and padding between layers
    /// narrow the vectors), the layout, the storage and input dtypes, skipped slots and
    /// layer groups.
    #[test]
    fn write_layers_equals_a_write_per_layer(
        store in prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16), Just(DType::F8E4M3), Just(DType::I8)],
        input in prop_oneof![Just(DType::F32), Just(DType::F16)],
        layout in layout(),
        head_dim in prop_oneof![Just(8usize), Just(16), Just(7), Just(4)],
        n in 1usize..10,
        pad in 0usize..3,
        groups in any::<bool>(),
        skip in prop::collection::vec(prop::bool::weighted(0.2), 10),
    ) {
        let sh = shape(layout, head_dim, 24);
        let mut one = pool(sh, store, CUDA, groups);
        let mut per_layer = pool(sh, store, CUDA, groups);
        write_both(&mut one, &mut per_layer, n, input, pad, &skip);
        prop_assert!(storage_bytes(&one) == storage_bytes(&per_layer));
        if store != DType::I8 {
            // The host storage writes the same bytes (int8's scales may differ in the last ulp).
            let mut host = pool(sh, store, Device::Cpu, groups);
            let mut host_per_layer = pool(sh, store, Device::Cpu, groups);
            write_both(&mut host, &mut host_per_layer, n, input, pad, &skip);
            prop_assert!(storage_bytes(&host) == storage_bytes(&one));
        }
    }
}

/// More launch words than a kernel parameter holds go through the staging buffer (the
/// `_wp` instances): the same bytes as the host.
#[test]
fn launch_words_past_the_parameter_limit_go_through_a_pointer() {
    let n: usize = 4100;
    let sh = shape(KvLayout::Nhd, 8, n.div_ceil(4) + 2);
    let before = sim_launches(0, "kvrs_scatter_f32_f16");
    let mut dev = pool(sh, DType::F16, CUDA, false);
    let mut dev_per_layer = pool(sh, DType::F16, CUDA, false);
    let dev_id = write_both(&mut dev, &mut dev_per_layer, n, DType::F32, 1, &[]);
    let mut host = pool(sh, DType::F16, Device::Cpu, false);
    let mut host_per_layer = pool(sh, DType::F16, Device::Cpu, false);
    let host_id = write_both(&mut host, &mut host_per_layer, n, DType::F32, 1, &[]);
    assert!(storage_bytes(&dev) == storage_bytes(&host));
    assert!(storage_bytes(&dev_per_layer) == storage_bytes(&host));
    // Launched: reserve zeroes 3 layers per pool (the float32 zero row), write_layers
    // once, the per-layer writes 3 times (other tests may launch it too).
    assert!(sim_launches(0, "kvrs_scatter_f32_f16") - before >= 2 * 3 + 1 + 3);
    // Gathered back through the device's gather (a block table of 1,026 entries).
    let mut k = vec![0u8; 2 * n * 2 * 8];
    let mut v = vec![0u8; 2 * n * 2 * 8];
    let mut tk = TensorMut::from_bytes_mut(&mut k, DType::F16, &[2, n, 8])
        .unwrap()
        .on(CUDA);
    let mut tv = TensorMut::from_bytes_mut(&mut v, DType::F16, &[2, n, 8])
        .unwrap()
        .on(CUDA);
    dev.gather(dev_id, 2, &mut tk, &mut tv).unwrap();
    let mut hk = vec![0u8; 2 * n * 2 * 8];
    let mut hv = vec![0u8; 2 * n * 2 * 8];
    let mut tk = TensorMut::from_bytes_mut(&mut hk, DType::F16, &[2, n, 8]).unwrap();
    let mut tv = TensorMut::from_bytes_mut(&mut hv, DType::F16, &[2, n, 8]).unwrap();
    host.gather(host_id, 2, &mut tk, &mut tv).unwrap();
    assert!((k, v) == (hk, hv));
}

/// Copy-on-write of every forked block of a step is one launch, and leaves what the
/// host's copies leave.
#[test]
fn forks_copy_on_write_in_one_launch() {
    for dtype in [DType::F16, DType::I8] {
        let sh = shape(KvLayout::Nhd, 8, 64);
        let mut pools = [
            pool(sh, dtype, CUDA, false),
            pool(sh, dtype, Device::Cpu, false),
        ];
        let mut children = Vec::new();
        for p in &mut pools {
            let parent = p.new_sequence();
            let (n, h, d) = (6, sh.num_kv_heads, sh.head_dim);
            let x = values(3, n * h * d);
            for l in 0..sh.num_layers as i64 {
                let t = TensorRef::from_f32(&x, &[n, h, d]).unwrap().on(p.device());
                p.append(parent, l, &t, &t).unwrap();
            }
            p.advance(parent, 6, None).unwrap();
            // Eight children share the parent's partial second block.
            children.push((0..8).map(|_| p.fork(parent).unwrap()).collect::<Vec<_>>());
        }
        let before = sim_launches(0, "kvrs_copy_blocks");
        for (p, children) in pools.iter_mut().zip(&children) {
            let plan = p.start_forward(children, None, None).unwrap();
            p.cancel_forward(&plan);
        }
        // One launch for the codes (int8: one more for their scales).
        let launches = if dtype == DType::I8 { 2 } else { 1 };
        assert_eq!(
            sim_launches(0, "kvrs_copy_blocks") - before,
            launches,
            "{dtype}"
        );
        assert!(
            storage_bytes(&pools[0]) == storage_bytes(&pools[1]),
            "{dtype}"
        );
        for p in &pools {
            p.check_invariants().unwrap();
        }
    }
}
