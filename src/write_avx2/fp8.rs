//! Floats to fp8 codes: from f32 lanes ([`encode_fp8`]) for any source, and straight
//! from float16 bits ([`encode_fp8_f16`]), each code the scalar encoder's.

use std::arch::x86_64::*;

use super::{lane_sum, store_bytes};

/// One fp8 format's constants, as the scalar encoder takes them.
#[derive(Clone, Copy)]
pub struct Format {
    /// Mantissa bits.
    pub m: u32,
    /// Exponent bias.
    pub bias: i32,
    /// Code of the largest finite value, and of NaN (sign bit clear).
    pub max: u32,
    pub nan: u32,
    /// The smallest magnitude that saturates.
    pub limit: f32,
}

/// Encodes the leading multiple of 32 elements of `src` into `dst` (same length) as
/// [`crate::quant::Fp8::encode`] does, element for element, and returns how many it
/// encoded and how many of those saturated (magnitudes from `f.limit` on).
///
/// # Safety
/// The CPU must have AVX2 ([`super::available`]).
#[target_feature(enable = "avx2")]
pub unsafe fn encode_fp8(dst: &mut [u8], src: &[f32], f: Format) -> (usize, usize) {
    let n = dst.len().min(src.len()) / 32 * 32;
    let drop = 23 - f.m;
    let abs_mask = _mm256_set1_epi32(0x7fff_ffff);
    let min_normal = _mm256_castsi256_ps(_mm256_set1_epi32(((128 - f.bias) as u32 as i32) << 23));
    let sub_scale = _mm256_castsi256_ps(_mm256_set1_epi32((126 + f.bias + f.m as i32) << 23));
    let magic = _mm256_set1_ps(12_582_912.0);
    let magic_bits = _mm256_set1_epi32(12_582_912f32.to_bits() as i32);
    let half_minus_one = _mm256_set1_epi32((1 << (drop - 1)) - 1);
    let one = _mm256_set1_epi32(1);
    let rebias = _mm256_set1_epi32(((127 - f.bias) as u32 as i32) << f.m);
    let limit = _mm256_set1_ps(f.limit);
    let (max, nan) = (
        _mm256_set1_epi32(f.max as i32),
        _mm256_set1_epi32(f.nan as i32),
    );
    let sign_mask = _mm256_set1_epi32(0x80);
    let shift = _mm_cvtsi32_si128(drop as i32);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let mut count = _mm256_setzero_si256();
    // Counts stay exact: each lane gains at most n / 32 < 2^32 per call.
    for i in (0..n).step_by(32) {
        let mut codes = [_mm256_setzero_si256(); 4];
        for (v, code) in codes.iter_mut().enumerate() {
            let x = _mm256_loadu_ps(src.as_ptr().add(i + 8 * v));
            let bits = _mm256_castps_si256(x);
            let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(bits), sign_mask);
            let abits = _mm256_and_si256(bits, abs_mask);
            let a = _mm256_castsi256_ps(abits);
            let scaled = _mm256_add_ps(_mm256_mul_ps(a, sub_scale), magic);
            let subnormal = _mm256_sub_epi32(_mm256_castps_si256(scaled), magic_bits);
            let odd = _mm256_and_si256(_mm256_srl_epi32(abits, shift), one);
            let rounded = _mm256_add_epi32(_mm256_add_epi32(abits, half_minus_one), odd);
            let normal = _mm256_sub_epi32(_mm256_srl_epi32(rounded, shift), rebias);
            let is_sub = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(a, min_normal));
            let c = _mm256_blendv_epi8(normal, subnormal, is_sub);
            let c = _mm256_min_epu32(c, max);
            // From the limit on (infinities too) the code rounds past the largest and
            // the minimum stores it: the compare only counts.
            let sat = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(a, limit));
            let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(a, a));
            let c = _mm256_blendv_epi8(c, nan, is_nan);
            count = _mm256_sub_epi32(count, sat);
            *code = _mm256_or_si256(c, sign);
        }
        store_bytes(dst.as_mut_ptr().add(i), codes, order, false);
    }
    (n, lane_sum(count))
}

/// Encodes the leading multiple of 32 elements of the float16 `src` into `dst` (same
/// length) as fp8 (E4M3 when `E4M3`, else E5M2), each code the one the f32 encoder gives
/// for the element's exact value, sixteen lanes of 16 bits at a time; returns how many it
/// encoded and how many of those saturated.
///
/// A float16's bits round to an fp8 code directly: E5M2 keeps the top byte (rounded to
/// nearest even on the low one; the same exponent bias, so subnormals too); E4M3's normal
/// codes round the low seven bits and rebias the exponent by 8, and its subnormals (below
/// 2^-6, float16 normals) are `round(a * 2^9)`, computed in f32.
///
/// # Safety
/// The CPU must have AVX2 and F16C ([`super::available`]).
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn encode_fp8_f16<const E4M3: bool>(
    dst: &mut [u8],
    src: &[half::f16],
) -> (usize, usize) {
    let n = dst.len().min(src.len()) / 32 * 32;
    let mut count = _mm256_setzero_si256();
    for i in (0..n).step_by(32) {
        let p = src.as_ptr().add(i) as *const __m256i;
        let (c0, s0) = fp8_codes_f16::<E4M3>(_mm256_loadu_si256(p));
        let (c1, s1) = fp8_codes_f16::<E4M3>(_mm256_loadu_si256(p.add(1)));
        // Each saturated lane is -1: pairs summed into 32-bit lanes, negated.
        let minus = _mm256_set1_epi16(-1);
        count = _mm256_add_epi32(count, _mm256_madd_epi16(s0, minus));
        count = _mm256_add_epi32(count, _mm256_madd_epi16(s1, minus));
        let packed = _mm256_packus_epi16(c0, c1);
        let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
        _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, ordered);
    }
    (n, lane_sum(count))
}

/// The fp8 codes (in 16-bit lanes) of 16 float16s, and the lanes that saturated (-1).
#[inline(always)]
unsafe fn fp8_codes_f16<const E4M3: bool>(h: __m256i) -> (__m256i, __m256i) {
    let abs = _mm256_and_si256(h, _mm256_set1_epi16(0x7fff));
    let sign = _mm256_srli_epi16::<8>(_mm256_and_si256(h, _mm256_set1_epi16(0x8000u16 as i16)));
    // Integer compares order non-negative float16 bits as their values.
    let nan = _mm256_cmpgt_epi16(abs, _mm256_set1_epi16(0x7c00));
    let code = if E4M3 {
        let odd = _mm256_and_si256(_mm256_srli_epi16::<7>(abs), _mm256_set1_epi16(1));
        let rounded = _mm256_add_epi16(_mm256_add_epi16(abs, _mm256_set1_epi16(0x3f)), odd);
        let normal = _mm256_sub_epi16(_mm256_srli_epi16::<7>(rounded), _mm256_set1_epi16(0x40));
        // Below 2^-6 (0x2400): E4M3 subnormals.
        let small = _mm256_cmpgt_epi16(_mm256_set1_epi16(0x2400), abs);
        // Computed for every vector: a branch on whether any lane is small mispredicts
        // on data near zero (one vector in five of a normal distribution's).
        let code = _mm256_blendv_epi8(normal, e4m3_subnormals(abs), small);
        _mm256_min_epu16(code, _mm256_set1_epi16(0x7e))
    } else {
        let odd = _mm256_and_si256(_mm256_srli_epi16::<8>(abs), _mm256_set1_epi16(1));
        let rounded = _mm256_add_epi16(_mm256_add_epi16(abs, _mm256_set1_epi16(0x7f)), odd);
        _mm256_min_epu16(_mm256_srli_epi16::<8>(rounded), _mm256_set1_epi16(0x7b))
    };
    let nan_code = _mm256_set1_epi16(if E4M3 { 0x7f } else { 0x7e });
    let code = _mm256_blendv_epi8(code, nan_code, nan);
    // From the saturation limit on (E4M3: above 464, 0x5f40; E5M2: 61440, 0x7b80), NaN
    // excepted.
    let last_below = _mm256_set1_epi16(if E4M3 { 0x5f40 } else { 0x7b7f });
    let sat = _mm256_andnot_si256(nan, _mm256_cmpgt_epi16(abs, last_below));
    (_mm256_or_si256(code, sign), sat)
}

/// `round(a * 2^9)` of 16 float16 magnitudes, in 16-bit lanes (E4M3's subnormal codes,
/// as the f32 encoder computes them).
#[inline(always)]
unsafe fn e4m3_subnormals(abs: __m256i) -> __m256i {
    // Float16 subnormals (below 2^-14) round to code 0: zeroed first, since F16C converts
    // them through a microcode assist that costs thousands of cycles on Zen 3.
    let abs = _mm256_and_si256(abs, _mm256_cmpgt_epi16(abs, _mm256_set1_epi16(0x3ff)));
    let lo = e4m3_subnormals8(_mm256_castsi256_si128(abs));
    let hi = e4m3_subnormals8(_mm256_extracti128_si256::<1>(abs));
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi))
}

/// [`e4m3_subnormals`] of 8 float16 magnitudes, in 32-bit lanes.
#[inline(always)]
unsafe fn e4m3_subnormals8(h: __m128i) -> __m256i {
    let x = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(512.0));
    let y = _mm256_add_ps(x, _mm256_set1_ps(12_582_912.0));
    _mm256_sub_epi32(
        _mm256_castps_si256(y),
        _mm256_set1_epi32(12_582_912f32.to_bits() as i32),
    )
}
