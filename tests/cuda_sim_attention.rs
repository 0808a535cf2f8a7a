//! The paged attention kernels on the simulated device (`cargo test --features cuda-sim`,
//! each block run as fibers with real barriers and warp shuffles) against the CPU core
//! over the same pool contents: every storage dtype (8-bit with its scales) and query
//! dtype, head sizes with their own kernel (64, 128, 256) and the any-size one, GQA
//! groups 1/4/8, block sizes, both layouts, full and sliding layers, soft-capping, sinks
//! and ALiBi, decode rows beside extend rows (many query tokens of one sequence), and
//! histories long enough to be split across blocks and merged.
#![cfg(feature = "cuda-sim")]

use half::{bf16, f16};
use kvrs::unstable::{PoolCore, TensorMut, TensorRef};
use kvrs::{Attention, AttnOptions, DType, Device, KvLayout, KvScales, LayerKind, PagedShape};
use proptest::prelude::*;

const CUDA: Device = Device::Cuda(0);

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn on<'a>(v: &'a [f32], shape: &[usize], device: Device) -> TensorRef<'a> {
    TensorRef::from_f32(v, shape).unwrap().on(device)
}

/// Bytes of `dtype` as floats.
fn floats(b: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F16 => b
            .chunks(2)
            .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
        _ => b
            .chunks(2)
            .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
    }
}

#[derive(Clone, Debug)]
struct Case {
    dtype: DType,
    q_dtype: DType,
    layout: KvLayout,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    /// Elements per value (and output) row: `head_dim`, or another size (the generic
    /// kernel).
    v_head_dim: usize,
    block_size: usize,
    /// Positions the extended sequence holds before the step.
    history: usize,
    /// Its query tokens in the step (1: decode).
    extend: usize,
    window: usize,
    softcap: Option<f32>,
    sinks: bool,
    alibi: bool,
}

/// The step's attention outputs (per layer, as floats) of the host pool and the device pool.
fn run(c: &Case) -> [Vec<Vec<f32>>; 2] {
    let (h, d, dv) = (c.kv_heads, c.head_dim, c.v_head_dim);
    let hq = h * c.group;
    let shape = PagedShape {
        num_layers: 2,
        num_kv_heads: h,
        head_dim: d,
        v_head_dim: dv,
        block_size: c.block_size,
        num_blocks: 2 * (c.history + c.extend + 8).div_ceil(c.block_size) + 8,
        layout: c.layout,
    };
    let attention = Attention {
        kinds: vec![LayerKind::Full, LayerKind::Sliding],
        sliding_window: Some(c.window),
        chunk_size: None,
        swa_memory: 0,
    };
    let sinks: Vec<f32> = values(7, hq).iter().map(|x| 2.0 * x).collect();
    let slopes: Vec<f32> = (0..hq).map(|i| 0.01 * (i + 1) as f32).collect();
    let opts = AttnOptions {
        softcap: c.softcap,
        sinks: c.sinks.then_some(&sinks[..]),
        alibi_slopes: c.alibi.then_some(&slopes[..]),
        ..Default::default()
    };
    [Device::Cpu, CUDA].map(|dev| {
        let mut pool =
            PoolCore::with_attention(shape, attention.clone(), c.dtype, dev, None).unwrap();
        if c.dtype.fp8().is_some() {
            let k: Vec<f32> = (0..2 * h).map(|i| 0.01 + 0.003 * i as f32).collect();
            let v: Vec<f32> = (0..2 * h).map(|i| 0.02 - 0.002 * i as f32).collect();
            pool = pool
                .with_scales(KvScales::new(2, h, &k, &v).unwrap())
                .unwrap();
        }
        // The extended sequence and a short one decoding beside it.
        let mut ids = Vec::new();
        for (i, n) in [c.history, 3].into_iter().enumerate() {
            let id = pool.new_sequence();
            for layer in 0..2 {
                let seed = (10 * i + layer) as u64;
                let (k, v) = (values(seed, n * h * d), values(seed + 5, n * h * dv));
                pool.append(
                    id,
                    layer as i64,
                    &on(&k, &[n, h, d], dev),
                    &on(&v, &[n, h, dv], dev),
                )
                .unwrap();
            }
            pool.advance(id, n as i64, None).unwrap();
            ids.push(id);
        }
        let mut batch = vec![ids[0]; c.extend];
        batch.push(ids[1]);
        let plan = pool.start_forward(&batch, None, None).unwrap();
        let n = batch.len();
        let q32: Vec<f32> = values(99, n * hq * d);
        let size = c.q_dtype.size();
        let (mut q_bytes, mut out_bytes) =
            (vec![0u8; n * hq * d * size], vec![0u8; n * hq * dv * size]);
        // SAFETY: q_bytes holds n * hq * d elements of q's dtype.
        unsafe {
            kvrs::unstable::convert_contiguous(
                q_bytes.as_mut_ptr(),
                c.q_dtype,
                q32.as_ptr() as *const u8,
                DType::F32,
                q32.len(),
            );
        }
        let q = TensorRef::from_bytes(&q_bytes, c.q_dtype, &[n, hq, d])
            .unwrap()
            .on(dev);
        let mut per_layer = Vec::new();
        for layer in 0..2 {
            let (k, v) = (
                values(50 + layer, n * h * d),
                values(60 + layer, n * h * dv),
            );
            let g = pool.group_for(Some(layer as i64)).unwrap();
            pool.write(
                layer as i64,
                &on(&k, &[n, h, d], dev),
                &on(&v, &[n, h, dv], dev),
                plan.group_slots(g),
            )
            .unwrap();
            let mut out = TensorMut::from_bytes_mut(&mut out_bytes, c.q_dtype, &[n, hq, dv])
                .unwrap()
                .on(dev);
            pool.forward_attention(&plan, layer as i64, &q, &mut out, &opts)
                .unwrap();
            per_layer.push(floats(&out_bytes, c.q_dtype));
        }
        pool.finish_forward(&plan).unwrap();
        per_layer
    })
}

fn check(c: &Case) {
    let [cpu, dev] = run(c);
    // Rounding of the output dtype, plus f32 reassociation (8-bit scales are applied per
    // score instead of per element, base-2 exponentials).
    let tol = match c.q_dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    };
    for (layer, (a, b)) in cpu.iter().zip(&dev).enumerate() {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + x.abs()),
                "{c:?} layer {layer} elem {i}: cpu {x} vs device {y}"
            );
        }
        assert!(a.iter().any(|&x| x != 0.0), "{c:?}");
    }
}

/// The storage dtypes with their query dtypes (float storage: its own; 8-bit: any float).
fn dtypes() -> impl Strategy<Value = (DType, DType)> {
    let floats = [DType::F32, DType::F16, DType::BF16];
    prop_oneof![
        prop::sample::select(floats.to_vec()).prop_map(|d| (d, d)),
        (
            prop::sample::select(vec![DType::F8E4M3, DType::F8E5M2, DType::I8]),
            prop::sample::select(floats.to_vec())
        ),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        dtypes(),
        prop::bool::ANY,
        prop::sample::select(vec![(1usize, 1usize), (1, 4), (2, 4), (1, 8)]),
        prop::sample::select(vec![
            (64usize, 64usize),
            (128, 128),
            (256, 256),
            (48, 48),
            (128, 64),
            (64, 256),
            (40, 24),
            (20, 12),
        ]),
        prop::sample::select(vec![1usize, 4, 16]),
        prop_oneof![0usize..40, 250usize..600],
        prop_oneof![Just(1usize), 2usize..20],
        (
            3usize..40,
            prop::option::of(1.0f32..5.0),
            prop::bool::ANY,
            prop::bool::ANY,
        ),
    )
        .prop_map(
            |(
                (dtype, q_dtype),
                hnd,
                (kv_heads, group),
                (head_dim, v_head_dim),
                block_size,
                history,
                extend,
                o,
            )| Case {
                // int8 of two head sizes keeps a scale per chunk of a row, which the
                // device refuses (tests/cuda_sim_quantized.rs checks the refusal).
                dtype: if dtype == DType::I8 && head_dim != v_head_dim {
                    DType::F8E4M3
                } else {
                    dtype
                },
                q_dtype,
                layout: if hnd { KvLayout::Hnd } else { KvLayout::Nhd },
                kv_heads,
                group,
                head_dim,
                v_head_dim,
                block_size,
                history,
                extend,
                window: o.0,
                softcap: o.1,
                sinks: o.2,
                alibi: o.3,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn paged_attention_equals_the_cpu_core(c in case()) {
        check(&c);
    }
}

/// One long history per storage dtype: split across blocks (the plan aims at 3 blocks
/// per simulated SM) and merged, with every option on; decode and extend rows together;
/// values of the keys' size and (but int8) of another.
#[test]
fn long_histories_split_and_merge_for_every_dtype() {
    for ((dtype, q_dtype), v_head_dim) in [
        (DType::F32, DType::F32),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
        (DType::F8E4M3, DType::F32),
        (DType::F8E5M2, DType::F16),
        (DType::I8, DType::BF16),
    ]
    .into_iter()
    .flat_map(|d| [(d, 128), (d, 64)])
    .filter(|&((d, _), dv)| d != DType::I8 || dv == 128)
    {
        check(&Case {
            dtype,
            q_dtype,
            layout: KvLayout::Nhd,
            kv_heads: 2,
            group: 4,
            head_dim: 128,
            v_head_dim,
            block_size: 16,
            history: 900,
            extend: 3,
            window: 100,
            softcap: Some(4.0),
            sinks: true,
            alibi: true,
        });
    }
}

/// A custom (tree) mask on a CUDA pool is refused by name, never ignored: its kernels
/// apply causal and window ranges only.
#[test]
fn custom_masks_are_refused_on_the_device() {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 64,
        v_head_dim: 64,
        block_size: 16,
        num_blocks: 4,
        layout: KvLayout::Nhd,
    };
    let mut pool = PoolCore::new(shape, DType::F32, CUDA, None).unwrap();
    let id = pool.new_sequence();
    let plan = pool.start_forward(&[id, id], None, None).unwrap();
    let kv = values(1, 2 * 64);
    pool.forward_write(
        &plan,
        0,
        &on(&kv, &[2, 1, 64], CUDA),
        &on(&kv, &[2, 1, 64], CUDA),
    )
    .unwrap();
    let mask = plan
        .custom_mask(kvrs::unstable::MaskInput::Flat(&[true, false, true, true]))
        .unwrap();
    let q = values(2, 2 * 64);
    let mut out = vec![0f32; 2 * 64];
    let opts = AttnOptions {
        mask: Some(mask.as_custom()),
        ..Default::default()
    };
    let err = pool
        .forward_attention(
            &plan,
            0,
            &on(&q, &[2, 1, 64], CUDA),
            &mut TensorMut::from_f32_mut(&mut out, &[2, 1, 64])
                .unwrap()
                .on(CUDA),
            &opts,
        )
        .unwrap_err();
    assert!(
        matches!(&err, kvrs::KvError::NotSupported(m) if m.contains("custom_mask")),
        "{err}"
    );
}
