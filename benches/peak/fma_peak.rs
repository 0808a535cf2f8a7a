//! The CPU's measured float32 FMA peak: every thread runs independent chains of 8-lane
//! AVX2 fused multiply-adds (enough of them to cover the latency on both of a core's
//! FMA pipes), and the rate is their flops (2 per lane) over the wall time.
//!
//!     rustc -O -C target-cpu=native benches/peak/fma_peak.rs -o /tmp/fma_peak
//!     /tmp/fma_peak [threads]       # prints "<threads> <GFLOP/s>"
//!
//! `benches/bench_attention.py` compiles and runs it to state its GFLOP/s against it.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::time::Instant;

/// Independent accumulator chains per thread: FMA latency (4 cycles on Zen 3, Ice Lake)
/// times the two FMA pipes, with slack.
const CHAINS: usize = 12;

/// Iterations of all chains per thread and round.
const ITERS: usize = 20_000_000;

/// Runs the chains and returns a value that depends on every result (so that none is
/// optimised away).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chains(seed: f32) -> f32 {
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    for _ in 0..ITERS {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut sum = _mm256_setzero_ps();
    for x in acc {
        sum = _mm256_add_ps(sum, x);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    lanes.iter().sum()
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        let mut best = 0f64;
        for _ in 0..3 {
            let t0 = Instant::now();
            let handles: Vec<_> = (0..threads)
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                .map(|i| std::thread::spawn(move || unsafe { chains(i as f32) }))
                .collect();
            let check: f32 = handles.into_iter().map(|h| h.join().unwrap()).sum();
            let secs = t0.elapsed().as_secs_f64();
            let flops = (threads * ITERS * CHAINS * 8 * 2) as f64;
            assert!(check.is_finite());
            best = best.max(flops / secs / 1e9);
        }
        println!("{threads} {best:.1}");
        return;
    }
    eprintln!("this CPU has no AVX2 + FMA");
    std::process::exit(1);
}
