//! A paged batch: eight requests share a system prompt in one `BlockPool` with prefix
//! caching, decode together, and one of them forks (parallel sampling). The pool holds
//! each shared block once; the stats say what that saves against one contiguous cache
//! per request.
//!
//!     cargo run --release --example paged_batch

use half::f16;
use kvrs::{BlockPool, PoolConfig, SeqId};

const LAYERS: usize = 4;
const KV_HEADS: usize = 4;
const Q_HEADS: usize = 16;
const HEAD_DIM: usize = 64;
const BLOCK: usize = 16;

/// K or V of every head at `pos` given the tokens up to it, as a model would compute
/// them: a function of the prefix, so cached blocks are right for any request sharing it.
fn kv_at(tokens: &[u32], pos: usize, layer: usize, salt: u64) -> Vec<f16> {
    let h = tokens[..=pos].iter().fold(0xcbf29ce484222325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x100000001b3)
    });
    (0..KV_HEADS * HEAD_DIM)
        .map(|i| {
            let x = (h ^ salt << 56 ^ (layer * 4096 + i) as u64).wrapping_mul(0x9e3779b97f4a7c15);
            f16::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

/// Writes and commits positions `from..tokens.len()` of `seq` in every layer, then
/// attends with the new tokens' queries.
fn step(pool: &mut BlockPool<f16>, seq: SeqId, tokens: &[u32], from: usize) -> kvrs::Result<()> {
    let n = tokens.len() - from;
    let q = vec![f16::from_f32(0.1); n * Q_HEADS * HEAD_DIM];
    let mut out = vec![f16::ZERO; q.len()];
    for layer in 0..LAYERS {
        let k: Vec<f16> = (from..tokens.len())
            .flat_map(|p| kv_at(tokens, p, layer, 0))
            .collect();
        let v: Vec<f16> = (from..tokens.len())
            .flat_map(|p| kv_at(tokens, p, layer, 1))
            .collect();
        pool.append(seq, layer, &k, &v)?;
        pool.attention(seq, layer, Q_HEADS, &q, &mut out)?;
    }
    pool.advance_tokens(seq, &tokens[from..])
}

fn main() -> kvrs::Result<()> {
    let config = PoolConfig::new(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, 256).prefix_caching(0x5eed);
    let mut pool = BlockPool::<f16>::new(config)?;
    let system: Vec<u32> = (1..=200).collect();

    let mut requests: Vec<(SeqId, Vec<u32>)> = Vec::new();
    let mut computed = 0;
    for r in 0..8u32 {
        let mut prompt = system.clone();
        prompt.extend((0..20).map(|i| 1000 + r * 100 + i));
        let seq = pool.new_sequence_with_prompt(&prompt);
        let cached = pool.num_cached_tokens(seq)?;
        step(&mut pool, seq, &prompt, cached)?;
        computed += prompt.len() - cached;
        println!(
            "request {r}: {} prompt tokens, {cached} from the prefix cache",
            prompt.len()
        );
        requests.push((seq, prompt));
    }

    // Parallel sampling: request 0 forks; the fork shares every block until it writes.
    let (first, tokens) = requests[0].clone();
    let fork = pool.fork(first)?;
    requests.push((fork, tokens));

    for t in 0..32u32 {
        for (i, (seq, tokens)) in requests.iter_mut().enumerate() {
            tokens.push(2000 + t * 16 + i as u32);
            step(&mut pool, *seq, tokens, tokens.len() - 1)?;
        }
    }

    let stats = pool.stats();
    let tokens: usize = requests.iter().map(|(_, t)| t.len()).sum();
    let contiguous = tokens * 2 * LAYERS * KV_HEADS * HEAD_DIM * 2;
    println!(
        "{} sequences, {tokens} tokens; prompt tokens computed: {computed} of {}",
        stats.num_sequences,
        8 * 220
    );
    println!(
        "pool: {} of {} blocks used, {} KiB (one contiguous cache per sequence, exactly sized: {} KiB)",
        stats.used_blocks,
        stats.num_blocks,
        stats.bytes_used >> 10,
        contiguous >> 10
    );
    for (seq, tokens) in &requests {
        assert_eq!(pool.seq_len(*seq)?, tokens.len());
        let (k, _) = pool.read(*seq, LAYERS - 1)?;
        let last = tokens.len() - 1;
        // Head 0 of the last position (read is head-major: [heads, len, dim]).
        assert_eq!(
            k[last * HEAD_DIM..(last + 1) * HEAD_DIM],
            kv_at(tokens, last, LAYERS - 1, 0)[..HEAD_DIM]
        );
    }
    for (seq, _) in requests {
        pool.free(seq)?;
    }
    println!(
        "all freed: {} free blocks (cached ones stay findable)",
        pool.free_blocks()
    );
    Ok(())
}
