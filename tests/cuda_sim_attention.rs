//! The paged attention kernels on the simulated device (`cargo test --features cuda-sim`,
//! each block run as fibers with real barriers and warp shuffles) against the CPU core
//! over the same pool contents: every storage dtype (8-bit with its scales) and query
//! dtype, head sizes with their own kernel (64, 128, 256) and the any-size one, GQA
//! groups 1/4/8, block sizes, both layouts, full and sliding layers, soft-capping, sinks
//! and ALiBi, decode rows beside extend rows (many query tokens of one sequence), and
//! histories long enough to be split across blocks and merged. Extend rows in float16
//! and bfloat16 with head sizes 64, 128 and 256 run on the tensor-core kernel (its
//! `mma.sync` and `ldmatrix` emulated by the simulator): its own property test crosses
//! the edges of its tiles (64 packed query rows, K/V tiles of 64 or 32 positions).
//! Latent (MLA) attention over a pool of 512-element latents and 64-element rotary parts
//! runs on its own tensor-core kernel, decode and extend, checked the same way.
#![cfg(feature = "cuda-sim")]

use half::{bf16, f16};
use kvrs::unstable::cuda::sim_launches;
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
    /// Latent (MLA) attention: queries of `head_dim + v_head_dim` elements score the
    /// latents (keys) and rotary parts (values); outputs sum the latents.
    latent: bool,
}

/// The step's attention outputs (per layer, as floats) of the host pool and the device pool.
fn run(c: &Case) -> [Vec<Vec<f32>>; 2] {
    run_on(c, None)
}

/// [`run`] with the device pool's launches sent to CUDA stream `stream`.
fn run_on(c: &Case, stream: Option<u64>) -> [Vec<Vec<f32>>; 2] {
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
        latent: c.latent,
        ..Default::default()
    };
    // Elements per query and per output row.
    let (qd, od) = if c.latent { (d + dv, d) } else { (d, dv) };
    [Device::Cpu, CUDA].map(|dev| {
        let mut pool =
            PoolCore::with_attention(shape, attention.clone(), c.dtype, dev, None).unwrap();
        if dev == CUDA {
            pool.set_stream(stream).unwrap();
        }
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
        let q32: Vec<f32> = values(99, n * hq * qd);
        let size = c.q_dtype.size();
        let (mut q_bytes, mut out_bytes) =
            (vec![0u8; n * hq * qd * size], vec![0u8; n * hq * od * size]);
        // SAFETY: q_bytes holds n * hq * qd elements of q's dtype.
        unsafe {
            kvrs::unstable::convert_contiguous(
                q_bytes.as_mut_ptr(),
                c.q_dtype,
                q32.as_ptr() as *const u8,
                DType::F32,
                q32.len(),
            );
        }
        let q = TensorRef::from_bytes(&q_bytes, c.q_dtype, &[n, hq, qd])
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
            let mut out = TensorMut::from_bytes_mut(&mut out_bytes, c.q_dtype, &[n, hq, od])
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
                latent: false,
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
            latent: false,
        });
    }
}

/// Launches of the tensor-core attention kernel for `c`'s dtype and head size so far.
fn mma_launches(c: &Case) -> u64 {
    let t = if c.dtype == DType::F16 { "f16" } else { "bf16" };
    sim_launches(0, &format!("kvrs_paged_attention_mma_{t}_d{}", c.head_dim))
}

/// Extend cases for the tensor-core kernel: float16 or bfloat16, head sizes 64, 128 and
/// 256, GQA groups 1 to 16, query tokens and histories across the tile edges.
fn mma_case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![DType::F16, DType::BF16]),
        prop::bool::ANY,
        prop::sample::select(vec![(1usize, 1usize), (2, 2), (1, 4), (2, 8), (1, 16)]),
        prop::sample::select(vec![64usize, 128, 256]),
        prop::sample::select(vec![1usize, 16]),
        0usize..200,
        2usize..70,
        (
            prop_oneof![Just(1usize << 20), 3usize..90],
            prop::option::of(1.0f32..5.0),
            prop::bool::ANY,
            prop::bool::ANY,
        ),
    )
        .prop_map(
            |(dtype, hnd, (kv_heads, group), head_dim, block_size, history, extend, o)| Case {
                dtype,
                q_dtype: dtype,
                layout: if hnd { KvLayout::Hnd } else { KvLayout::Nhd },
                kv_heads,
                group,
                head_dim,
                v_head_dim: head_dim,
                block_size,
                history,
                // At least one 16-row tile of (token, head) rows: the tensor cores' share.
                extend: extend.max(16usize.div_ceil(group)),
                window: o.0,
                softcap: o.1,
                sinks: o.2,
                alibi: o.3,
                latent: false,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]

    #[test]
    fn tensor_core_attention_equals_the_cpu_core(c in mma_case()) {
        let before = mma_launches(&c);
        check(&c);
        prop_assert!(mma_launches(&c) > before, "{:?} ran on the tensor cores", c);
    }
}

/// Tensor-core rows split across blocks and merged (a few query tokens over a long
/// history, as in speculative verification), beside a decode row on the CUDA cores.
#[test]
fn tensor_core_splits_merge() {
    for (dtype, head_dim) in [(DType::F16, 128), (DType::BF16, 64)] {
        let c = Case {
            dtype,
            q_dtype: dtype,
            layout: KvLayout::Nhd,
            kv_heads: 2,
            group: 4,
            head_dim,
            v_head_dim: head_dim,
            block_size: 16,
            history: 900,
            extend: 5,
            window: 300,
            softcap: Some(4.0),
            sinks: true,
            alibi: true,
            latent: false,
        };
        let before = mma_launches(&c);
        check(&c);
        assert!(mma_launches(&c) > before);
    }
}

/// A pool's launches on a caller's stream (the simulated device runs every launch when it
/// is queued, so this checks the API and the launch path): the same results as on kvrs's
/// own stream, and a host pool refuses.
#[test]
fn a_pool_launches_on_the_stream_it_is_given() {
    let c = Case {
        dtype: DType::BF16,
        q_dtype: DType::BF16,
        layout: KvLayout::Hnd,
        kv_heads: 2,
        group: 4,
        head_dim: 64,
        v_head_dim: 64,
        block_size: 16,
        history: 100,
        extend: 8,
        window: 50,
        softcap: None,
        sinks: false,
        alibi: false,
        latent: false,
    };
    let [_, own] = run(&c);
    let [_, given] = run_on(&c, Some(0x5eed));
    assert_eq!(own, given);
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 8,
        v_head_dim: 8,
        block_size: 4,
        num_blocks: 4,
        layout: KvLayout::Nhd,
    };
    let host = PoolCore::with_attention(shape, Attention::full(1), DType::F16, Device::Cpu, None);
    let e = host.unwrap().set_stream(Some(1)).unwrap_err();
    assert!(
        e.to_string().contains("needs a pool on a CUDA device"),
        "{e}"
    );
}

/// Launches of the latent attention kernel for `c`'s dtype so far.
fn mla_launches(c: &Case) -> u64 {
    let t = if c.dtype == DType::F16 { "f16" } else { "bf16" };
    sim_launches(0, &format!("kvrs_paged_attention_mla_{t}"))
}

/// A latent (MLA) pool's case: one KV head of 512-element latents and 64-element rotary
/// parts, `group` query heads.
fn latent_case(dtype: DType, group: usize, history: usize, extend: usize) -> Case {
    Case {
        dtype,
        q_dtype: dtype,
        layout: KvLayout::Nhd,
        kv_heads: 1,
        group,
        head_dim: 512,
        v_head_dim: 64,
        block_size: 16,
        history,
        extend,
        window: 1 << 20,
        softcap: None,
        sinks: false,
        alibi: false,
        latent: true,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    #[test]
    fn latent_attention_equals_the_cpu_core(
        dtype in prop::sample::select(vec![DType::F16, DType::BF16]),
        hnd in prop::bool::ANY,
        (group, extend) in prop_oneof![(Just(16usize), 1usize..9), (Just(128usize), 1usize..3)],
        history in 0usize..150,
        block_size in prop::sample::select(vec![1usize, 16]),
        options in (
            prop_oneof![Just(1usize << 20), 3usize..60],
            prop::option::of(1.0f32..5.0),
            prop::bool::ANY,
            prop::bool::ANY,
        ),
    ) {
        let c = Case {
            layout: if hnd { KvLayout::Hnd } else { KvLayout::Nhd },
            block_size,
            window: options.0,
            softcap: options.1,
            sinks: options.2,
            alibi: options.3,
            ..latent_case(dtype, group, history, extend)
        };
        let before = mla_launches(&c);
        check(&c);
        prop_assert!(mla_launches(&c) > before);
    }
}

/// DeepSeek's 128 query heads decoding over a latent history split across blocks (and
/// merged by the 512-element merge), and a few extend rows beside it.
#[test]
fn latent_decode_splits_merge() {
    for (dtype, extend) in [(DType::BF16, 1), (DType::F16, 3)] {
        let c = Case {
            softcap: Some(4.0),
            sinks: true,
            ..latent_case(dtype, 128, 700, extend)
        };
        check(&c);
    }
}

/// Latent attention the CUDA kernel does not take is refused with the reason.
#[test]
fn latent_attention_of_other_shapes_is_refused() {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 256,
        v_head_dim: 32,
        block_size: 16,
        num_blocks: 8,
        layout: KvLayout::Nhd,
    };
    let mut pool =
        PoolCore::with_attention(shape, Attention::full(1), DType::F16, CUDA, None).unwrap();
    let id = pool.new_sequence();
    let plan = pool.start_forward(&[id], None, None).unwrap();
    let q = vec![0u8; 288 * 2];
    let mut o = vec![0u8; 256 * 2];
    let q = TensorRef::from_bytes(&q, DType::F16, &[1, 1, 288])
        .unwrap()
        .on(CUDA);
    let mut out = TensorMut::from_bytes_mut(&mut o, DType::F16, &[1, 1, 256])
        .unwrap()
        .on(CUDA);
    let opts = AttnOptions {
        latent: true,
        ..Default::default()
    };
    let e = pool
        .forward_attention(&plan, 0, &q, &mut out, &opts)
        .unwrap_err();
    assert!(e.to_string().contains("512-element latents"), "{e}");
    pool.finish_forward(&plan).unwrap();
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
