//! The AVX-512 blocks of the tiled kernel's products ([`super::microkernel`]'s shape,
//! `C[rows][lanes] (+)= A · B`, the query rows along the lanes):
//!
//! - [`columns`]: f32 with AVX-512 F, blocks of up to 8 rows x 32 lanes in 16 `zmm`
//!   accumulators (two vector loads and eight broadcasts feed sixteen FMAs per step),
//! - [`scores_bf16`]: bfloat16 scores with AVX512-BF16, `vdpbf16ps` taking two steps
//!   of `k` per instruction: `A` is the key tile as stored (a broadcast of 32 bits is a
//!   pair of consecutive elements of a key) and `B` the queries packed in pairs
//!   (`[k / 2][lanes]`, [`pack_pair`]). The products of two bfloat16s are exact in f32
//!   and summed in f32, so the scores are those of the f32 kernel up to the order of
//!   the sums (bfloat16 subnormals, below 1e-38, count as 0).
//!
//! Both leave a last block of 8 lanes to 256-bit registers.

use std::arch::x86_64::*;

use super::microkernel::{Block, Product, LANES};

/// f32 lanes of one AVX-512 vector.
const WIDE: usize = 16;

/// Rows of `C` an AVX-512 block holds in registers.
const MR: usize = 8;

/// The block columns of 32 and 16 lanes of `p` in AVX-512 registers; returns the first
/// lane left (a last 8, or `p.lanes`).
///
/// # Safety
/// As for [`super::microkernel::product`] (one part of `k`), on a CPU with AVX-512 F.
#[inline(always)]
pub(super) unsafe fn columns(p: &Product) -> usize {
    let mut l0 = 0;
    while p.lanes - l0 >= WIDE {
        let nv = if p.lanes - l0 >= 2 * WIDE { 2 } else { 1 };
        let mut r0 = 0;
        while r0 < p.rows {
            let mr = MR.min(p.rows - r0);
            let blk = Block {
                a: p.a.ptr.add(r0 * p.a.rs),
                b: p.b.add(l0),
                c: p.c.add(r0 * p.c_rs + l0),
            };
            macro_rules! rows {
                ($nv:literal) => {
                    match mr {
                        1 => block::<1, $nv>(p, blk),
                        2 => block::<2, $nv>(p, blk),
                        3 => block::<3, $nv>(p, blk),
                        4 => block::<4, $nv>(p, blk),
                        5 => block::<5, $nv>(p, blk),
                        6 => block::<6, $nv>(p, blk),
                        7 => block::<7, $nv>(p, blk),
                        _ => block::<8, $nv>(p, blk),
                    }
                };
            }
            if nv == 2 {
                rows!(2)
            } else {
                rows!(1)
            }
            r0 += mr;
        }
        l0 += nv * WIDE;
    }
    l0
}

/// One f32 block of `R` rows x `NV` vectors of 16 lanes.
#[inline(always)]
unsafe fn block<const R: usize, const NV: usize>(p: &Product, blk: Block) {
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    if p.accumulate {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (v, x) in acc.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(blk.c.add(r * p.c_rs + v * WIDE));
            }
        }
    }
    let (rs, ks) = (p.a.rs, p.a.ks);
    let (mut a, mut b) = (blk.a, blk.b);
    for _ in 0..p.k {
        let mut bv = [_mm512_setzero_ps(); NV];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(b.add(v * WIDE));
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_ps(*a.add(r * rs));
            for (acc, bv) in acc.iter_mut().zip(&bv) {
                *acc = _mm512_fmadd_ps(x, *bv, *acc);
            }
        }
        a = a.add(ks);
        b = b.add(p.b_ks);
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, x) in acc.iter().enumerate() {
            _mm512_storeu_ps(blk.c.add(r * p.c_rs + v * WIDE), *x);
        }
    }
}

/// Two bfloat16 elements (their bits) as one 32-bit lane of a `vdpbf16ps` operand, the
/// first in the low half.
#[inline(always)]
pub(super) fn pack_pair(first: f32, second: f32) -> u32 {
    (first.to_bits() >> 16) | (second.to_bits() & 0xffff_0000)
}

/// The bfloat16 product `C = A · B`, overwriting `C` (`[rows][lanes]`, rows `lanes`
/// apart).
#[derive(Clone, Copy, Debug)]
pub(super) struct Bf16Product {
    /// `A[row][k]` at `a + row * a_rs + k` (bfloat16 bits).
    pub a: *const u16,
    pub a_rs: usize,
    /// `B` in pairs: `[k / 2][lanes]` ([`pack_pair`]).
    pub b: *const u32,
    pub c: *mut f32,
    pub rows: usize,
    /// A multiple of 8.
    pub lanes: usize,
    /// Pairs of `k` (`k` is even).
    pub pairs: usize,
}

/// Computes `p` with `vdpbf16ps`.
///
/// # Safety
/// Every element the product names must be readable (`A`, `B`) or writable (`C`), `C`
/// overlapping neither; the CPU must have AVX-512 F, VL and BF16.
#[inline(always)]
pub(super) unsafe fn scores_bf16(p: &Bf16Product) {
    debug_assert!(p.lanes.is_multiple_of(LANES));
    let mut l0 = 0;
    while l0 < p.lanes {
        let left = p.lanes - l0;
        let mut r0 = 0;
        while r0 < p.rows {
            let mr = MR.min(p.rows - r0);
            let (a, c) = (p.a.add(r0 * p.a_rs), p.c.add(r0 * p.lanes + l0));
            let b = p.b.add(l0);
            macro_rules! rows {
                ($f:ident, $($nv:literal)?) => {
                    match mr {
                        1 => $f::<1 $(, $nv)?>(p, a, b, c),
                        2 => $f::<2 $(, $nv)?>(p, a, b, c),
                        3 => $f::<3 $(, $nv)?>(p, a, b, c),
                        4 => $f::<4 $(, $nv)?>(p, a, b, c),
                        5 => $f::<5 $(, $nv)?>(p, a, b, c),
                        6 => $f::<6 $(, $nv)?>(p, a, b, c),
                        7 => $f::<7 $(, $nv)?>(p, a, b, c),
                        _ => $f::<8 $(, $nv)?>(p, a, b, c),
                    }
                };
            }
            if left >= 2 * WIDE {
                rows!(bf16_block, 2)
            } else if left >= WIDE {
                rows!(bf16_block, 1)
            } else {
                rows!(bf16_block8,)
            }
            r0 += mr;
        }
        l0 += if left >= 2 * WIDE {
            2 * WIDE
        } else if left >= WIDE {
            WIDE
        } else {
            LANES
        };
    }
}

/// The pair of `A` at row `r`, pair `kk` of a block starting at `a`, broadcast.
#[inline(always)]
unsafe fn pair(p: &Bf16Product, a: *const u16, r: usize, kk: usize) -> i32 {
    (a.add(r * p.a_rs + 2 * kk) as *const i32).read_unaligned()
}

/// One bfloat16 block of `R` rows x `NV` vectors of 16 lanes.
#[inline(always)]
unsafe fn bf16_block<const R: usize, const NV: usize>(
    p: &Bf16Product,
    a: *const u16,
    b: *const u32,
    c: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    for kk in 0..p.pairs {
        let row = b.add(kk * p.lanes);
        let mut bv = [_mm512_setzero_si512(); NV];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = _mm512_loadu_si512(row.add(v * WIDE) as *const __m512i);
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair(p, a, r, kk)));
            for (acc, bv) in acc.iter_mut().zip(&bv) {
                *acc = _mm512_dpbf16_ps(*acc, x, std::mem::transmute::<__m512i, __m512bh>(*bv));
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, x) in acc.iter().enumerate() {
            _mm512_storeu_ps(c.add(r * p.lanes + v * WIDE), *x);
        }
    }
}

/// One bfloat16 block of `R` rows x 8 lanes (256-bit registers).
#[inline(always)]
unsafe fn bf16_block8<const R: usize>(p: &Bf16Product, a: *const u16, b: *const u32, c: *mut f32) {
    let mut acc = [_mm256_setzero_ps(); R];
    for kk in 0..p.pairs {
        let bv = _mm256_loadu_si256(b.add(kk * p.lanes) as *const __m256i);
        let bv: __m256bh = std::mem::transmute(bv);
        for (r, acc) in acc.iter_mut().enumerate() {
            let x: __m256bh = std::mem::transmute(_mm256_set1_epi32(pair(p, a, r, kk)));
            *acc = _mm256_dpbf16_ps(*acc, x, bv);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(c.add(r * p.lanes), *acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::simd::{detected_at_least, Level};

    #[target_feature(enable = "avx512f,avx512vl,avx512bf16")]
    unsafe fn run(p: &Bf16Product) {
        scores_bf16(p)
    }

    /// `scores_bf16` against a triple loop in f64 over the same bfloat16 values, over row
    /// counts and lane widths that leave every kind of partial block.
    #[test]
    fn bf16_scores_match_a_triple_loop() {
        if !detected_at_least(Level::Avx512Bf16) {
            return;
        }
        let bf = |x: f32| half::bf16::from_f32(x).to_f32();
        for (rows, lanes, k) in [
            (1, 8, 2),
            (8, 16, 64),
            (13, 24, 128),
            (64, 40, 576),
            (9, 72, 6),
        ] {
            let a: Vec<f32> = (0..rows * k).map(|i| bf((i as f32 * 0.37).sin())).collect();
            let b: Vec<f32> = (0..k * lanes)
                .map(|i| bf((i as f32 * 0.11).cos()))
                .collect();
            let a16: Vec<u16> = a.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
            // `B[k][lane]` in pairs of k.
            let b2: Vec<u32> = (0..k / 2 * lanes)
                .map(|i| {
                    pack_pair(
                        b[(i / lanes) * 2 * lanes + i % lanes],
                        b[((i / lanes) * 2 + 1) * lanes + i % lanes],
                    )
                })
                .collect();
            let mut c = vec![f32::NAN; rows * lanes];
            let p = Bf16Product {
                a: a16.as_ptr(),
                a_rs: k,
                b: b2.as_ptr(),
                c: c.as_mut_ptr(),
                rows,
                lanes,
                pairs: k / 2,
            };
            // SAFETY: the operands hold the sizes named; the CPU has the features.
            unsafe { run(&p) };
            for r in 0..rows {
                for l in 0..lanes {
                    let want: f64 = (0..k)
                        .map(|kk| a[r * k + kk] as f64 * b[kk * lanes + l] as f64)
                        .sum();
                    let got = c[r * lanes + l] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{rows}x{lanes}x{k} [{r}][{l}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
