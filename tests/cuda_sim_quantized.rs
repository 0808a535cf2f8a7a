//! 8-bit storage on the simulated CUDA device (`cargo test --features cuda-sim`) against
//! the host: the device's codecs equal the host's on every float32 bit pattern class,
//! and a property test runs random pool operations on a host pool and a device pool of
//! the same 8-bit dtype side by side. After every step both hold the same codes and
//! scales, bit for bit, read back through every path (device gathers, host reads,
//! dequantized floats), and attention over them agrees. Pools of keys and values of
//! different head sizes (an MLA latent) run the same operations through the region
//! copies, with int8's scale per gcd(head_dim, v_head_dim) elements; their attention runs
//! the generic kernel, but for int8, whose per-chunk scales the device refuses
//! (`NotSupported`).
#![cfg(feature = "cuda-sim")]

use kvrs::unstable::cuda::{gpu_for, Args};
use kvrs::unstable::{CacheCore, CacheShape, Fp8, PoolCore, Rope, RopeStyle, TensorMut, TensorRef};
use kvrs::{
    Attention, AttnOptions, DType, Device, KvLayout, KvScales, LayerKind, PagedShape, SeqId,
};
use proptest::prelude::*;

const L: usize = 2;
const H: usize = 2;
const D: usize = 4;
/// The value head size of the pools of two head sizes (the scale unit of int8: 2).
const DV: usize = 6;
const BS: usize = 4;
const BLOCKS: usize = 24;
const CUDA: Device = Device::Cuda(0);

/// Launches a rank-1 `kvrs_copy3_*` of `n` elements on the simulated device (its memory
/// is host memory, so host buffers serve as device buffers).
fn copy3(name: &str, dst: *mut u8, src: *const u8, n: usize) {
    let args = Args::new()
        .u64(dst as u64)
        .i64(0)
        .i64(0)
        .i64(1)
        .u64(src as u64)
        .i64(0)
        .i64(0)
        .i64(1)
        .i64(1)
        .i64(1)
        .i64(n as i64);
    unsafe {
        gpu_for(0)
            .unwrap()
            .launch(name, [64, 1, 1], [256, 1, 1], &args, 0)
    }
    .unwrap();
}

/// Float32 bit patterns around every exponent, both signs, with mantissas near the fp8
/// rounding boundaries, plus zeros, infinities and NaNs.
fn patterns() -> Vec<f32> {
    let mut out = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
    ];
    for exp in 0u32..255 {
        for man in [
            0u32, 1, 0x7ffff, 0x80000, 0x80001, 0xfffff, 0x100000, 0x180000, 0x3fffff, 0x7fffff,
        ] {
            for sign in [0u32, 1] {
                out.push(f32::from_bits(sign << 31 | exp << 23 | man));
            }
        }
    }
    out
}

#[test]
fn device_fp8_codecs_equal_the_host_codec_bit_for_bit() {
    let x = patterns();
    for (fp8, name) in [(Fp8::E4M3, "e4m3"), (Fp8::E5M2, "e5m2")] {
        let mut codes = vec![0u8; x.len()];
        copy3(
            &format!("kvrs_copy3_f32_{name}"),
            codes.as_mut_ptr(),
            x.as_ptr() as *const u8,
            x.len(),
        );
        for (v, c) in x.iter().zip(&codes) {
            assert_eq!(
                *c,
                fp8.encode(*v),
                "{name} encode {v:e} ({:#x})",
                v.to_bits()
            );
        }
        let all: Vec<u8> = (0..=255).collect();
        let mut back = vec![0f32; 256];
        copy3(
            &format!("kvrs_copy3_{name}_f32"),
            back.as_mut_ptr() as *mut u8,
            all.as_ptr(),
            256,
        );
        for (c, v) in all.iter().zip(&back) {
            let want = fp8.decode(*c);
            assert!(
                v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                "{name} decode {c:#x}: {v} vs {want}"
            );
        }
    }
}

#[test]
fn device_int8_rows_equal_the_host_quantizer() {
    // Rows of 4: ordinary, all zero, with an infinity, with a NaN, tiny, huge, at
    // float32's largest value (the scale steps down so that 127 * scale stays finite).
    let rows: Vec<[f32; 4]> = vec![
        [1.0, -2.5, 3.25, 0.1],
        [0.0, -0.0, 0.0, 0.0],
        [f32::INFINITY, 1.0, -3.0, 0.0],
        [f32::NAN, 2.0, -1.0, 0.5],
        [1e-40, -3e-41, 0.0, 2e-45],
        [3e38, -3.4e38, 1.0, -1.0],
        [f32::MAX, 1.0, -1e37, 0.0],
        [-f32::MAX, f32::NEG_INFINITY, 2e38, f32::NAN],
    ];
    for (i, row) in rows.iter().enumerate() {
        let shape = CacheShape {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 4,
            v_head_dim: 4,
            max_seq_len: 2,
        };
        let caches: Vec<CacheCore> = [Device::Cpu, CUDA]
            .into_iter()
            .map(|dev| CacheCore::new(shape, DType::I8, dev).unwrap())
            .collect();
        let mut codes = Vec::new();
        for mut c in caches {
            let dev = c.device();
            let t = TensorRef::from_f32(&row[..], &[1, 1, 4]).unwrap().on(dev);
            c.append(0, &t, &t).unwrap();
            let (mut raw, mut raw_v) = ([0i8; 4], [0i8; 4]);
            let mut out = TensorMut::from_bytes_mut(
                bytemuck::cast_slice_mut(&mut raw),
                DType::I8,
                &[1, 1, 4],
            )
            .unwrap();
            let mut out_v = TensorMut::from_bytes_mut(
                bytemuck::cast_slice_mut(&mut raw_v),
                DType::I8,
                &[1, 1, 4],
            )
            .unwrap();
            c.extract_block(0, 0, 1, &mut out, &mut out_v).unwrap();
            let rs = c.row_scales().unwrap();
            codes.push((raw, unsafe { *rs.ptr }));
        }
        assert_eq!(codes[0].0, codes[1].0, "row {i}: {row:?}");
        assert_eq!(
            codes[0].1.to_bits(),
            codes[1].1.to_bits(),
            "row {i}: {row:?}"
        );
    }
}

#[derive(Clone, Debug)]
enum Op {
    New,
    Free(usize),
    Fork(usize),
    Append {
        seq: usize,
        layer: usize,
        n: usize,
        seed: u32,
        device_input: bool,
    },
    Advance(usize, usize),
    Truncate(usize, usize),
    Remove(usize, usize, usize),
    CopyPrefix(usize, usize, usize),
    Forward {
        seqs: Vec<usize>,
        seed: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..6usize;
    prop_oneof![
        2 => Just(Op::New),
        1 => i.clone().prop_map(Op::Free),
        1 => i.clone().prop_map(Op::Fork),
        5 => (i.clone(), 0..L, 0..7usize, any::<u32>(), any::<bool>()).prop_map(
            |(seq, layer, n, seed, device_input)| Op::Append { seq, layer, n, seed, device_input }),
        2 => (i.clone(), 0..5usize).prop_map(|(s, n)| Op::Advance(s, n)),
        1 => (i.clone(), 0..12usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        1 => (i.clone(), 0..8usize, 1..6usize).prop_map(|(s, b, n)| Op::Remove(s, b, b + n)),
        1 => (i.clone(), i.clone(), 0..10usize).prop_map(|(a, b, n)| Op::CopyPrefix(a, b, n)),
        2 => (prop::collection::vec(i, 1..4), any::<u32>()).prop_map(|(seqs, seed)| Op::Forward { seqs, seed }),
    ]
}

/// Values over many magnitudes: saturating, subnormal in fp8, zeros, both signs.
fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = seed.wrapping_mul(2654435761).wrapping_add(i as u32 * 40503);
            let m = (h % 201) as f32 - 100.0;
            m * [1e-5, 1e-3, 0.05, 1.0, 30.0, 1e4][(h >> 8) as usize % 6]
        })
        .collect()
}

fn tensor<'a>(v: &'a [f32], shape: &[usize], device: Device) -> TensorRef<'a> {
    TensorRef::from_f32(v, shape).unwrap().on(device)
}

fn tensor_mut<'a>(v: &'a mut [u8], dtype: DType, shape: &[usize], device: Device) -> TensorMut<'a> {
    TensorMut::from_bytes_mut(v, dtype, shape)
        .unwrap()
        .on(device)
}

/// The host pool and the device pool, and the sequences they hold (same ids in both).
struct Twins {
    pools: [PoolCore; 2],
    live: Vec<[SeqId; 2]>,
    dtype: DType,
    /// Elements per value head vector (keys have `D`).
    dv: usize,
}

impl Twins {
    fn new(dtype: DType, layout: KvLayout, dv: usize) -> Self {
        let shape = PagedShape {
            num_layers: L,
            num_kv_heads: H,
            head_dim: D,
            v_head_dim: dv,
            block_size: BS,
            num_blocks: BLOCKS,
            layout,
        };
        let attention = Attention {
            kinds: vec![LayerKind::Full, LayerKind::Sliding],
            sliding_window: Some(6),
            chunk_size: None,
            swa_memory: 2,
        };
        let rope = Rope {
            theta: 10000.0,
            rotary_dim: None,
            style: RopeStyle::Neox,
            linear_factor: 1.0,
        };
        let pools = [Device::Cpu, CUDA].map(|dev| {
            let mut p = PoolCore::with_attention(shape, attention.clone(), dtype, dev, None)
                .unwrap()
                .with_rope(rope)
                .unwrap();
            if dtype.fp8().is_some() {
                // Per-head scales, different for K and V and per layer.
                let k: Vec<f32> = (0..L * H).map(|i| 0.5 + i as f32 * 0.75).collect();
                let v: Vec<f32> = (0..L * H).map(|i| 2.0 - i as f32 * 0.25).collect();
                p = p.with_scales(KvScales::new(L, H, &k, &v).unwrap()).unwrap();
            }
            p
        });
        Twins {
            pools,
            live: Vec::new(),
            dtype,
            dv,
        }
    }

    fn pick(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    /// Runs `f` on both pools and checks that they agree on the outcome.
    fn both<R: PartialEq + std::fmt::Debug>(
        &mut self,
        what: &Op,
        mut f: impl FnMut(&mut PoolCore, usize) -> kvrs::Result<R>,
    ) -> Option<[R; 2]> {
        let a = f(&mut self.pools[0], 0);
        let b = f(&mut self.pools[1], 1);
        match (a, b) {
            (Ok(a), Ok(b)) => Some([a, b]),
            (Err(a), Err(b)) => {
                assert_eq!(a.to_string(), b.to_string(), "{what:?}");
                None
            }
            (a, b) => panic!("{what:?}: host {a:?} vs device {b:?}"),
        }
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::New => {
                let ids = self.pools.each_mut().map(|p| p.new_sequence());
                self.live.push(ids);
            }
            Op::Free(i) => {
                if let Some(i) = self.pick(*i) {
                    let ids = self.live.remove(i);
                    self.both(op, |p, j| p.free_sequence(ids[j]));
                }
            }
            Op::Fork(i) => {
                if let Some(i) = self.pick(*i) {
                    let ids = self.live[i];
                    if let Some(new) = self.both(op, |p, j| p.fork(ids[j])) {
                        self.live.push(new);
                    }
                }
            }
            Op::Append {
                seq,
                layer,
                n,
                seed,
                device_input,
            } => {
                let Some(i) = self.pick(*seq) else { return };
                let ids = self.live[i];
                let dv = self.dv;
                let (k, v) = (values(*seed, n * H * D), values(seed ^ 0xabcd, n * H * dv));
                let dev = |j: usize| {
                    if j == 1 && *device_input {
                        CUDA
                    } else {
                        Device::Cpu
                    }
                };
                self.both(op, |p, j| {
                    p.append(
                        ids[j],
                        *layer as i64,
                        &tensor(&k, &[*n, H, D], dev(j)),
                        &tensor(&v, &[*n, H, dv], dev(j)),
                    )
                });
            }
            Op::Advance(i, n) => {
                let Some(i) = self.pick(*i) else { return };
                let ids = self.live[i];
                self.both(op, |p, j| p.advance(ids[j], *n as i64, None));
            }
            Op::Truncate(i, n) => {
                let Some(i) = self.pick(*i) else { return };
                let ids = self.live[i];
                self.both(op, |p, j| p.truncate(ids[j], *n as i64));
            }
            Op::Remove(i, b, e) => {
                let Some(i) = self.pick(*i) else { return };
                let ids = self.live[i];
                self.both(op, |p, j| p.remove(ids[j], *b as i64, Some(*e as i64)));
            }
            Op::CopyPrefix(a, b, n) => {
                let (Some(a), Some(b)) = (self.pick(*a), self.pick(*b)) else {
                    return;
                };
                let (x, y) = (self.live[a], self.live[b]);
                self.both(op, |p, j| p.copy_prefix(x[j], y[j], *n as i64));
            }
            Op::Forward { seqs, seed } => self.forward(op, seqs, *seed),
        }
    }

    /// One forward step of a token per chosen sequence: slot writes (device tensors on
    /// the device pool) and attention with float32 queries, compared, then committed.
    fn forward(&mut self, op: &Op, seqs: &[usize], seed: u32) {
        let mut chosen: Vec<usize> = seqs.iter().filter_map(|&i| self.pick(i)).collect();
        chosen.dedup();
        chosen.sort_unstable();
        chosen.dedup();
        if chosen.is_empty() {
            return;
        }
        let batch: [Vec<SeqId>; 2] =
            [0, 1].map(|j| chosen.iter().map(|&i| self.live[i][j]).collect());
        let Some(plans) = self.both(op, |p, j| p.start_forward(&batch[j], None, None).map(Some))
        else {
            return;
        };
        let plans = plans.map(|p| p.unwrap());
        let (n, hq) = (chosen.len(), 2 * H);
        let devs = [Device::Cpu, CUDA];
        let q = values(seed ^ 0x1234, n * hq * D)
            .iter()
            .map(|x| x.clamp(-3.0, 3.0))
            .collect::<Vec<f32>>();
        let dv = self.dv;
        for layer in 0..L {
            let k = values(seed.wrapping_add(layer as u32), n * H * D);
            let v = values(seed ^ 0x7777 ^ layer as u32, n * H * dv);
            let mut outs = [vec![0u8; 4 * n * hq * dv], vec![0u8; 4 * n * hq * dv]];
            let mut attended = true;
            for j in 0..2 {
                let p = &mut self.pools[j];
                let g = p.group_for(Some(layer as i64)).unwrap();
                p.write(
                    layer as i64,
                    &tensor(&k, &[n, H, D], devs[j]),
                    &tensor(&v, &[n, H, dv], devs[j]),
                    plans[j].group_slots(g),
                )
                .unwrap();
                let mut out = tensor_mut(&mut outs[j], DType::F32, &[n, hq, dv], devs[j]);
                let r = p.forward_attention(
                    &plans[j],
                    layer as i64,
                    &tensor(&q, &[n, hq, D], devs[j]),
                    &mut out,
                    &AttnOptions::default(),
                );
                if j == 1 && dv != D && self.dtype == DType::I8 {
                    // The device's kernel applies one scale per row.
                    let e = r.unwrap_err();
                    assert!(
                        matches!(e, kvrs::KvError::NotSupported(_))
                            && e.to_string().contains("v_head_dim=6 beside head_dim=4"),
                        "{e}"
                    );
                    attended = false;
                } else if j == 1 && !self.dtype.is_quantized() && self.dtype != DType::F32 {
                    // A float16/bfloat16 pool on the device takes queries of its dtype
                    // (tests/cuda_sim_attention.rs covers those); these are float32.
                    assert!(matches!(
                        r,
                        Err(kvrs::KvError::InvalidArgument { name: "q", .. })
                    ));
                    attended = false;
                } else {
                    r.unwrap();
                }
            }
            if !attended {
                continue;
            }
            let f = |b: &[u8]| -> Vec<f32> {
                b.chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            };
            let (a, b) = (f(&outs[0]), f(&outs[1]));
            let slack = self.rounding_slack(&chosen, layer, &q, &k, &v);
            for ((x, y), s) in a.iter().zip(&b).zip(&slack) {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + x.abs()) + s,
                    "{op:?} layer {layer}: {a:?} vs {b:?}"
                );
            }
        }
        for (pool, plan) in self.pools.iter_mut().zip(&plans) {
            pool.finish_forward(plan).unwrap();
        }
    }

    /// How far two float32 attentions over the same cache may drift apart through
    /// rounding alone, per output element `[n, 2 * H, D]`: each score `q.k` carries an
    /// error proportional to `sum |q||k|`, which moves the softmax weights by a factor up
    /// to `exp(err)`, and so the output by up to that times the largest `|v|` in the
    /// dimension (keys of 1e5 make this large; small keys and values keep it tight). The
    /// history comes from the host pool's dequantized gather (the superset of what the
    /// step attends to) plus a bound on this step's stored token.
    fn rounding_slack(
        &self,
        chosen: &[usize],
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) -> Vec<f32> {
        let (hq, group) = (2 * H, 2);
        let eps = f32::EPSILON;
        let sm_scale = 1.0 / (D as f32).sqrt();
        // Bounds |stored value| of an input row: fp8 rounds within 1/8 of a value, its
        // subnormals and int8's steps within a part of the row's largest value.
        let stored = |row: &[f32]| -> Vec<f32> {
            let top = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            row.iter()
                .map(|x| 1.125 * x.abs() + top / 100.0 + 0.01)
                .collect()
        };
        let dv = self.dv;
        let mut slack = vec![0f32; chosen.len() * hq * dv];
        for (t, &i) in chosen.iter().enumerate() {
            let id = self.live[i][0];
            let pool = &self.pools[0];
            let cap = pool.seq(id).unwrap().layer_len[layer].max(1);
            let (mut kf, mut vf) = (vec![0u8; 4 * H * cap * D], vec![0u8; 4 * H * cap * dv]);
            pool.gather(
                id,
                layer as i64,
                &mut tensor_mut(&mut kf, DType::F32, &[H, cap, D], Device::Cpu),
                &mut tensor_mut(&mut vf, DType::F32, &[H, cap, dv], Device::Cpu),
            )
            .unwrap();
            let floats = |b: &[u8]| -> Vec<f32> {
                b.chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()).abs())
                    .collect()
            };
            let (kh, vh) = (floats(&kf), floats(&vf));
            for h in 0..hq {
                let kv = h / group;
                let qrow = &q[(t * hq + h) * D..][..D];
                let dot = |krow: &[f32]| -> f32 {
                    qrow.iter().zip(krow).map(|(a, b)| a.abs() * b).sum::<f32>()
                };
                let new_k = stored(&k[(t * H + kv) * D..][..D]);
                let new_v = stored(&v[(t * H + kv) * dv..][..dv]);
                let worst = (0..cap)
                    .map(|p| dot(&kh[(kv * cap + p) * D..][..D]))
                    .fold(dot(&new_k), f32::max);
                let score_err = 4.0 * (D as f32 + 2.0) * eps * worst * sm_scale;
                let weight_err = (2.0 * score_err).min(30.0).exp_m1();
                for d in 0..dv {
                    let vmax = (0..cap)
                        .map(|p| vh[(kv * cap + p) * dv + d])
                        .fold(new_v[d], f32::max);
                    let sum_err = 1e-5 + 4.0 * (cap as f32 + 2.0) * eps;
                    slack[(t * hq + h) * dv + d] = 2.0 * (weight_err + sum_err) * vmax;
                }
            }
        }
        slack
    }

    /// Both pools hold the same codes, scales and dequantized values for every live
    /// sequence and layer, read through every path.
    fn check(&self) {
        let dv = self.dv;
        let size = |n: usize| H * n.max(1) * D;
        let vsize = |n: usize| H * n.max(1) * dv;
        for ids in &self.live {
            for layer in 0..L {
                // Raw codes: the host pool; the device pool into device and host buffers.
                let mut raws = Vec::new();
                for (j, dev) in [(0, Device::Cpu), (1, CUDA), (1, Device::Cpu)] {
                    let p = &self.pools[j];
                    let cap = p.seq(ids[j]).unwrap().layer_len[layer].max(1);
                    let es = self.dtype.size();
                    let (mut k, mut v) = (vec![0u8; es * size(cap)], vec![0u8; es * vsize(cap)]);
                    let got = p
                        .gather(
                            ids[j],
                            layer as i64,
                            &mut tensor_mut(&mut k, self.dtype, &[H, cap, D], dev),
                            &mut tensor_mut(&mut v, self.dtype, &[H, cap, dv], dev),
                        )
                        .unwrap();
                    let (mut kf, mut vf) = (vec![0u8; 4 * size(cap)], vec![0u8; 4 * vsize(cap)]);
                    p.gather(
                        ids[j],
                        layer as i64,
                        &mut tensor_mut(&mut kf, DType::F32, &[H, cap, D], dev),
                        &mut tensor_mut(&mut vf, DType::F32, &[H, cap, dv], dev),
                    )
                    .unwrap();
                    let scales = (self.dtype == DType::I8)
                        .then(|| p.gather_scales(ids[j], layer as i64).unwrap());
                    raws.push((got, k, v, kf, vf, scales));
                }
                for other in &raws[1..] {
                    let (got, k, v, kf, vf, s) = &raws[0];
                    assert_eq!(got, &other.0, "layer {layer}");
                    assert_eq!(k, &other.1, "K codes, layer {layer}");
                    assert_eq!(v, &other.2, "V codes, layer {layer}");
                    assert_eq!(kf, &other.3, "K floats, layer {layer}");
                    assert_eq!(vf, &other.4, "V floats, layer {layer}");
                    let bits = |s: &Option<(usize, usize, Vec<f32>, Vec<f32>)>| {
                        s.as_ref().map(|(a, b, k, v)| {
                            (
                                *a,
                                *b,
                                k.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            )
                        })
                    };
                    assert_eq!(bits(s), bits(&other.5), "scales, layer {layer}");
                }
            }
        }
        let stats = self.pools.each_ref().map(|p| p.stats());
        assert_eq!(stats[0].used_blocks, stats[1].used_blocks);
        assert_eq!(stats[0].bytes_total, stats[1].bytes_total);
    }
}

fn run(dtype: DType, layout: KvLayout, ops: &[Op]) {
    run_dims(dtype, layout, D, ops);
}

fn run_dims(dtype: DType, layout: KvLayout, dv: usize, ops: &[Op]) {
    let mut t = Twins::new(dtype, layout, dv);
    for op in ops {
        t.apply(op);
        t.check();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    #[test]
    fn e4m3_pool_on_cuda_equals_the_host(ops in prop::collection::vec(op(), 1..40)) {
        run(DType::F8E4M3, KvLayout::Nhd, &ops);
    }

    #[test]
    fn e5m2_pool_on_cuda_equals_the_host(ops in prop::collection::vec(op(), 1..40)) {
        run(DType::F8E5M2, KvLayout::Hnd, &ops);
    }

    #[test]
    fn int8_nhd_pool_on_cuda_equals_the_host(ops in prop::collection::vec(op(), 1..40)) {
        run(DType::I8, KvLayout::Nhd, &ops);
    }

    #[test]
    fn int8_hnd_pool_on_cuda_equals_the_host(ops in prop::collection::vec(op(), 1..40)) {
        run(DType::I8, KvLayout::Hnd, &ops);
    }

    #[test]
    fn int8_nhd_pool_of_two_head_sizes_on_cuda_equals_the_host(ops in prop::collection::vec(op(), 1..40)) {
        run_dims(DType::I8, KvLayout::Nhd, DV, &ops);
    }

    #[test]
    fn int8_hnd_pool_of_two_head_sizes_on_cuda_equals_the_host(ops in prop::collection::vec(op(), 1..40)) {
        run_dims(DType::I8, KvLayout::Hnd, DV, &ops);
    }

    #[test]
    fn e4m3_pool_of_two_head_sizes_on_cuda_equals_the_host(ops in prop::collection::vec(op(), 1..40)) {
        run_dims(DType::F8E4M3, KvLayout::Hnd, DV, &ops);
    }

    #[test]
    fn float_pools_of_two_head_sizes_on_cuda_equal_the_host(
        ops in prop::collection::vec(op(), 1..40),
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        hnd in any::<bool>(),
    ) {
        let layout = if hnd { KvLayout::Hnd } else { KvLayout::Nhd };
        run_dims(dtype, layout, DV, &ops);
    }
}

/// A contiguous fp8 cache with per-head scales: appends from device and host tensors and
/// dequantized reads into device and host tensors equal the host cache's, bit for bit;
/// for keys and values of one head size and of two (int8 then keeps a scale per
/// gcd(head_dim, v_head_dim) elements, and the captured append is refused on the device).
#[test]
fn contiguous_fp8_cache_with_scales_equals_the_host() {
    for (dtype, dv) in [DType::F8E4M3, DType::F8E5M2, DType::I8, DType::BF16]
        .into_iter()
        .flat_map(|d| [(d, D), (d, DV)])
    {
        let shape = CacheShape {
            num_layers: 2,
            num_kv_heads: H,
            head_dim: D,
            v_head_dim: dv,
            max_seq_len: 12,
        };
        let scales = || {
            let k: Vec<f32> = (0..2 * H).map(|i| 0.25 + i as f32).collect();
            KvScales::new(2, H, &k, &[3.0]).unwrap()
        };
        let mut outs = Vec::new();
        for (dev, input) in [
            (Device::Cpu, Device::Cpu),
            (CUDA, CUDA),
            (CUDA, Device::Cpu),
        ] {
            let mut c = CacheCore::new(shape, dtype, dev).unwrap();
            if dtype.fp8().is_some() {
                c = c.with_scales(scales()).unwrap();
            }
            for (step, n) in [5usize, 1, 3].into_iter().enumerate() {
                for layer in 0..2 {
                    let k = values(step as u32 * 10 + layer, n * H * D);
                    let v = values(step as u32 * 10 + layer + 5, n * H * dv);
                    c.append(
                        layer as i64,
                        &tensor(&k, &[n, H, D], input),
                        &tensor(&v, &[n, H, dv], input),
                    )
                    .unwrap();
                }
                c.advance(n as i64).unwrap();
            }
            let mut got = Vec::new();
            for layer in 0..2 {
                let (mut k, mut v) = (vec![0u8; 4 * H * 9 * D], vec![0u8; 4 * H * 9 * dv]);
                c.extract_block(
                    layer,
                    0,
                    9,
                    &mut tensor_mut(&mut k, DType::F32, &[H, 9, D], dev),
                    &mut tensor_mut(&mut v, DType::F32, &[H, 9, dv], dev),
                )
                .unwrap();
                got.push((k, v));
            }
            if dev == CUDA && dv != D {
                let (k, v) = (values(1, H * D), values(2, H * dv));
                let e = c
                    .append_at_counter(
                        0,
                        &tensor(&k, &[1, H, D], CUDA),
                        &tensor(&v, &[1, H, dv], CUDA),
                    )
                    .unwrap_err();
                assert!(
                    matches!(e, kvrs::KvError::NotSupported(_))
                        && e.to_string().contains("append_at_counter"),
                    "{e}"
                );
            }
            outs.push(got);
        }
        assert!(outs[0].iter().any(|(k, _)| k.iter().any(|&b| b != 0)));
        assert!(outs[0].iter().any(|(_, v)| v.iter().any(|&b| b != 0)));
        assert_eq!(outs[0], outs[1], "{dtype} dv={dv}: device inputs");
        assert_eq!(outs[0], outs[2], "{dtype} dv={dv}: host inputs");
    }
}

/// A CUDA pool's evicted blocks go to a host-memory tier and come back into another CUDA
/// pool (and a host pool) with the same codes, scales and values, for every storage dtype.
#[test]
fn cuda_pools_swap_blocks_through_a_host_tier() {
    use kvrs::tier::{HostTier, Tier};
    use kvrs::{HashKind, PrefixConfig, TierOptions};
    use std::sync::Arc;

    let prefix = || {
        Some(PrefixConfig {
            hash: HashKind::Blake3,
            seed: 99,
            partial_hits: true,
            events: false,
        })
    };
    for (dtype, dv) in [
        (DType::F16, D),
        (DType::F8E4M3, D),
        (DType::I8, D),
        (DType::F16, DV),
        (DType::I8, DV),
    ] {
        let shape = PagedShape {
            num_layers: L,
            num_kv_heads: H,
            head_dim: D,
            v_head_dim: dv,
            block_size: BS,
            num_blocks: 8,
            layout: KvLayout::Hnd,
        };
        let host = Arc::new(HostTier::new(1 << 20));
        let make = |dev: Device| {
            PoolCore::new(shape, dtype, dev, prefix())
                .unwrap()
                .with_tiers(
                    vec![host.clone() as Arc<dyn Tier>],
                    "m",
                    &TierOptions {
                        queue: 64,
                        ..TierOptions::default()
                    },
                )
                .unwrap()
        };
        let tokens: Vec<u32> = (0..13).collect();
        let mut src = make(CUDA);
        let id = src.new_sequence_with(&tokens, b"", b"");
        for layer in 0..L {
            let k = values(layer as u32, 13 * H * D);
            let v = values(layer as u32 + 9, 13 * H * dv);
            src.append(
                id,
                layer as i64,
                &tensor(&k, &[13, H, D], CUDA),
                &tensor(&v, &[13, H, dv], CUDA),
            )
            .unwrap();
        }
        src.advance(id, 13, Some(&tokens)).unwrap();
        // Positions 0..12 of every layer (the cached whole blocks), float32 [H, 12, D].
        let read = |p: &PoolCore, id: SeqId, dev: Device| {
            let mut out = Vec::new();
            for layer in 0..L {
                let (mut k, mut v) = (vec![0u8; 4 * H * 13 * D], vec![0u8; 4 * H * 13 * dv]);
                p.gather(
                    id,
                    layer as i64,
                    &mut tensor_mut(&mut k, DType::F32, &[H, 13, D], dev),
                    &mut tensor_mut(&mut v, DType::F32, &[H, 13, dv], dev),
                )
                .unwrap();
                let first12 = |x: &[u8], d: usize| -> Vec<u8> {
                    x.chunks(4 * 13 * d)
                        .flat_map(|head| head[..4 * 12 * d].to_vec())
                        .collect()
                };
                out.push((first12(&k, D), first12(&v, dv)));
            }
            out
        };
        let want = read(&src, id, CUDA);
        src.free_sequence(id).unwrap();
        assert_eq!(src.evict_all(), 3);
        src.flush_tiers();
        assert_eq!(
            host.counters()
                .stores
                .load(std::sync::atomic::Ordering::Relaxed),
            3
        );
        for dev in [CUDA, Device::Cpu] {
            let mut dst = make(dev);
            let again = dst.new_sequence_with(&tokens, b"", b"");
            let s = dst.seq(again).unwrap();
            assert_eq!(
                (s.num_cached_tokens, s.tier_tokens.as_slice()),
                (12, &[12][..]),
                "{dtype} {dev}"
            );
            assert_eq!(read(&dst, again, dev), want, "{dtype} dv={dv} on {dev}");
        }
    }
}
