//! The register-blocked matrix product of the tiled kernel: `C[rows][lanes] (+)= A · B`
//! in f32, where `A` is read element by element (broadcast) through any two strides and
//! `B` row by row (vectors of eight lanes).
//!
//! Both products of tiled attention take this shape with the query rows along the lanes
//! ([`super::tiled`]): the scores `S^T = K · Q^T` (rows: positions of a key tile, as
//! stored; `B`: the queries transposed, packed once per item) and the outputs `O^T += V^T ·
//! P^T` (rows: value elements, read down the value tile's columns; `B`: the softmax
//! weights just computed). With AVX2 + FMA a block of [`MR`] rows x 16 lanes lives in 12
//! registers for a whole pass over `k` (two vector loads and six broadcasts feed twelve
//! FMAs per step); without, the same loops over lane arrays are left to the compiler.

/// f32 lanes of one vector (AVX2).
pub(super) const LANES: usize = 8;

/// Rows of `C` a block holds in registers.
const MR: usize = 6;

/// An operand read element by element: `(row, k)` at `ptr + row * rs + k * ks`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Strided {
    pub ptr: *const f32,
    /// Elements between rows.
    pub rs: usize,
    /// Elements between consecutive `k`.
    pub ks: usize,
}

/// The packed operand and the result: `B` is `[k][lanes]` with rows `b_ks` apart, `C` is
/// `[rows][lanes]` with rows `c_rs` apart.
#[derive(Clone, Copy, Debug)]
pub(super) struct Product {
    pub a: Strided,
    pub b: *const f32,
    pub b_ks: usize,
    pub c: *mut f32,
    pub c_rs: usize,
    pub rows: usize,
    /// A multiple of [`LANES`].
    pub lanes: usize,
    pub k: usize,
    /// Adds to `C` when true, overwrites it when false.
    pub accumulate: bool,
}

/// Computes `p`; `SIMD`: the caller runs with AVX2 and FMA; `WIDE`: with AVX-512 F too
/// (blocks of 16-lane vectors, [`super::avx512`]).
///
/// # Safety
/// Every element the strides name must be readable (`A`, `B`) or writable (`C`), `C`
/// overlapping neither; with `SIMD`, the CPU must have AVX2 and FMA, with `WIDE`
/// AVX-512 F.
#[inline(always)]
pub(super) unsafe fn product<const SIMD: bool, const WIDE: bool>(p: &Product) {
    debug_assert!(p.lanes.is_multiple_of(LANES));
    // Long sums go in parts of at most KC steps, so that the part of `B` one block column
    // reads (KC rows of 16 lanes) stays in L1 while every block of rows reuses it.
    let parts = p.k.div_ceil(KC).max(1);
    let kc = p.k.div_ceil(parts);
    for part in 0..parts {
        let k0 = part * kc;
        columns::<SIMD, WIDE>(&Product {
            a: Strided {
                ptr: p.a.ptr.add(k0 * p.a.ks),
                ..p.a
            },
            b: p.b.add(k0 * p.b_ks),
            k: kc.min(p.k - k0),
            accumulate: p.accumulate || part > 0,
            ..*p
        });
    }
}

/// Steps of `k` per pass over the block columns.
const KC: usize = 256;

/// [`product`] over its block columns of 16 (or 8) lanes, each over its blocks of rows;
/// with `WIDE`, first those of 32 or 16 lanes in AVX-512 registers.
#[inline(always)]
unsafe fn columns<const SIMD: bool, const WIDE: bool>(p: &Product) {
    let mut l0 = 0;
    #[cfg(all(target_arch = "x86_64", kvrs_avx512))]
    if WIDE {
        l0 = super::avx512::columns(p);
    }
    while l0 < p.lanes {
        let nv = if p.lanes - l0 >= 2 * LANES { 2 } else { 1 };
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
                        1 => block::<SIMD, 1, $nv>(p, blk),
                        2 => block::<SIMD, 2, $nv>(p, blk),
                        3 => block::<SIMD, 3, $nv>(p, blk),
                        4 => block::<SIMD, 4, $nv>(p, blk),
                        5 => block::<SIMD, 5, $nv>(p, blk),
                        _ => block::<SIMD, 6, $nv>(p, blk),
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
        l0 += nv * LANES;
    }
}

/// The corner of one block in each operand.
#[derive(Clone, Copy)]
pub(super) struct Block {
    pub a: *const f32,
    pub b: *const f32,
    pub c: *mut f32,
}

/// One block of `R` rows x `NV` vectors of lanes.
#[inline(always)]
unsafe fn block<const SIMD: bool, const R: usize, const NV: usize>(p: &Product, blk: Block) {
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        return block_avx2::<R, NV>(p, blk);
    }
    block_portable::<R, NV>(p, blk)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_avx2<const R: usize, const NV: usize>(p: &Product, blk: Block) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); NV]; R];
    if p.accumulate {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (v, x) in acc.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(blk.c.add(r * p.c_rs + v * LANES));
            }
        }
    }
    let (rs, ks) = (p.a.rs, p.a.ks);
    let (mut a, mut b) = (blk.a, blk.b);
    for _ in 0..p.k {
        let mut bv = [_mm256_setzero_ps(); NV];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = _mm256_loadu_ps(b.add(v * LANES));
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = _mm256_broadcast_ss(&*a.add(r * rs));
            for (acc, bv) in acc.iter_mut().zip(&bv) {
                *acc = _mm256_fmadd_ps(x, *bv, *acc);
            }
        }
        a = a.add(ks);
        b = b.add(p.b_ks);
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, x) in acc.iter().enumerate() {
            _mm256_storeu_ps(blk.c.add(r * p.c_rs + v * LANES), *x);
        }
    }
}

#[inline(always)]
unsafe fn block_portable<const R: usize, const NV: usize>(p: &Product, blk: Block) {
    let mut acc = [[[0f32; LANES]; NV]; R];
    if p.accumulate {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (v, x) in acc.iter_mut().enumerate() {
                let c = blk.c.add(r * p.c_rs + v * LANES);
                *x = std::array::from_fn(|l| *c.add(l));
            }
        }
    }
    let (rs, ks) = (p.a.rs, p.a.ks);
    for kk in 0..p.k {
        let b = blk.b.add(kk * p.b_ks);
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = *blk.a.add(r * rs + kk * ks);
            for (v, acc) in acc.iter_mut().enumerate() {
                for (l, y) in acc.iter_mut().enumerate() {
                    *y += x * *b.add(v * LANES + l);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, x) in acc.iter().enumerate() {
            let c = blk.c.add(r * p.c_rs + v * LANES);
            for (l, y) in x.iter().enumerate() {
                *c.add(l) = *y;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `product` against a plain triple loop, over row counts and lane widths that
    /// leave every kind of partial block.
    #[test]
    fn products_match_a_triple_loop() {
        #[cfg(target_arch = "x86_64")]
        let simd = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        // Partial blocks of rows and lanes, and sums in two parts (k > KC).
        let shapes = [
            (1, 8, 1),
            (6, 16, 5),
            (13, 24, 17),
            (7, 40, 64),
            (64, 64, 3),
            (5, 16, 300),
        ];
        for (rows, lanes, k) in shapes {
            for transposed_a in [false, true] {
                let a: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..k * lanes).map(|i| (i as f32 * 0.11).cos()).collect();
                let a_op = if transposed_a {
                    Strided {
                        ptr: a.as_ptr(),
                        rs: 1,
                        ks: rows,
                    }
                } else {
                    Strided {
                        ptr: a.as_ptr(),
                        rs: k,
                        ks: 1,
                    }
                };
                let at = |r: usize, kk: usize| a[r * a_op.rs + kk * a_op.ks] as f64;
                for accumulate in [false, true] {
                    for (use_simd, wide) in [(false, false), (simd, false), (simd, wide())] {
                        let mut c = vec![1f32; rows * lanes];
                        let p = Product {
                            a: a_op,
                            b: b.as_ptr(),
                            b_ks: lanes,
                            c: c.as_mut_ptr(),
                            c_rs: lanes,
                            rows,
                            lanes,
                            k,
                            accumulate,
                        };
                        // SAFETY: the operands hold the sizes named.
                        unsafe {
                            if wide {
                                test_avx512(&p)
                            } else if use_simd {
                                test_avx2(&p)
                            } else {
                                product::<false, false>(&p)
                            }
                        };
                        for r in 0..rows {
                            for l in 0..lanes {
                                let want = (0..k).map(|kk| at(r, kk) * b[kk * lanes + l] as f64);
                                let want = want.sum::<f64>() + accumulate as u8 as f64;
                                let got = c[r * lanes + l] as f64;
                                assert!((got - want).abs() < 1e-4, "{rows}x{lanes}x{k} [{r}][{l}]");
                            }
                        }
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn test_avx2(p: &Product) {
        product::<true, false>(p)
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn test_avx2(p: &Product) {
        product::<false, false>(p)
    }

    /// Whether this CPU (and build) runs the AVX-512 blocks.
    fn wide() -> bool {
        super::super::simd::detected_at_least(super::super::simd::Level::Avx512)
    }

    #[cfg(all(target_arch = "x86_64", kvrs_avx512))]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn test_avx512(p: &Product) {
        product::<true, true>(p)
    }

    #[cfg(not(all(target_arch = "x86_64", kvrs_avx512)))]
    unsafe fn test_avx512(p: &Product) {
        product::<false, false>(p)
    }
}
