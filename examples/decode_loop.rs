//! A decode loop over the contiguous `KvCache`: prefill a prompt, then generate one
//! token at a time, each layer appending its K/V and attending over its history in
//! place. The "model" is a fixed random projection (the cache does not care where K, V
//! and Q come from); what is real is the cache traffic and the attention.
//!
//!     cargo run --release --example decode_loop

use std::time::Instant;

use half::f16;
use kvrs::KvCache;

const LAYERS: usize = 8;
const KV_HEADS: usize = 8;
const Q_HEADS: usize = 32;
const HEAD_DIM: usize = 64;
const MAX_SEQ_LEN: usize = 1024;
const PROMPT: usize = 256;
const NEW_TOKENS: usize = 256;

/// A reproducible pseudo-random value in [-1, 1) for `(layer, pos, i)`.
fn noise(layer: usize, pos: usize, i: usize) -> f32 {
    let mut h = (layer as u64) << 48 ^ (pos as u64) << 20 ^ i as u64;
    h = h.wrapping_mul(0x9e3779b97f4a7c15);
    h ^= h >> 29;
    (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// `n` tokens' worth of `[n, heads, HEAD_DIM]` values from position `start`.
fn project(layer: usize, start: usize, n: usize, heads: usize, salt: usize) -> Vec<f16> {
    (0..n * heads * HEAD_DIM)
        .map(|i| {
            let pos = start + i / (heads * HEAD_DIM);
            f16::from_f32(noise(layer * 3 + salt, pos, i % (heads * HEAD_DIM)))
        })
        .collect()
}

/// One forward step of `n` tokens at `start`: every layer appends K/V and attends.
fn forward(
    cache: &mut KvCache<f16>,
    start: usize,
    n: usize,
    out: &mut Vec<f16>,
) -> kvrs::Result<()> {
    out.resize(n * Q_HEADS * HEAD_DIM, f16::ZERO);
    for layer in 0..LAYERS {
        let k = project(layer, start, n, KV_HEADS, 0);
        let v = project(layer, start, n, KV_HEADS, 1);
        let q = project(layer, start, n, Q_HEADS, 2);
        cache.append(layer, &k, &v)?;
        cache.attention(layer, Q_HEADS, &q, out)?;
    }
    cache.advance_by(n)
}

fn main() -> kvrs::Result<()> {
    let mut cache = KvCache::<f16>::zeros(LAYERS, KV_HEADS, HEAD_DIM, MAX_SEQ_LEN);
    let mut out = Vec::new();

    let t = Instant::now();
    forward(&mut cache, 0, PROMPT, &mut out)?;
    let prefill = t.elapsed();

    let t = Instant::now();
    for _ in 0..NEW_TOKENS {
        let pos = cache.seq_len();
        forward(&mut cache, pos, 1, &mut out)?;
    }
    let decode = t.elapsed();

    // The last token's output, head 0: a weighted mean of values, so within [-1, 1].
    let head0: Vec<f32> = out[..4].iter().map(|x| x.to_f32()).collect();
    println!(
        "cache: {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_DIM}, f16, {} MiB preallocated",
        cache.memory_bytes() >> 20
    );
    println!(
        "prefill: {PROMPT} tokens in {:.1} ms",
        prefill.as_secs_f64() * 1e3
    );
    println!(
        "decode: {NEW_TOKENS} tokens in {:.1} ms ({:.0} tokens/s), seq_len {}",
        decode.as_secs_f64() * 1e3,
        NEW_TOKENS as f64 / decode.as_secs_f64(),
        cache.seq_len()
    );
    println!("last output, head 0, first dims: {head0:?}");
    assert_eq!(cache.seq_len(), PROMPT + NEW_TOKENS);
    assert!(head0.iter().all(|x| x.abs() <= 1.0));

    // Speculative decoding rolls rejected tokens back.
    cache.truncate(cache.seq_len() - 4)?;
    println!("after rolling back 4 tokens: seq_len {}", cache.seq_len());
    Ok(())
}
