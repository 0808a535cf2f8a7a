//! The float16 write loops again with AVX-512 (F, BW, VL), chosen at run time before the
//! AVX2 ones where the CPU has it ([`available`]): float16 bits to fp8 codes
//! ([`encode_fp8_f16`]) and float16 rows to int8 codes and scales
//! ([`quantize_rows_f16`]), each code, scale and saturation count the scalar codec's, bit
//! for bit, as the AVX2 loops give them.
//!
//! What the wider instructions buy beyond the width: 16-bit variable shifts compute
//! E4M3's subnormal codes in integers (no conversion to f32 and back, no F16C on
//! float16 subnormals), compares give masks that count saturations with one `popcnt`,
//! and the narrowing moves (`vpmovwb`, `vpmovdb`) store bytes in order without packs
//! and permutes.

use std::arch::x86_64::*;

use crate::quant::{i8_code, i8_scale};

/// Whether this CPU runs these loops: AVX-512 F, BW and VL, POPCNT (which counts the
/// saturated lanes' mask bits), and the AVX2 and F16C the callers fall back to.
#[inline]
pub fn available() -> bool {
    super::available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("popcnt")
}

/// [`super::fp8::encode_fp8_f16`] with AVX-512: encodes the leading multiple of 32
/// elements of the float16 `src` into `dst` (same length) as fp8 (E4M3 when `E4M3`, else
/// E5M2), 32 lanes of 16 bits at a time; returns how many it encoded and how many of
/// those saturated.
///
/// E4M3's subnormal codes (float16 magnitudes below 2^-6) are `round(a * 2^9)`: a
/// float16 normal of exponent field `e` (1 to 8 here) is `(1024 + m) * 2^(e - 25)`, so
/// the code is `1024 + m` shifted right by `16 - e`, rounded to nearest even, exactly;
/// float16 subnormals (`e = 0`) shift by 16, to 0, as they round.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL and POPCNT ([`available`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,popcnt")]
pub unsafe fn encode_fp8_f16<const E4M3: bool>(
    dst: &mut [u8],
    src: &[half::f16],
) -> (usize, usize) {
    let n = dst.len().min(src.len()) / 32 * 32;
    let mut count = 0usize;
    let mut i = 0;
    // Two vectors per step: independent chains for the out-of-order core.
    while i + 64 <= n {
        let p = src.as_ptr().add(i) as *const __m512i;
        let (c0, s0) = fp8_codes_f16::<E4M3>(_mm512_loadu_si512(p));
        let (c1, s1) = fp8_codes_f16::<E4M3>(_mm512_loadu_si512(p.add(1)));
        let q = dst.as_mut_ptr().add(i) as *mut __m256i;
        _mm256_storeu_si256(q, _mm512_cvtepi16_epi8(c0));
        _mm256_storeu_si256(q.add(1), _mm512_cvtepi16_epi8(c1));
        count += (s0.count_ones() + s1.count_ones()) as usize;
        i += 64;
    }
    if i < n {
        let p = src.as_ptr().add(i) as *const __m512i;
        let (c, s) = fp8_codes_f16::<E4M3>(_mm512_loadu_si512(p));
        _mm256_storeu_si256(
            dst.as_mut_ptr().add(i) as *mut __m256i,
            _mm512_cvtepi16_epi8(c),
        );
        count += s.count_ones() as usize;
    }
    (n, count)
}

/// The fp8 codes (in 16-bit lanes) of 32 float16s, and the lanes that saturated.
#[inline(always)]
unsafe fn fp8_codes_f16<const E4M3: bool>(h: __m512i) -> (__m512i, __mmask32) {
    let abs = _mm512_and_si512(h, _mm512_set1_epi16(0x7fff));
    let sign = _mm512_srli_epi16::<8>(_mm512_andnot_si512(abs, h));
    // Integer compares order non-negative float16 bits as their values.
    let nan = _mm512_cmpgt_epu16_mask(abs, _mm512_set1_epi16(0x7c00));
    let one = _mm512_set1_epi16(1);
    let code = if E4M3 {
        let odd = _mm512_and_si512(_mm512_srli_epi16::<7>(abs), one);
        let rounded = _mm512_add_epi16(_mm512_add_epi16(abs, _mm512_set1_epi16(0x3f)), odd);
        let normal = _mm512_sub_epi16(_mm512_srli_epi16::<7>(rounded), _mm512_set1_epi16(0x40));
        // Below 2^-6 (0x2400): E4M3 subnormals, `(1024 + m) >> (16 - e)` rounded to
        // nearest even (at most 0x7ff + 0x3fff + 1: no carry out of 16 bits).
        let small = _mm512_cmplt_epu16_mask(abs, _mm512_set1_epi16(0x2400));
        let x = _mm512_or_si512(
            _mm512_and_si512(abs, _mm512_set1_epi16(0x3ff)),
            _mm512_set1_epi16(0x400),
        );
        let s = _mm512_sub_epi16(_mm512_set1_epi16(16), _mm512_srli_epi16::<10>(abs));
        let half_minus_one =
            _mm512_sub_epi16(_mm512_sllv_epi16(one, _mm512_sub_epi16(s, one)), one);
        let odd = _mm512_and_si512(_mm512_srlv_epi16(x, s), one);
        let sub = _mm512_srlv_epi16(
            _mm512_add_epi16(_mm512_add_epi16(x, half_minus_one), odd),
            s,
        );
        let code = _mm512_mask_blend_epi16(small, normal, sub);
        _mm512_min_epu16(code, _mm512_set1_epi16(0x7e))
    } else {
        let odd = _mm512_and_si512(_mm512_srli_epi16::<8>(abs), one);
        let rounded = _mm512_add_epi16(_mm512_add_epi16(abs, _mm512_set1_epi16(0x7f)), odd);
        _mm512_min_epu16(_mm512_srli_epi16::<8>(rounded), _mm512_set1_epi16(0x7b))
    };
    let nan_code = _mm512_set1_epi16(if E4M3 { 0x7f } else { 0x7e });
    let code = _mm512_mask_blend_epi16(nan, code, nan_code);
    // From the saturation limit on (E4M3: above 464, 0x5f40; E5M2: 61440, 0x7b80), NaN
    // excepted.
    let last_below = _mm512_set1_epi16(if E4M3 { 0x5f40 } else { 0x7b7f });
    let sat = _mm512_cmpgt_epu16_mask(abs, last_below) & !nan;
    (_mm512_or_si512(code, sign), sat)
}

/// [`super::int8::quantize_rows_f16`] with AVX-512: quantizes float16 rows of `d`
/// elements, each given as (its codes, its scale, its elements), as
/// [`crate::quant::quantize_row_i8`] does; 32 elements at a time, the rest of a row
/// (`d` past a multiple of 32) and rows with a NaN or an infinity by the scalar codec.
///
/// Codes come from the product by the scale's inverse, rounded to nearest even; a block
/// of 32 where any product lies within its error bound of a half is divided instead
/// (as in [`super::int8`]).
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL and POPCNT ([`available`]); every row's pointers are
/// valid for `d` codes, one scale and `d` elements, and no two rows overlap.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
pub unsafe fn quantize_rows_f16(
    d: usize,
    mut rows: impl Iterator<Item = (*mut i8, *mut f32, *const half::f16)>,
) {
    // Rows a batch at a time, their scans (a reduction across lanes and two divisions
    // each, a chain of latencies) first: the scans of a batch are independent, so they
    // overlap, and the codes then find their scales ready.
    const BATCH: usize = 8;
    let mut batch = [(std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null()); BATCH];
    let mut plans = [Plan::ZERO; BATCH];
    loop {
        let mut k = 0;
        for row in rows.by_ref().take(BATCH) {
            batch[k] = row;
            k += 1;
        }
        for (plan, &(_, scale, src)) in plans.iter_mut().zip(&batch[..k]) {
            *plan = Plan::new(std::slice::from_raw_parts(src, d));
            *scale = plan.scale;
        }
        for (plan, &(dst, _, src)) in plans.iter().zip(&batch[..k]) {
            let (q, x) = (
                std::slice::from_raw_parts_mut(dst, d),
                std::slice::from_raw_parts(src, d),
            );
            match plan.kind {
                Kind::Zero => q.fill(0),
                Kind::Special => {
                    for (q, h) in q.iter_mut().zip(x) {
                        *q = i8_code(h.to_f32(), plan.scale);
                    }
                }
                Kind::Finite => codes::<false>(q, x, plan),
                Kind::Subnormal => codes::<true>(q, x, plan),
            }
        }
        if k < BATCH {
            return;
        }
    }
}

/// How a row's codes are computed.
#[derive(Clone, Copy)]
enum Kind {
    /// Every element is a zero (or a NaN): codes 0, scale 0.
    Zero,
    /// A NaN or an infinity: the scalar codes (their clamp and NaN rule).
    Special,
    /// Finite, no float16 subnormal.
    Finite,
    /// Finite, with subnormals ([`load16`]).
    Subnormal,
}

/// A row's scale, its inverse and how its codes are computed.
#[derive(Clone, Copy)]
struct Plan {
    kind: Kind,
    scale: f32,
    inverse: f32,
}

impl Plan {
    const ZERO: Plan = Plan {
        kind: Kind::Zero,
        scale: 0.0,
        inverse: 0.0,
    };

    #[inline(always)]
    unsafe fn new(src: &[half::f16]) -> Plan {
        let (top, low) = scan_f16(src);
        if top == 0 {
            return Plan::ZERO;
        }
        if top >= 0x7c00 {
            // The largest magnitude that is not NaN, as the scalar fold finds it.
            let amax = src.iter().fold(0f32, |m, h| {
                let a = h.to_f32().abs();
                if a > m {
                    a
                } else {
                    m
                }
            });
            if amax == 0.0 {
                return Plan::ZERO;
            }
            let scale = i8_scale(amax);
            return Plan {
                kind: Kind::Special,
                scale,
                inverse: 0.0,
            };
        }
        // (A float16's largest magnitude over 127 is a normal f32: the inverse is finite.)
        let amax = if top >= 0x400 {
            // By F16C: `to_f32_const` converts in software, with branches.
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(top as i32)))
        } else {
            half::f16::from_bits(top).to_f32_const()
        };
        let scale = i8_scale(amax);
        Plan {
            kind: if low < 0x3ff {
                Kind::Subnormal
            } else {
                Kind::Finite
            },
            scale,
            inverse: 1.0 / scale,
        }
    }
}

/// The largest magnitude bits of a float16 row, and the smallest less one (wrapping:
/// below 0x3ff only where the row holds a subnormal).
#[inline(always)]
unsafe fn scan_f16(src: &[half::f16]) -> (u16, u16) {
    let n = src.len();
    let whole = n / 32 * 32;
    let (abs_mask, one) = (_mm512_set1_epi16(0x7fff), _mm512_set1_epi16(1));
    let (mut top, mut low) = (_mm512_setzero_si512(), _mm512_set1_epi16(-1));
    for i in (0..whole).step_by(32) {
        let h = _mm512_loadu_si512(src.as_ptr().add(i) as *const __m512i);
        let a = _mm512_and_si512(h, abs_mask);
        top = _mm512_max_epu16(top, a);
        low = _mm512_min_epu16(low, _mm512_sub_epi16(a, one));
    }
    let top = _mm256_max_epu16(
        _mm512_castsi512_si256(top),
        _mm512_extracti64x4_epi64::<1>(top),
    );
    let low = _mm256_min_epu16(
        _mm512_castsi512_si256(low),
        _mm512_extracti64x4_epi64::<1>(low),
    );
    super::int8::fold_range(top, low, &src[whole..])
}

/// Sixteen float16s as f32: by F16C, or where the row holds subnormals (`SUBNORMAL`),
/// those as their mantissa times 2^-24 (exact in f32), since F16C converts a float16
/// subnormal through a microcode assist.
#[inline(always)]
unsafe fn load16<const SUBNORMAL: bool>(p: *const half::f16) -> __m512 {
    let h = _mm256_loadu_si256(p as *const __m256i);
    if !SUBNORMAL {
        return _mm512_cvtph_ps(h);
    }
    let abs = _mm256_and_si256(h, _mm256_set1_epi16(0x7fff));
    let tiny = _mm256_cmpneq_epi16_mask(abs, _mm256_setzero_si256())
        & _mm256_cmplt_epu16_mask(abs, _mm256_set1_epi16(0x400));
    let normal = _mm512_cvtph_ps(_mm256_maskz_mov_epi16(!tiny, h));
    let wide = _mm512_cvtepu16_epi32(h);
    let mantissa = _mm512_and_si512(wide, _mm512_set1_epi32(0x3ff));
    let sign = _mm512_slli_epi32::<16>(_mm512_and_si512(wide, _mm512_set1_epi32(0x8000)));
    let value = _mm512_mul_ps(
        _mm512_cvtepi32_ps(mantissa),
        _mm512_set1_ps(1.0 / 16_777_216.0),
    );
    let value = _mm512_or_ps(value, _mm512_castsi512_ps(sign));
    _mm512_mask_mov_ps(normal, tiny, value)
}

/// The codes of a finite row of `scale` (|x / scale| <= 127 (1 + 2^-23) rounds to at most
/// 127: no clamp).
#[inline(always)]
unsafe fn codes<const SUBNORMAL: bool>(dst: &mut [i8], src: &[half::f16], plan: &Plan) {
    let n = src.len();
    let vscale = _mm512_set1_ps(plan.scale);
    let inverse = _mm512_set1_ps(plan.inverse);
    let near = _mm512_set1_ps(0.5 - 1.0 / 16384.0);
    let vectors = n / 32 * 32;
    let (s, q) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..vectors).step_by(32) {
        let (x0, x1) = (
            load16::<SUBNORMAL>(s.add(i)),
            load16::<SUBNORMAL>(s.add(i + 16)),
        );
        let (y0, y1) = (_mm512_mul_ps(x0, inverse), _mm512_mul_ps(x1, inverse));
        let (r0, r1) = (
            _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y0),
            _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y1),
        );
        let off = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(_mm512_sub_ps(y0, r0)), near)
            | _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(_mm512_sub_ps(y1, r1)), near);
        let (r0, r1) = if off != 0 {
            (
                _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_div_ps(x0, vscale),
                ),
                _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_div_ps(x1, vscale),
                ),
            )
        } else {
            (r0, r1)
        };
        // Integral values of at most 127 in magnitude: exact conversions, no saturation.
        let c0 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r0));
        let c1 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r1));
        _mm256_storeu_si256(q.add(i) as *mut __m256i, _mm256_set_m128i(c1, c0));
    }
    for (i, d) in dst[..n].iter_mut().enumerate().skip(vectors) {
        *d = i8_code(src[i].to_f32(), plan.scale);
    }
}

/// [`super::fp8::encode_fp8`] with AVX-512: encodes the leading multiple of 32 elements
/// of `src` into `dst` (same length) as [`crate::quant::Fp8::encode`] does, sixteen
/// lanes at a time with the same bit operations, and returns how many it encoded and how
/// many of those saturated.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL and POPCNT ([`available`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,popcnt")]
pub unsafe fn encode_fp8(dst: &mut [u8], src: &[f32], f: super::fp8::Format) -> (usize, usize) {
    let n = dst.len().min(src.len()) / 32 * 32;
    let drop = 23 - f.m;
    let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
    let min_normal = _mm512_castsi512_ps(_mm512_set1_epi32(((128 - f.bias) as u32 as i32) << 23));
    let sub_scale = _mm512_castsi512_ps(_mm512_set1_epi32((126 + f.bias + f.m as i32) << 23));
    let magic = _mm512_set1_ps(12_582_912.0);
    let magic_bits = _mm512_set1_epi32(12_582_912f32.to_bits() as i32);
    let half_minus_one = _mm512_set1_epi32((1 << (drop - 1)) - 1);
    let one = _mm512_set1_epi32(1);
    let rebias = _mm512_set1_epi32(((127 - f.bias) as u32 as i32) << f.m);
    let limit = _mm512_set1_ps(f.limit);
    let (max, nan) = (
        _mm512_set1_epi32(f.max as i32),
        _mm512_set1_epi32(f.nan as i32),
    );
    let sign_mask = _mm512_set1_epi32(0x80);
    let shift = _mm_cvtsi32_si128(drop as i32);
    let mut count = 0usize;
    for i in (0..n).step_by(16) {
        let bits = _mm512_loadu_si512(src.as_ptr().add(i) as *const __m512i);
        let sign = _mm512_and_si512(_mm512_srli_epi32::<24>(bits), sign_mask);
        let abits = _mm512_and_si512(bits, abs_mask);
        let a = _mm512_castsi512_ps(abits);
        let scaled = _mm512_add_ps(_mm512_mul_ps(a, sub_scale), magic);
        let subnormal = _mm512_sub_epi32(_mm512_castps_si512(scaled), magic_bits);
        let odd = _mm512_and_si512(_mm512_srl_epi32(abits, shift), one);
        let rounded = _mm512_add_epi32(_mm512_add_epi32(abits, half_minus_one), odd);
        let normal = _mm512_sub_epi32(_mm512_srl_epi32(rounded, shift), rebias);
        let is_sub = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, min_normal);
        let c = _mm512_mask_blend_epi32(is_sub, normal, subnormal);
        let c = _mm512_min_epu32(c, max);
        // From the limit on (infinities too) the code rounds past the largest and the
        // minimum stores it: the compare only counts.
        let sat = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, limit);
        let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a);
        let c = _mm512_mask_blend_epi32(is_nan, c, nan);
        count += sat.count_ones() as usize;
        let code = _mm512_cvtepi32_epi8(_mm512_or_si512(c, sign));
        _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, code);
    }
    (n, count)
}
