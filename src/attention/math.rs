//! The inner loops of attention, in f32: dot products, `y += a * x`, a branch-free `exp`
//! and the conversion of stored K/V rows to f32. Written as plain loops over fixed-width
//! lane arrays so that the compiler vectorises them; [`super::kernel`] compiles them twice,
//! once for AVX2 + FMA + F16C (chosen at run time) and once for any CPU.

use half::f16;

use crate::dtype::DType;

/// `a * b + c`, fused when the caller was compiled with FMA (`FMA = true`).
#[inline(always)]
fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Lanes of a dot product's accumulators: four AVX2 registers of f32, so that four
/// independent FMA chains hide the instruction's latency.
const LANES: usize = 32;

/// `sum(a[i] * b[i])` with `LANES` independent accumulators (no reassociation needed
/// for the compiler to vectorise it).
#[inline(always)]
pub fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] = fmadd::<FMA>(x[l], y[l], acc[l]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = fmadd::<FMA>(*x, *y, tail);
    }
    // Pairwise, so the order is fixed whatever the width the compiler picked.
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
}

/// `y[i] += a * x[i]`.
#[inline(always)]
pub fn axpy<const FMA: bool>(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = fmadd::<FMA>(a, *xi, *yi);
    }
}

/// `y[i] *= a`.
#[inline(always)]
pub fn scale(y: &mut [f32], a: f32) {
    for v in y {
        *v *= a;
    }
}

/// `e^x` for `x <= 0` and moderate positive `x`, to about 2 ulp, without a branch or a
/// call (so a loop of it vectorises). Arguments below -87 give about 1e-38 rather than
/// 0, which no softmax weight can tell apart.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts (Cody and Waite): k * LN2_HI is exact for the k that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest with the 1.5 * 2^23 trick (no libm call, vectorisable).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let k = (x * LOG2E + ROUND) - ROUND;
    let y = (x - k * LN2_HI) - k * LN2_LO; // |y| <= ln 2 / 2
                                           // e^y by its Taylor series to y^7: relative error below 5e-9 on |y| <= 0.35.
    let mut p = 1.0 / 5040.0;
    p = p * y + 1.0 / 720.0;
    p = p * y + 1.0 / 120.0;
    p = p * y + 1.0 / 24.0;
    p = p * y + 1.0 / 6.0;
    p = p * y + 0.5;
    p = p * y + 1.0;
    p = p * y + 1.0;
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// Converts `dst.len()` stored elements of `dtype` at `src` to f32; `SIMD`: the caller
/// runs with AVX2 and F16C enabled.
///
/// # Safety
/// `src` must be valid for reading `dst.len()` elements of `dtype`, aligned to its size;
/// with `SIMD`, the CPU must have F16C.
#[inline(always)]
pub unsafe fn load_row<const SIMD: bool>(dst: &mut [f32], src: *const u8, dtype: DType) {
    let n = dst.len();
    match dtype {
        DType::F32 => dst.copy_from_slice(std::slice::from_raw_parts(src as *const f32, n)),
        DType::BF16 => {
            let s = std::slice::from_raw_parts(src as *const u16, n);
            for (d, &b) in dst.iter_mut().zip(s) {
                *d = f32::from_bits((b as u32) << 16);
            }
        }
        DType::F16 => {
            let s = std::slice::from_raw_parts(src as *const f16, n);
            #[cfg(target_arch = "x86_64")]
            if SIMD {
                // Inlined into the AVX2 + F16C kernel: eight conversions per instruction.
                use std::arch::x86_64::{
                    __m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128,
                };
                let mut i = 0;
                while i + 8 <= n {
                    let h = _mm_loadu_si128(s.as_ptr().add(i) as *const __m128i);
                    _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                    i += 8;
                }
                for j in i..n {
                    dst[j] = s[j].to_f32();
                }
                return;
            }
            use half::slice::HalfFloatSliceExt;
            s.convert_to_f32_slice(dst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let mut x = -87.0f32;
        while x < 30.0 {
            let (got, want) = (exp(x), x.exp());
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "exp({x}) = {got}, libm {want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn dot_and_axpy_match_scalar_sums() {
        let a: Vec<f32> = (0..77).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..77).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        for got in [dot::<true>(&a, &b), dot::<false>(&a, &b)] {
            assert!((got as f64 - want).abs() < 1e-5, "{got} vs {want}");
        }
        let mut y = b.clone();
        axpy::<false>(&mut y, 2.0, &a);
        assert!(y
            .iter()
            .zip(&a)
            .zip(&b)
            .all(|((y, a), b)| *y == b + 2.0 * a));
    }

    #[test]
    fn rows_load_from_every_dtype() {
        let v: Vec<f32> = (0..19).map(|i| i as f32 * 0.5 - 3.0).collect();
        let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut out = vec![0f32; v.len()];
        unsafe {
            load_row::<false>(&mut out, h.as_ptr() as *const u8, DType::F16);
            assert_eq!(out, v);
            load_row::<false>(&mut out, b.as_ptr() as *const u8, DType::BF16);
            assert_eq!(out, v);
            load_row::<false>(&mut out, v.as_ptr() as *const u8, DType::F32);
            assert_eq!(out, v);
        }
    }
}
