//! The write path's loops with AVX2 and F16C: float16 rows to float32 ([`f16_to_f32`]),
//! floats to fp8 codes with the saturation count ([`fp8`]) and rows to int8 codes and
//! their scale ([`int8`]), each bit for bit what the scalar codec gives
//! ([`crate::quant::Fp8::encode`], [`crate::quant::quantize_row_i8`]), eight or sixteen
//! lanes at a time. Callers check [`available`] first, and [`avx512::available`] for the
//! float16 loops' AVX-512 variants, which they then take instead.

use std::arch::x86_64::*;

// The AVX-512 intrinsics are stable from Rust 1.89 (`kvrs_avx512`, set by build.rs); on
// older compilers a stand-in that is never available.
#[cfg(kvrs_avx512)]
#[clippy::msrv = "1.89"]
pub mod avx512;
#[cfg(not(kvrs_avx512))]
pub mod avx512 {
    //! AVX-512 needs Rust 1.89: never available in this build.
    #![allow(clippy::missing_safety_doc, missing_docs)]
    pub fn available() -> bool {
        false
    }
    pub unsafe fn encode_fp8_f16<const E4M3: bool>(
        _: &mut [u8],
        _: &[half::f16],
    ) -> (usize, usize) {
        unreachable!("AVX-512 loops need Rust 1.89")
    }
    pub unsafe fn encode_fp8(_: &mut [u8], _: &[f32], _: super::fp8::Format) -> (usize, usize) {
        unreachable!("AVX-512 loops need Rust 1.89")
    }
    pub unsafe fn quantize_rows_f16(
        _: usize,
        _: impl Iterator<Item = (*mut i8, *mut f32, *const half::f16)>,
    ) {
        unreachable!("AVX-512 loops need Rust 1.89")
    }
}
pub mod fp8;
pub mod int8;

/// Whether this CPU runs these loops (decided once per process by the standard library's
/// cached detection).
#[inline]
pub fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

/// Converts the leading multiple of 8 elements of `src` to `dst` (same length), eight per
/// F16C instruction, and returns how many.
///
/// # Safety
/// The CPU must have AVX2 and F16C ([`available`]).
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn f16_to_f32(dst: &mut [f32], src: &[half::f16]) -> usize {
    let n = dst.len().min(src.len()) / 8 * 8;
    for i in (0..n).step_by(8) {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    n
}

/// Stores the low bytes of 32 lanes (four vectors of eight 32-bit lanes, in order) at
/// `dst`: packed (each lane's value fits a byte, so the packs never saturate: unsigned
/// codes, or `signed` ones from -127 to 127), then put back in order across the 128-bit
/// halves the packs work in.
#[inline(always)]
pub(crate) unsafe fn store_bytes(dst: *mut u8, v: [__m256i; 4], order: __m256i, signed: bool) {
    let packed = if signed {
        let a = _mm256_packs_epi32(v[0], v[1]);
        let b = _mm256_packs_epi32(v[2], v[3]);
        _mm256_packs_epi16(a, b)
    } else {
        let a = _mm256_packus_epi32(v[0], v[1]);
        let b = _mm256_packus_epi32(v[2], v[3]);
        _mm256_packus_epi16(a, b)
    };
    // Dwords now hold vectors 0..4's first halves, then their second halves.
    let ordered = _mm256_permutevar8x32_epi32(packed, order);
    _mm256_storeu_si256(dst as *mut __m256i, ordered);
}

/// The sum of eight 32-bit lanes.
#[inline(always)]
pub(crate) unsafe fn lane_sum(v: __m256i) -> usize {
    let mut lanes = [0u32; 8];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, v);
    lanes.iter().map(|&x| x as usize).sum()
}

#[cfg(test)]
mod tests;
