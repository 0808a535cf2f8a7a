//! Property test of the tiled attention kernel (many query rows per KV head: prefill,
//! extend, wide GQA groups, MLA's heads over one latent) against a float64 reference over
//! the K/V the pool gathers: lengths that are not multiples of a tile, one-token prompts,
//! windows crossing tiles, GQA ratios 1 to 16, head sizes 64, 128, 192 and 256 and MLA's
//! 512 + 64 latent, every storage dtype, soft-capping, sinks and ALiBi; each case at
//! every vector level this CPU runs (portable, AVX2, AVX-512, AVX512-BF16), with
//! bfloat16 queries over bfloat16 storage (what takes `vdpbf16ps`).

use kvrs::unstable::{set_simd_level, simd_levels, PoolCore, TensorMut, TensorRef};
use kvrs::{Attention, AttnOptions, DType, Device, KvLayout, LayerKind, PagedShape};
use proptest::prelude::*;

fn tensor<'a>(v: &'a [f32], shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_f32(v, shape).unwrap()
}

/// A small deterministic generator of values in [-2, 2).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Head sizes: `(head_dim, v_head_dim, latent)`; a latent pool stores the 512-element
/// latent as its key and the 64-element rotary part as its value.
const HEADS: [(usize, usize, bool); 5] = [
    (64, 64, false),
    (128, 128, false),
    (192, 192, false),
    (256, 256, false),
    (512, 64, true),
];

/// What one query row sees: the gathered K/V of its head (`[len][dk]`, `[len][dv]`),
/// positions `first..first + len` of which `lo..=pos` are visible.
struct Seen<'a> {
    k: &'a [f32],
    v: &'a [f32],
    first: usize,
    lo: usize,
    pos: usize,
}

/// The reference output of one query row `q` of query head `qh` in f64: keys of `dk`
/// and values of `dv` elements; a latent key is the key followed by the value, and the
/// output sums the keys.
fn reference(
    q: &[f32],
    qh: usize,
    seen: &Seen<'_>,
    dims: (usize, usize, bool),
    opts: &AttnOptions<'_>,
) -> Vec<f64> {
    let (dk, dv, latent) = dims;
    let visible = seen.lo..=seen.pos;
    let key = |i: usize| -> Vec<f64> {
        let k = seen.k[i * dk..(i + 1) * dk].iter();
        let r = seen.v[i * dv..(i + 1) * dv].iter().filter(|_| latent);
        k.chain(r).map(|&x| x as f64).collect()
    };
    let scores: Vec<f64> = visible
        .clone()
        .map(|p| {
            let k = key(p - seen.first);
            let dot: f64 = q.iter().zip(&k).map(|(&a, b)| a as f64 * b).sum();
            let mut s = dot * opts.scale.unwrap() as f64;
            if let Some(c) = opts.softcap {
                s = c as f64 * (s / c as f64).tanh();
            }
            if let Some(a) = opts.alibi_slopes {
                s += a[qh] as f64 * (p as f64 - seen.pos as f64);
            }
            s
        })
        .collect();
    let sink = opts.sinks.map(|s| s[qh] as f64);
    let m = scores
        .iter()
        .cloned()
        .chain(sink)
        .fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let denom = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
    let out_len = if latent { dk } else { dv };
    let mut out = vec![0f64; out_len];
    for (wj, p) in w.iter().zip(visible) {
        let i = p - seen.first;
        let row = if latent {
            &seen.k[i * dk..(i + 1) * dk]
        } else {
            &seen.v[i * dv..(i + 1) * dv]
        };
        for (o, &x) in out.iter_mut().zip(row) {
            *o += wj * x as f64 / denom;
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn tiled_attention_matches_the_reference(
        dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16, DType::F8E4M3, DType::F8E5M2, DType::I8]),
        heads in prop::sample::select(HEADS.to_vec()),
        layout in prop::sample::select(vec![KvLayout::Nhd, KvLayout::Hnd]),
        block_size in prop::sample::select(vec![7usize, 16]),
        two_kv_heads in any::<bool>(),
        ratio in prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        sliding in any::<bool>(),
        window in 1usize..100,
        cached in prop::sample::select(vec![0usize, 1, 63, 64, 77]),
        new in prop::sample::select(vec![1usize, 2, 17, 64, 65, 130]),
        softcap in prop::option::of(1.0f32..5.0),
        use_sinks in any::<bool>(),
        use_alibi in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (head_dim, v_head_dim, latent) = heads;
        // MLA has one latent head; wide groups and big heads keep to one KV head and
        // fewer tokens, so that the f64 reference stays fast.
        let h = if two_kv_heads && !latent && ratio <= 4 { 2 } else { 1 };
        let new = if head_dim * ratio > 1024 { new.min(65) } else { new };
        let shape = PagedShape { num_layers: 1, num_kv_heads: h, head_dim, v_head_dim, block_size, num_blocks: 64, layout };
        let kind = if sliding { LayerKind::Sliding } else { LayerKind::Full };
        let attention = Attention { kinds: vec![kind], sliding_window: Some(window), chunk_size: None, swa_memory: 0 };
        let mut pool = PoolCore::with_attention(shape, attention.clone(), dtype, Device::Cpu, None).unwrap();
        let id = pool.new_sequence();
        for (i, n) in [cached, new].into_iter().enumerate() {
            let s = seed.wrapping_add(i as u64 * 2);
            let (k, v) = (values(s, n * h * head_dim), values(s ^ 0x5a, n * h * v_head_dim));
            pool.append(id, 0, &tensor(&k, &[n, h, head_dim]), &tensor(&v, &[n, h, v_head_dim])).unwrap();
            if i == 0 {
                pool.advance(id, n as i64, None).unwrap();
            }
        }
        let (dq, dout) = if latent { (head_dim + v_head_dim, head_dim) } else { (head_dim, v_head_dim) };
        let hq = h * ratio;
        let mut q = values(seed ^ 0x77, new * hq * dq);
        // Bfloat16 storage takes bfloat16 queries (the reference reads the same values).
        let q_bf16: Vec<u8> = if dtype == DType::BF16 {
            q.iter_mut().flat_map(|x| {
                let b = half::bf16::from_f32(*x);
                *x = b.to_f32();
                b.to_bits().to_le_bytes()
            }).collect()
        } else {
            Vec::new()
        };
        let sinks = values(seed ^ 0x99, hq);
        let slopes: Vec<f32> = (0..hq).map(|i| 0.5f32.powi(i as i32 % 8 + 1)).collect();
        let scale = 1.0 / (dq as f32).sqrt();
        let opts = AttnOptions {
            scale: Some(scale),
            softcap,
            sinks: use_sinks.then_some(&sinks[..]),
            alibi_slopes: use_alibi.then_some(&slopes[..]),
            latent,
            mask: None,
        };
        let q_t = if dtype == DType::BF16 {
            TensorRef::from_bytes(&q_bf16, DType::BF16, &[new, hq, dq]).unwrap()
        } else {
            tensor(&q, &[new, hq, dq])
        };
        let levels = simd_levels();
        let mut outs = Vec::new();
        for level in &levels {
            prop_assert_eq!(set_simd_level(Some(level)), Some(*level));
            let mut out = vec![0f32; new * hq * dout];
            let mut out_t = TensorMut::from_f32_mut(&mut out, &[new, hq, dout]).unwrap();
            pool.seq_attention(id, 0, &q_t, &mut out_t, &opts).unwrap();
            outs.push(out);
        }
        set_simd_level(None);

        let (first, end) = pool.layer_span(id, 0).unwrap();
        let len = end - first;
        let (mut gk, mut gv) = (vec![0f32; h * len * head_dim], vec![0f32; h * len * v_head_dim]);
        let mut gk_t = TensorMut::from_f32_mut(&mut gk, &[h, len, head_dim]).unwrap();
        let mut gv_t = TensorMut::from_f32_mut(&mut gv, &[h, len, v_head_dim]).unwrap();
        pool.gather(id, 0, &mut gk_t, &mut gv_t).unwrap();
        let tol = if dtype == DType::F32 { 1e-4 } else { 1e-3 };
        for t in 0..new {
            let pos = cached + t;
            let lo = attention.first_visible(kind, pos).max(first);
            for qh in 0..hq {
                let kh = qh / ratio;
                let seen = Seen {
                    k: &gk[kh * len * head_dim..(kh + 1) * len * head_dim],
                    v: &gv[kh * len * v_head_dim..(kh + 1) * len * v_head_dim],
                    first,
                    lo,
                    pos,
                };
                let row = &q[(t * hq + qh) * dq..(t * hq + qh + 1) * dq];
                let want = reference(row, qh, &seen, heads, &opts);
                for (level, out) in levels.iter().zip(&outs) {
                    let got = &out[(t * hq + qh) * dout..(t * hq + qh + 1) * dout];
                    for (e, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        prop_assert!((g as f64 - w).abs() <= tol * (1.0 + w.abs()),
                            "{level}: token {t} head {qh} elem {e}: {g} vs {w}");
                    }
                }
            }
        }
        pool.check_invariants().unwrap();
    }
}
