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
    // The sum holds k in its low mantissa bits: read it there rather than by a float to
    // int conversion, whose saturating semantics do not vectorise.
    let rounded = x * LOG2E + ROUND;
    let k = rounded - ROUND;
    let k_bits = rounded.to_bits().wrapping_sub(ROUND.to_bits());
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
    p * f32::from_bits(k_bits.wrapping_add(127) << 23)
}

/// Converts `dst.len()` stored elements of `dtype` at `src` to f32, multiplying 8-bit
/// elements by `scale` (float elements are their own values); `SIMD`: the caller runs
/// with AVX2 and F16C enabled.
///
/// # Safety
/// `src` must be valid for reading `dst.len()` elements of `dtype`, aligned to its size;
/// with `SIMD`, the CPU must have F16C.
#[inline(always)]
pub unsafe fn load_row<const SIMD: bool>(
    dst: &mut [f32],
    src: *const u8,
    dtype: DType,
    scale: f32,
) {
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
        DType::F8E4M3 | DType::F8E5M2 => {
            let e4m3 = dtype == DType::F8E4M3;
            let s = std::slice::from_raw_parts(src, n);
            let mut i = 0;
            #[cfg(target_arch = "x86_64")]
            if SIMD {
                i = fp8_to_f32_f16c(dst, s, e4m3, scale);
            }
            for j in i..n {
                let v = if e4m3 {
                    e4m3_to_f32(s[j])
                } else {
                    e5m2_to_f32(s[j])
                };
                dst[j] = v * scale;
            }
        }
        DType::I8 => {
            let s = std::slice::from_raw_parts(src as *const i8, n);
            for (d, &q) in dst.iter_mut().zip(s) {
                *d = q as f32 * scale;
            }
        }
    }
}

/// Converts the leading multiple of 16 codes of `src` to `dst` (times `scale`) through
/// f16, eight per F16C instruction, and returns how many it converted.
///
/// # Safety
/// The CPU must have AVX2 and F16C (the caller's `SIMD`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fp8_to_f32_f16c(dst: &mut [f32], src: &[u8], e4m3: bool, scale: f32) -> usize {
    use std::arch::x86_64::*;
    let n = dst.len().min(src.len());
    // Two products, each exact up to one rounding of the last: the codec's value.
    let (factor, mul) = (_mm256_set1_ps(fp8_factor(e4m3)), _mm256_set1_ps(scale));
    let mut i = 0;
    while i + 16 <= n {
        let b = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        let (lo, hi) = fp8x16_to_f16(b, e4m3);
        for (at, h) in [(i, lo), (i + 8, hi)] {
            let x = _mm256_mul_ps(_mm256_cvtph_ps(h), factor);
            _mm256_storeu_ps(dst.as_mut_ptr().add(at), _mm256_mul_ps(x, mul));
        }
        i += 16;
    }
    i
}

/// What multiplies the f16s of [`fp8x16_to_f16`] to give the codes' values: 2^8 for
/// E4M3, 1 for E5M2.
#[inline(always)]
pub(super) const fn fp8_factor(e4m3: bool) -> f32 {
    if e4m3 {
        256.0
    } else {
        1.0
    }
}

/// 16 fp8 codes (E4M3 when `e4m3`, else E5M2) as f16s, codes 0..8 in the first vector
/// and 8..16 in the second, each equal to the code's value divided by
/// [`fp8_factor`].
///
/// An E5M2 code is the high byte of the f16 of the same value. An E4M3 code's sign goes
/// to the f16's sign and its seven other bits just below the f16's top exponent bit
/// (the code sign-extended, shifted by 7, then masked): as E4M3's exponent
/// bias is 7 and f16's 15, that f16 is the value divided by 2^8, subnormal codes
/// included (they become f16 subnormals, which F16C converts exactly; no slower on the
/// benchmark's AMD EPYC). The NaN code (magnitude 0x7f, the only one whose f16 reaches
/// 0x3f80) gets the top exponent bit by a carry.
///
/// # Safety
/// The CPU must have AVX2 (the caller's `SIMD`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn fp8x16_to_f16(
    b: std::arch::x86_64::__m128i,
    e4m3: bool,
) -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
    use std::arch::x86_64::*;
    if e4m3 {
        // Sign-extended and shifted, the sign reaches bit 15 (and 14, masked off).
        let x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
        let h = _mm256_and_si256(x, _mm256_set1_epi16(0xbf80u16 as i16));
        let nan = _mm256_add_epi16(h, _mm256_set1_epi16(0x80));
        let h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000)));
        (_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
    } else {
        let zero = _mm_setzero_si128();
        (_mm_unpacklo_epi8(zero, b), _mm_unpackhi_epi8(zero, b))
    }
}

/// The value of an fp8 E4M3FN code, from its bits with selects only (no table, no
/// branch, no subnormal f32), so that a loop of it vectorises.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let mag = (b & 0x7f) as u32;
    let (e, m) = (mag >> 3, mag & 7);
    let normal = f32::from_bits(((e + 120) << 23) | (m << 20));
    let subnormal = m as f32 * (1.0 / 512.0);
    let v = if e == 0 { subnormal } else { normal };
    let v = if mag == 0x7f { f32::NAN } else { v };
    f32::from_bits(v.to_bits() | ((b as u32 & 0x80) << 24))
}

/// The value of an fp8 E5M2 code, as [`e4m3_to_f32`] computes it.
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    let mag = (b & 0x7f) as u32;
    let (e, m) = (mag >> 2, mag & 3);
    let normal = f32::from_bits(((e + 112) << 23) | (m << 21));
    let subnormal = m as f32 * (1.0 / 65536.0);
    let special = if m == 0 { f32::INFINITY } else { f32::NAN };
    let v = if e == 0 { subnormal } else { normal };
    let v = if e == 31 { special } else { v };
    f32::from_bits(v.to_bits() | ((b as u32 & 0x80) << 24))
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
            load_row::<false>(&mut out, h.as_ptr() as *const u8, DType::F16, 1.0);
            assert_eq!(out, v);
            load_row::<false>(&mut out, b.as_ptr() as *const u8, DType::BF16, 1.0);
            assert_eq!(out, v);
            load_row::<false>(&mut out, v.as_ptr() as *const u8, DType::F32, 1.0);
            assert_eq!(out, v);
            let codes: Vec<i8> = (0..19).map(|i| i as i8 - 9).collect();
            load_row::<false>(&mut out, codes.as_ptr() as *const u8, DType::I8, 0.5);
            assert!(out.iter().zip(&codes).all(|(o, &c)| *o == c as f32 * 0.5));
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_f16c_fp8_rows_match_the_codec_tables_on_every_code() {
        use crate::quant::Fp8;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            return;
        }
        let codes: Vec<u8> = (0..=255u8).collect();
        for (f, dtype) in [(Fp8::E4M3, DType::F8E4M3), (Fp8::E5M2, DType::F8E5M2)] {
            let mut out = vec![0f32; 256];
            unsafe { load_row::<true>(&mut out, codes.as_ptr(), dtype, 0.5) };
            for (c, got) in out.iter().enumerate() {
                let want = f.decode(c as u8) * 0.5;
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{f:?} code {c:#04x}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn fp8_bit_decoders_match_the_codec_tables_on_every_code() {
        use crate::quant::Fp8;
        for (f, decode) in [
            (Fp8::E4M3, e4m3_to_f32 as fn(u8) -> f32),
            (Fp8::E5M2, e5m2_to_f32),
        ] {
            for c in 0..=255u8 {
                let (got, want) = (decode(c), f.decode(c));
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{f:?} code {c:#04x}: {got} vs {want}"
                );
            }
        }
    }
}
