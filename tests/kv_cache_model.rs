//! Property test: random operation sequences on `CacheCore` against a plain `Vec` model.
//!
//! Values are multiples of 1/4 in [-8, 8], exact in every storage dtype, so the model
//! compares exactly for float32, float16 and bfloat16 storage alike.

use kvrs::unstable::{CacheCore, CacheShape, TensorMut, TensorRef};
use kvrs::{DType, Device, Kv, KvError};
use proptest::prelude::*;

const L: usize = 3;
const H: usize = 2;
const D: usize = 4;
const MAX: usize = 12;

/// The reference: full K/V arrays `[L][2][H][MAX][D]`, the committed length and each
/// layer's fill length.
#[derive(Clone, Debug, PartialEq)]
struct Model {
    data: Vec<f32>,
    seq_len: usize,
    layer_len: Vec<usize>,
}

impl Model {
    fn new() -> Self {
        Model {
            data: vec![0.0; L * 2 * H * MAX * D],
            seq_len: 0,
            layer_len: vec![0; L],
        }
    }
    fn at(l: usize, kv: usize, h: usize, p: usize) -> usize {
        (((l * 2 + kv) * H + h) * MAX + p) * D
    }
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        kv: usize,
        layer: i64,
        head: i64,
        pos: i64,
        seed: u32,
    },
    Append {
        layer: i64,
        n: usize,
        seed: u32,
    },
    Advance(i64),
    Truncate(i64),
    Clear,
    SetSeqLen(i64),
    Extract {
        layer: i64,
        start: i64,
        bs: i64,
    },
    Inject {
        layer: i64,
        start: i64,
        bs: i64,
        seed: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let layer = -1i64..=L as i64;
    prop_oneof![
        1 => (0..2usize, layer.clone(), -1i64..=H as i64, -1i64..=MAX as i64, any::<u32>())
            .prop_map(|(kv, layer, head, pos, seed)| Op::Store { kv, layer, head, pos, seed }),
        4 => (layer.clone(), 0..6usize, any::<u32>()).prop_map(|(layer, n, seed)| Op::Append { layer, n, seed }),
        3 => (-1i64..4).prop_map(Op::Advance),
        1 => (-1i64..=MAX as i64 + 2).prop_map(Op::Truncate),
        1 => Just(Op::Clear),
        1 => (-1i64..=MAX as i64 + 2).prop_map(Op::SetSeqLen),
        1 => (layer.clone(), -1i64..=MAX as i64, -1i64..6).prop_map(|(layer, start, bs)| Op::Extract { layer, start, bs }),
        1 => (layer, -1i64..=MAX as i64, -1i64..6, any::<u32>())
            .prop_map(|(layer, start, bs, seed)| Op::Inject { layer, start, bs, seed }),
    ]
}

/// Deterministic exact values from a seed.
fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((seed.wrapping_mul(2654435761).wrapping_add(i as u32 * 40503)) % 65) as f32 / 4.0 - 8.0
        })
        .collect()
}

thread_local! {
    /// The device of the run in progress: the test's tensors are said to live there (on
    /// the simulated CUDA device, host memory is device memory).
    static DEVICE: std::cell::Cell<Device> = const { std::cell::Cell::new(Device::Cpu) };
}

fn tensor<'a>(v: &'a [f32], shape: &[usize]) -> TensorRef<'a> {
    let t = TensorRef::from_f32(v, shape).unwrap();
    t.on(DEVICE.get())
}

fn tensor_mut<'a>(v: &'a mut [f32], shape: &[usize]) -> TensorMut<'a> {
    TensorMut::from_f32_mut(v, shape).unwrap().on(DEVICE.get())
}

fn snapshot(c: &CacheCore) -> Model {
    // extract_block converts to the destination's dtype, so a float32 read sees every
    // storage dtype's exact values.
    let mut m = Model::new();
    for l in 0..L {
        let (mut k, mut v) = (vec![0f32; H * MAX * D], vec![0f32; H * MAX * D]);
        c.extract_block(
            l as i64,
            0,
            MAX as i64,
            &mut tensor_mut(&mut k, &[H, MAX, D]),
            &mut tensor_mut(&mut v, &[H, MAX, D]),
        )
        .unwrap();
        for (kv, buf) in [(0, &k), (1, &v)] {
            let base = Model::at(l, kv, 0, 0);
            m.data[base..base + H * MAX * D].copy_from_slice(buf);
        }
        m.layer_len[l] = c.layer_len(l);
    }
    m.seq_len = c.seq_len();
    m
}

/// Applies `op` to the model; `Err(())` means the cache must refuse it and stay unchanged.
fn apply_model(m: &mut Model, op: &Op) -> Result<(), ()> {
    let ok_layer = |l: i64| (0..L as i64).contains(&l);
    match *op {
        Op::Store {
            kv,
            layer,
            head,
            pos,
            seed,
        } => {
            if !ok_layer(layer) || !(0..H as i64).contains(&head) || !(0..MAX as i64).contains(&pos)
            {
                return Err(());
            }
            let (l, pos) = (layer as usize, pos as usize);
            // Positions the store brings into the layer start as zeros (K and V, every head).
            for p in m.layer_len[l]..=pos {
                for side in 0..2 {
                    for h in 0..H {
                        let at = Model::at(l, side, h, p);
                        m.data[at..at + D].fill(0.0);
                    }
                }
            }
            m.layer_len[l] = m.layer_len[l].max(pos + 1);
            let at = Model::at(l, kv, head as usize, pos);
            m.data[at..at + D].copy_from_slice(&values(seed, D));
        }
        Op::Append { layer, n, seed } => {
            if !ok_layer(layer) {
                return Err(());
            }
            let l = layer as usize;
            if m.layer_len[l] + n > MAX {
                return Err(());
            }
            let (k, v) = (values(seed, n * H * D), values(seed ^ 0xffff, n * H * D));
            for t in 0..n {
                for h in 0..H {
                    let src = (t * H + h) * D;
                    let k_at = Model::at(l, 0, h, m.layer_len[l] + t);
                    let v_at = Model::at(l, 1, h, m.layer_len[l] + t);
                    m.data[k_at..k_at + D].copy_from_slice(&k[src..src + D]);
                    m.data[v_at..v_at + D].copy_from_slice(&v[src..src + D]);
                }
            }
            m.layer_len[l] += n;
        }
        Op::Advance(n) => {
            if n < 0 || m.layer_len.iter().any(|&l| l < m.seq_len + n as usize) {
                return Err(());
            }
            m.seq_len += n as usize;
        }
        Op::Truncate(n) => {
            if n < 0 {
                return Err(());
            }
            if (n as usize) < m.seq_len {
                m.seq_len = n as usize;
                m.layer_len
                    .iter_mut()
                    .for_each(|l| *l = (*l).min(n as usize));
            }
        }
        Op::Clear => {
            m.seq_len = 0;
            m.layer_len.fill(0);
        }
        Op::SetSeqLen(n) => {
            if n < 0 {
                return Err(());
            }
            m.seq_len = (n as usize).min(MAX);
            m.layer_len.fill(m.seq_len);
        }
        Op::Extract { layer, start, bs } => {
            if !ok_layer(layer) || !(0..MAX as i64).contains(&start) || bs < 1 {
                return Err(());
            }
        }
        Op::Inject {
            layer,
            start,
            bs,
            seed,
        } => {
            if !ok_layer(layer) || !(0..MAX as i64).contains(&start) || bs < 1 {
                return Err(());
            }
            let (bs, start) = (bs as usize, start as usize);
            let (k, v) = (values(seed, H * bs * D), values(seed ^ 0xffff, H * bs * D));
            for h in 0..H {
                for p in 0..bs {
                    if start + p >= MAX {
                        continue;
                    }
                    let src = (h * bs + p) * D;
                    let k_at = Model::at(layer as usize, 0, h, start + p);
                    let v_at = Model::at(layer as usize, 1, h, start + p);
                    m.data[k_at..k_at + D].copy_from_slice(&k[src..src + D]);
                    m.data[v_at..v_at + D].copy_from_slice(&v[src..src + D]);
                }
            }
        }
    }
    Ok(())
}

fn apply_cache(c: &mut CacheCore, m: &Model, op: &Op) -> Result<(), KvError> {
    match *op {
        Op::Store {
            kv,
            layer,
            head,
            pos,
            seed,
        } => {
            let v = values(seed, D);
            let which = if kv == 0 { Kv::Key } else { Kv::Value };
            c.store(which, layer, head, pos, &tensor(&v, &[D]))
        }
        Op::Append { layer, n, seed } => {
            let (k, v) = (values(seed, n * H * D), values(seed ^ 0xffff, n * H * D));
            let expect_start = if (0..L as i64).contains(&layer) {
                m.layer_len[layer as usize]
            } else {
                0
            };
            let start = c.append(layer, &tensor(&k, &[n, H, D]), &tensor(&v, &[n, H, D]))?;
            assert_eq!(start, expect_start);
            Ok(())
        }
        Op::Advance(n) => c.advance(n),
        Op::Truncate(n) => c.truncate(n),
        Op::Clear => {
            c.clear();
            Ok(())
        }
        Op::SetSeqLen(n) => c.set_seq_len(n),
        Op::Extract { layer, start, bs } => {
            let b = bs.max(1) as usize;
            let (mut k, mut v) = (vec![f32::NAN; H * b * D], vec![f32::NAN; H * b * D]);
            let (mut tk, mut tv) = (
                tensor_mut(&mut k, &[H, b, D]),
                tensor_mut(&mut v, &[H, b, D]),
            );
            c.extract_block(layer, start, bs, &mut tk, &mut tv)?;
            for h in 0..H {
                for p in 0..b {
                    for d in 0..D {
                        let i = (h * b + p) * D + d;
                        let pos = start as usize + p;
                        let (ek, ev) = if pos < MAX {
                            (
                                m.data[Model::at(layer as usize, 0, h, pos) + d],
                                m.data[Model::at(layer as usize, 1, h, pos) + d],
                            )
                        } else {
                            (0.0, 0.0)
                        };
                        assert_eq!((k[i], v[i]), (ek, ev), "extract h={h} p={pos} d={d}");
                    }
                }
            }
            Ok(())
        }
        Op::Inject {
            layer,
            start,
            bs,
            seed,
        } => {
            let b = bs.max(1) as usize;
            let (k, v) = (values(seed, H * b * D), values(seed ^ 0xffff, H * b * D));
            c.inject_block(
                layer,
                start,
                bs,
                &tensor(&k, &[H, b, D]),
                &tensor(&v, &[H, b, D]),
            )
        }
    }
}

fn run(device: Device, dtype: DType, ops: &[Op]) {
    DEVICE.set(device);
    let shape = CacheShape {
        num_layers: L,
        num_kv_heads: H,
        head_dim: D,
        v_head_dim: D,
        max_seq_len: MAX,
    };
    let mut cache = CacheCore::new(shape, dtype, device).unwrap();
    let mut model = Model::new();
    for op in ops {
        let before = model.clone();
        let expected = apply_model(&mut model, op);
        let got = apply_cache(&mut cache, &before, op);
        assert_eq!(got.is_ok(), expected.is_ok(), "{op:?}: cache said {got:?}");
        let now = snapshot(&cache);
        assert_eq!(now, model, "after {op:?}");
        assert!(cache.layer_len(0) >= cache.seq_len());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn float32_cache_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(Device::Cpu, DType::F32, &ops);
    }

    #[test]
    fn float16_cache_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(Device::Cpu, DType::F16, &ops);
    }

    #[test]
    fn bfloat16_cache_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(Device::Cpu, DType::BF16, &ops);
    }
}

// The same runs on the simulated CUDA device (`cargo test --features cuda-sim`).
#[cfg(feature = "cuda-sim")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn float32_cache_on_cuda_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(Device::Cuda(0), DType::F32, &ops);
    }

    #[test]
    fn float16_cache_on_cuda_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(Device::Cuda(0), DType::F16, &ops);
    }

    #[test]
    fn bfloat16_cache_on_cuda_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        run(Device::Cuda(0), DType::BF16, &ops);
    }
}
