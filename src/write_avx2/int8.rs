//! Rows to int8 codes and their scale, as [`crate::quant::quantize_row_i8`] computes
//! them (`scale = max|x| / 127`, `q = round(clamp(x / scale))`, NaN 0), from f32 or
//! float16 rows, eight lanes at a time.
//!
//! A division per vector would cost more than the rest of the loop together, so codes
//! come from the product by the inverse, which is within `|x / scale| * 2^-22 <= 2^-15`
//! of the quotient's float and so rounds to the same integer unless it lies within that
//! distance of a half: the 32 elements around such a lane (about one in a thousand) are
//! divided. Rows with a NaN or an infinity, whose codes need the clamp and the NaN rule,
//! take the scalar codec whole.

use std::arch::x86_64::*;

use super::store_bytes;
use crate::quant::{i8_code, i8_scale};

/// Elements of a row read as f32 lanes.
trait Row {
    /// Elements.
    fn len(&self) -> usize;
    /// Elements `i..i + 8` as f32; `SUBNORMAL` where the row may hold float16
    /// subnormals ([`Scan::subnormal`]).
    ///
    /// # Safety
    /// `i + 8 <= len()`; the CPU has AVX2 and F16C.
    unsafe fn load8<const SUBNORMAL: bool>(&self, i: usize) -> __m256;
    /// Element `i` as f32.
    fn get(&self, i: usize) -> f32;
    /// What the codes of the row need to know first.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C.
    unsafe fn scan(&self) -> Scan;
}

/// A row's first pass.
struct Scan {
    /// The largest magnitude of the elements that are not NaN (0 when none is).
    amax: f32,
    /// Whether the row holds a NaN or an infinity.
    special: bool,
    /// Whether it holds a float16 subnormal: F16C converts one through a microcode
    /// assist that costs thousands of cycles on Zen 3, so such rows convert in integers.
    subnormal: bool,
}

impl Row for &[f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }
    #[inline(always)]
    unsafe fn load8<const SUBNORMAL: bool>(&self, i: usize) -> __m256 {
        _mm256_loadu_ps(self.as_ptr().add(i))
    }
    fn get(&self, i: usize) -> f32 {
        self[i]
    }
    #[inline(always)]
    unsafe fn scan(&self) -> Scan {
        let n = <[f32]>::len(self);
        let whole = n / 8 * 8;
        // max(|x|, m) leaves m where |x| is NaN (the scalar fold skips NaNs the same way).
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let (mut acc, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..whole).step_by(8) {
            let x = self.load8::<false>(i);
            acc = _mm256_max_ps(_mm256_and_ps(x, abs_mask), acc);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut amax = lanes.iter().fold(0f32, |m, &a| m.max(a));
        let mut special = _mm256_movemask_ps(nan) != 0;
        for &x in &self[whole..] {
            special |= x.is_nan();
            if x.abs() > amax {
                amax = x.abs();
            }
        }
        Scan {
            amax,
            special: special || amax.is_infinite(),
            subnormal: false,
        }
    }
}

impl Row for &[half::f16] {
    fn len(&self) -> usize {
        <[half::f16]>::len(self)
    }
    #[inline(always)]
    unsafe fn load8<const SUBNORMAL: bool>(&self, i: usize) -> __m256 {
        let h = _mm_loadu_si128(self.as_ptr().add(i) as *const __m128i);
        if !SUBNORMAL {
            return _mm256_cvtph_ps(h);
        }
        // Subnormals (magnitude bits 1 to 0x3ff) are their mantissa times 2^-24, exact
        // in f32; the other lanes convert by F16C, the subnormals zeroed first.
        let abs = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
        let tiny = _mm_andnot_si128(
            _mm_cmpeq_epi16(abs, _mm_setzero_si128()),
            _mm_cmpgt_epi16(_mm_set1_epi16(0x400), abs),
        );
        let normal = _mm256_cvtph_ps(_mm_andnot_si128(tiny, h));
        let sub = _mm256_cvtepu16_epi32(_mm_and_si128(tiny, h));
        let mantissa = _mm256_and_si256(sub, _mm256_set1_epi32(0x3ff));
        let sign = _mm256_slli_epi32::<16>(_mm256_and_si256(sub, _mm256_set1_epi32(0x8000)));
        let value = _mm256_mul_ps(
            _mm256_cvtepi32_ps(mantissa),
            _mm256_set1_ps(1.0 / 16_777_216.0),
        );
        let value = _mm256_or_ps(value, _mm256_castsi256_ps(sign));
        // One of the two is zero in every lane (a subnormal's normal part is +0).
        _mm256_add_ps(normal, value)
    }
    fn get(&self, i: usize) -> f32 {
        self[i].to_f32()
    }
    /// On the bits, sixteen lanes at a time: a float16's magnitude bits order as its
    /// magnitude; from 0x7c00 on (infinity, then NaNs) the row is special; bits 1 to
    /// 0x3ff are subnormals.
    #[inline(always)]
    unsafe fn scan(&self) -> Scan {
        let n = <[half::f16]>::len(self);
        let whole = n / 16 * 16;
        let (abs_mask, one) = (_mm256_set1_epi16(0x7fff), _mm256_set1_epi16(1));
        // The largest magnitude, and the smallest magnitude less one (unsigned: zeros wrap
        // to the top, so only a subnormal leaves it below 0x3ff).
        let (mut top, mut low) = (_mm256_setzero_si256(), _mm256_set1_epi16(-1));
        for i in (0..whole).step_by(16) {
            let h = _mm256_loadu_si256(self.as_ptr().add(i) as *const __m256i);
            let a = _mm256_and_si256(h, abs_mask);
            top = _mm256_max_epu16(top, a);
            low = _mm256_min_epu16(low, _mm256_sub_epi16(a, one));
        }
        let (top, low) = fold_range(top, low, &self[whole..]);
        let subnormal = low < 0x3ff;
        if top < 0x7c00 {
            let amax = half::f16::from_bits(top).to_f32_const();
            return Scan {
                amax,
                special: false,
                subnormal,
            };
        }
        // A NaN or an infinity: the largest magnitude that is not NaN, as the fold finds
        // it.
        let amax = (0..n).fold(0f32, |m, i| {
            let a = self.get(i).abs();
            if a > m {
                a
            } else {
                m
            }
        });
        Scan {
            amax,
            special: true,
            subnormal,
        }
    }
}

/// Quantizes the f32 `src` into `dst` (of at least its length); returns the scale.
///
/// # Safety
/// The CPU must have AVX2 and F16C ([`super::available`]).
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn quantize_row(dst: &mut [i8], src: &[f32]) -> f32 {
    quantize(dst, src)
}

/// Quantizes float16 rows of `d` elements, each given as (its codes, its scale, its
/// elements), in one call: the row loop inlined, its constants built once.
///
/// # Safety
/// The CPU must have AVX2 and F16C ([`super::available`]); every row's pointers are
/// valid for `d` codes, one scale and `d` elements, and no two rows overlap.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn quantize_rows_f16(
    d: usize,
    rows: impl Iterator<Item = (*mut i8, *mut f32, *const half::f16)>,
) {
    for (codes, scale, src) in rows {
        let (q, x) = (
            std::slice::from_raw_parts_mut(codes, d),
            std::slice::from_raw_parts(src, d),
        );
        *scale = quantize(q, x);
    }
}

#[inline(always)]
unsafe fn quantize<R: Row>(dst: &mut [i8], src: R) -> f32 {
    let n = src.len();
    assert!(dst.len() >= n, "a code for every element");
    let Scan {
        amax,
        special,
        subnormal,
    } = src.scan();
    if amax == 0.0 {
        dst[..n].fill(0);
        return 0.0;
    }
    let scale = i8_scale(amax);
    // (A scale below the normal floats has an inverse that may overflow.)
    if special || scale < f32::MIN_POSITIVE {
        for (i, d) in dst[..n].iter_mut().enumerate() {
            *d = i8_code(src.get(i), scale);
        }
        return scale;
    }
    if subnormal {
        codes::<R, true>(dst, &src, scale);
    } else {
        codes::<R, false>(dst, &src, scale);
    }
    scale
}

/// The codes of a finite row of `scale`: |x / scale| <= 127 (1 + 2^-23) rounds to at most
/// 127, no clamp.
#[inline(always)]
unsafe fn codes<R: Row, const SUBNORMAL: bool>(dst: &mut [i8], src: &R, scale: f32) {
    let n = src.len();
    let k = Codes::new(scale);
    let vectors = n / 32 * 32;
    for i in (0..vectors).step_by(32) {
        let mut codes = [_mm256_setzero_si256(); 4];
        let mut off = _mm256_setzero_ps();
        for (v, code) in codes.iter_mut().enumerate() {
            let y = _mm256_mul_ps(src.load8::<SUBNORMAL>(i + 8 * v), k.inverse);
            let (q, distance) = k.round(y);
            *code = q;
            off = _mm256_max_ps(off, distance);
        }
        if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(off, k.near)) != 0 {
            for (v, code) in codes.iter_mut().enumerate() {
                let x = src.load8::<SUBNORMAL>(i + 8 * v);
                *code = k.round(_mm256_div_ps(x, k.scale)).0;
            }
        }
        store_bytes(dst.as_mut_ptr().add(i) as *mut u8, codes, k.order, true);
    }
    for (i, d) in dst[..n].iter_mut().enumerate().skip(vectors) {
        *d = i8_code(src.get(i), scale);
    }
}

/// The constants of a row's codes.
struct Codes {
    scale: __m256,
    inverse: __m256,
    magic: __m256,
    magic_bits: __m256i,
    /// Distances from an integer past which a product may round otherwise than the
    /// quotient.
    near: __m256,
    abs_mask: __m256,
    order: __m256i,
}

impl Codes {
    #[inline(always)]
    unsafe fn new(scale: f32) -> Codes {
        Codes {
            scale: _mm256_set1_ps(scale),
            inverse: _mm256_set1_ps(1.0 / scale),
            magic: _mm256_set1_ps(12_582_912.0),
            magic_bits: _mm256_set1_epi32(12_582_912f32.to_bits() as i32),
            near: _mm256_set1_ps(0.5 - 1.0 / 16384.0),
            abs_mask: _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)),
            order: _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        }
    }

    /// `y` rounded to the nearest integer (ties to even) in 32-bit lanes, and each lane's
    /// distance from it (past [`Codes::near`], within the error bound of a half).
    #[inline(always)]
    unsafe fn round(&self, y: __m256) -> (__m256i, __m256) {
        let shifted = _mm256_add_ps(y, self.magic);
        let q = _mm256_sub_epi32(_mm256_castps_si256(shifted), self.magic_bits);
        let back = _mm256_sub_ps(shifted, self.magic);
        (q, _mm256_and_ps(_mm256_sub_ps(y, back), self.abs_mask))
    }
}

/// The largest magnitude bits of sixteen lanes and of the row's `tail` past them, and
/// the smallest less one: where the AVX2 and AVX-512 scans of a float16 row end.
#[inline(always)]
pub(super) unsafe fn fold_range(top: __m256i, low: __m256i, tail: &[half::f16]) -> (u16, u16) {
    // Across the lanes: the maximum as the minimum of the complements (phminposuw).
    let t = _mm_max_epu16(
        _mm256_castsi256_si128(top),
        _mm256_extracti128_si256::<1>(top),
    );
    let t = _mm_minpos_epu16(_mm_xor_si128(t, _mm_set1_epi16(-1)));
    let l = _mm_min_epu16(
        _mm256_castsi256_si128(low),
        _mm256_extracti128_si256::<1>(low),
    );
    let l = _mm_minpos_epu16(l);
    let mut top = !(_mm_extract_epi16::<0>(t) as u16);
    let mut low = _mm_extract_epi16::<0>(l) as u16;
    for h in tail {
        let a = h.to_bits() & 0x7fff;
        (top, low) = (top.max(a), low.min(a.wrapping_sub(1)));
    }
    (top, low)
}
