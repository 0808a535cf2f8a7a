//! Property test: the attention core over a pool's blocks (ragged batches of several
//! sequences, forks sharing blocks, full / sliding / chunked layers, GQA, every storage
//! dtype, soft-capping and sinks) against a plain f64 reference over the K/V the pool
//! gathers for each sequence.

use kvrs::unstable::{PoolCore, TensorMut, TensorRef};
use kvrs::{Attention, AttnOptions, DType, Device, KvLayout, LayerKind, PagedShape};
use proptest::prelude::*;

const D: usize = 16;

fn tensor<'a>(v: &'a [f32], shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_f32(v, shape).unwrap()
}

/// A small deterministic generator of test values.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Attention of one query row (`[hq][D]`) over keys/values `[h][len][D]` at positions
/// `first..first + len`, seeing `lo..=pos`.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    h: usize,
    len: usize,
    first: usize,
    lo: usize,
    pos: usize,
    softcap: Option<f32>,
    sinks: Option<&[f32]>,
) -> Vec<f64> {
    let hq = q.len() / D;
    let g = hq / h;
    let mut out = vec![0f64; hq * D];
    for qh in 0..hq {
        let kh = qh / g;
        let scores: Vec<f64> = (lo..=pos)
            .map(|p| {
                let i = p - first;
                let mut s: f64 = (0..D)
                    .map(|e| q[qh * D + e] as f64 * k[(kh * len + i) * D + e] as f64)
                    .sum::<f64>()
                    / (D as f64).sqrt();
                if let Some(c) = softcap {
                    s = c as f64 * (s / c as f64).tanh();
                }
                s
            })
            .collect();
        let mut m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if let Some(s) = sinks {
            m = m.max(s[qh] as f64);
        }
        let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let denom = w.iter().sum::<f64>() + sinks.map_or(0.0, |s| (s[qh] as f64 - m).exp());
        for (j, p) in (lo..=pos).enumerate() {
            let i = p - first;
            for e in 0..D {
                out[qh * D + e] += w[j] * v[(kh * len + i) * D + e] as f64 / denom;
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn forward_attention_matches_the_reference(
        dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16, DType::F8E4M3, DType::F8E5M2, DType::I8]),
        layout in prop::sample::select(vec![KvLayout::Nhd, KvLayout::Hnd]),
        block_size in prop::sample::select(vec![1usize, 4, 16]),
        h in 1usize..3,
        ratio in prop::sample::select(vec![1usize, 4, 8]),
        kind in prop::sample::select(vec![LayerKind::Full, LayerKind::Sliding, LayerKind::Chunked]),
        window in 1usize..9,
        histories in prop::collection::vec(0usize..40, 1..4),
        fork in any::<bool>(),
        new in prop::collection::vec(1usize..20, 4),
        softcap in prop::option::of(1.0f32..5.0),
        use_sinks in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let shape = PagedShape { num_layers: 1, num_kv_heads: h, head_dim: D, v_head_dim: D, block_size, num_blocks: 512, layout };
        let attention = Attention {
            kinds: vec![kind],
            sliding_window: Some(window),
            chunk_size: Some(window),
            swa_memory: 0,
        };
        let mut pool = PoolCore::with_attention(shape, attention.clone(), dtype, Device::Cpu, None).unwrap();
        let mut ids = Vec::new();
        for (i, &n) in histories.iter().enumerate() {
            let id = pool.new_sequence();
            let (k, v) = (values(seed + 2 * i as u64, n * h * D), values(seed + 2 * i as u64 + 1, n * h * D));
            pool.append(id, 0, &tensor(&k, &[n, h, D]), &tensor(&v, &[n, h, D])).unwrap();
            pool.advance(id, n as i64, None).unwrap();
            ids.push(id);
        }
        if fork {
            let f = pool.fork(ids[0]).unwrap();
            ids.push(f);
        }
        // The batch: each sequence's new tokens, interleaved round-robin.
        let counts: Vec<usize> = ids.iter().enumerate().map(|(i, _)| new[i % new.len()]).collect();
        let mut token_seqs = Vec::new();
        for round in 0..*counts.iter().max().unwrap() {
            for (i, &id) in ids.iter().enumerate() {
                if round < counts[i] {
                    token_seqs.push(id);
                }
            }
        }
        let n = token_seqs.len();
        let plan = pool.start_forward(&token_seqs, None, None).unwrap();
        let (k, v) = (values(seed ^ 0xa5, n * h * D), values(seed ^ 0x5a, n * h * D));
        pool.write(0, &tensor(&k, &[n, h, D]), &tensor(&v, &[n, h, D]), plan.group_slots(0)).unwrap();
        let hq = h * ratio;
        let q = values(seed ^ 0x77, n * hq * D);
        let sinks = values(seed ^ 0x99, hq);
        let opts = AttnOptions { softcap, sinks: use_sinks.then_some(&sinks[..]), ..Default::default() };
        let mut out = vec![0f32; n * hq * D];
        let mut out_t = TensorMut::from_f32_mut(&mut out, &[n, hq, D]).unwrap();
        pool.forward_attention(&plan, 0, &tensor(&q, &[n, hq, D]), &mut out_t, &opts).unwrap();
        let tol = match dtype { DType::F32 => 1e-4, _ => 1e-3 };
        for (t, (&k_seq, &pos)) in plan.token_seq.iter().zip(&plan.positions).enumerate() {
            let id = plan.seqs[k_seq].0;
            let (first, end) = pool.layer_span(id, 0).unwrap();
            let len = end - first;
            let (mut gk, mut gv) = (vec![0f32; h * len * D], vec![0f32; h * len * D]);
            let mut gk_t = TensorMut::from_f32_mut(&mut gk, &[h, len, D]).unwrap();
            let mut gv_t = TensorMut::from_f32_mut(&mut gv, &[h, len, D]).unwrap();
            pool.gather(id, 0, &mut gk_t, &mut gv_t).unwrap();
            let lo = attention.first_visible(kind, pos).max(first);
            let want = reference(&q[t * hq * D..(t + 1) * hq * D], &gk, &gv, h, len, first, lo, pos,
                                 softcap, use_sinks.then_some(&sinks[..]));
            for (i, w) in want.iter().enumerate() {
                let got = out[t * hq * D + i] as f64;
                prop_assert!((got - w).abs() <= tol * (1.0 + w.abs()), "token {t} elem {i}: {got} vs {w}");
            }
        }
        pool.finish_forward(&plan).unwrap();
        pool.check_invariants().unwrap();
    }
}
