//! Decode rows scored and accumulated straight from the stored K/V (AVX2 + FMA + F16C).
//!
//! A decode item has few query rows per KV head (a GQA group), so converting a run of
//! keys and values to f32 scratch first costs more than the arithmetic it feeds: every
//! element is stored once and loaded again per row. Here each 16 stored elements are
//! converted in registers and used at once by up to [`BLOCK_ROWS`] rows; a key's scale
//! multiplies its score and a value's scale its weight, so 8-bit codes are never scaled
//! element by element.

use std::arch::x86_64::*;
use std::ops::Range;

use super::kernel::{BLOCK_ROWS, RUN};
use super::math::{fp8_factor, fp8x16_to_f16};
use super::KvPages;
use crate::dtype::DType;

/// Elements converted per step: two AVX2 registers of f32.
pub(super) const STEP: usize = 16;

/// Whether rows of `head_dim` elements can take the fused path (whole steps).
pub(super) fn applies(head_dim: usize) -> bool {
    head_dim.is_multiple_of(STEP)
}

/// One storage dtype's conversion of 16 consecutive elements to f32 (unscaled).
trait Codes {
    /// Bytes per element.
    const SIZE: usize;
    /// What multiplies the converted elements to give the stored values.
    const FACTOR: f32 = 1.0;
    /// Elements `p[0..16]` as two vectors of eight f32.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 elements; the CPU must have AVX2 and F16C.
    unsafe fn load16(p: *const u8) -> (__m256, __m256);
}

/// float32 elements.
struct F32Codes;
/// float16 elements.
struct F16Codes;
/// bfloat16 elements.
struct Bf16Codes;
/// fp8 codes: E4M3 when `E4M3`, else E5M2.
struct Fp8Codes<const E4M3: bool>;
/// int8 codes (their scales are applied by the callers).
struct I8Codes;

impl Codes for F32Codes {
    const SIZE: usize = 4;
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        let p = p as *const f32;
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
}

impl Codes for F16Codes {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        let p = p as *const __m128i;
        (
            _mm256_cvtph_ps(_mm_loadu_si128(p)),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
        )
    }
}

impl Codes for Bf16Codes {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        let p = p as *const __m128i;
        let widen =
            |h: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        (widen(_mm_loadu_si128(p)), widen(_mm_loadu_si128(p.add(1))))
    }
}

impl<const E4M3: bool> Codes for Fp8Codes<E4M3> {
    const SIZE: usize = 1;
    const FACTOR: f32 = fp8_factor(E4M3);
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        let (lo, hi) = fp8x16_to_f16(_mm_loadu_si128(p as *const __m128i), E4M3);
        (_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi))
    }
}

impl Codes for I8Codes {
    const SIZE: usize = 1;
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> (__m256, __m256) {
        let p = p as *const __m128i;
        let b = _mm_loadu_si128(p);
        (
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))),
        )
    }
}

/// One KV head's keys and values over a run of positions of one block: the key of the
/// run's position `j` at element offset `first + j * kv.pos_stride`.
#[derive(Clone, Copy)]
pub(super) struct HeadRun<'a, 'b> {
    /// Where the sequence's K/V lie.
    pub kv: &'b KvPages<'a>,
    /// The KV head.
    pub head: usize,
    /// Element offset of the run's first key.
    pub first: usize,
}

impl HeadRun<'_, '_> {
    /// The scale of the key (or the value, when `value`) at position `j` of the run.
    #[inline(always)]
    fn scale(&self, j: usize, value: bool) -> f32 {
        let at = self.first + j * self.kv.pos_stride + if value { self.kv.v_offset } else { 0 };
        self.kv.scale(at, self.head, value)
    }

    /// The first stored byte of the run's first key (or value) in storage of `size`-byte
    /// elements.
    ///
    /// # Safety
    /// `kv` must describe live storage.
    #[inline(always)]
    unsafe fn base(&self, size: usize, value: bool) -> *const u8 {
        let at = self.first + if value { self.kv.v_offset } else { 0 };
        self.kv.data.add(at * size)
    }
}

/// Calls `$f::<codes type, rows>($args)` for the storage dtype and the row count (1 to
/// [`BLOCK_ROWS`]).
macro_rules! dispatch {
    ($f:ident, $dtype:expr, $rows:expr, $($arg:expr),*) => {{
        macro_rules! rows {
            ($c:ty) => {
                match $rows {
                    1 => $f::<$c, 1>($($arg),*),
                    2 => $f::<$c, 2>($($arg),*),
                    3 => $f::<$c, 3>($($arg),*),
                    _ => $f::<$c, 4>($($arg),*),
                }
            };
        }
        match $dtype {
            DType::F32 => rows!(F32Codes),
            DType::F16 => rows!(F16Codes),
            DType::BF16 => rows!(Bf16Codes),
            DType::F8E4M3 => rows!(Fp8Codes<true>),
            DType::F8E5M2 => rows!(Fp8Codes<false>),
            DType::I8 => rows!(I8Codes),
        }
    }};
}

/// `out[r][j] = (q_r . k_j) * scale(k_j)` for the `rows` query rows of `q` (`[rows][d]`,
/// `1..=BLOCK_ROWS`) and the first `n` keys of `run`.
///
/// # Safety
/// The keys must lie in `kv`'s storage; the CPU must have AVX2, FMA and F16C;
/// [`applies`] must hold for `d`.
#[inline(always)]
pub(super) unsafe fn scores(
    run: HeadRun<'_, '_>,
    n: usize,
    q: &[f32],
    rows: usize,
    d: usize,
    out: &mut [[f32; RUN]; BLOCK_ROWS],
) {
    dispatch!(scores_with, run.kv.dtype, rows, run, n, q, d, out)
}

#[inline(always)]
unsafe fn scores_with<C: Codes, const R: usize>(
    run: HeadRun<'_, '_>,
    n: usize,
    q: &[f32],
    d: usize,
    out: &mut [[f32; RUN]; BLOCK_ROWS],
) {
    debug_assert!(q.len() >= R * d && n <= RUN);
    let qp = q.as_ptr();
    let stride = run.kv.pos_stride * C::SIZE;
    let base = run.base(C::SIZE, false);
    let mut j = 0;
    // Two positions at a time: 2R independent accumulator pairs per step.
    while j + 2 <= n {
        let (k0, k1) = (base.add(j * stride), base.add((j + 1) * stride));
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut c = 0;
        while c < d {
            let (a0, a1) = C::load16(k0.add(c * C::SIZE));
            let (b0, b1) = C::load16(k1.add(c * C::SIZE));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x0 = _mm256_loadu_ps(qp.add(r * d + c));
                let x1 = _mm256_loadu_ps(qp.add(r * d + c + 8));
                acc[0] = _mm256_fmadd_ps(x0, a0, acc[0]);
                acc[0] = _mm256_fmadd_ps(x1, a1, acc[0]);
                acc[1] = _mm256_fmadd_ps(x0, b0, acc[1]);
                acc[1] = _mm256_fmadd_ps(x1, b1, acc[1]);
            }
            c += STEP;
        }
        let (s0, s1) = (run.scale(j, false), run.scale(j + 1, false));
        for (r, acc) in acc.iter().enumerate() {
            out[r][j] = hsum(acc[0]) * C::FACTOR * s0;
            out[r][j + 1] = hsum(acc[1]) * C::FACTOR * s1;
        }
        j += 2;
    }
    if j < n {
        let k0 = base.add(j * stride);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut c = 0;
        while c < d {
            let (a0, a1) = C::load16(k0.add(c * C::SIZE));
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(r * d + c)), a0, *acc);
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(r * d + c + 8)), a1, *acc);
            }
            c += STEP;
        }
        let s0 = run.scale(j, false);
        for (r, acc) in acc.iter().enumerate() {
            out[r][j] = hsum(*acc) * C::FACTOR * s0;
        }
    }
}

/// `o_r += sum_{j in js} w[r][j] * scale(v_j) * v_j` for the output rows of `o`
/// (`[rows][d]`, one per row of `w`, `1..=BLOCK_ROWS`) and the values of `run`.
///
/// # Safety
/// As for [`scores`]; `w` is scaled in place by the values' scales.
#[inline(always)]
pub(super) unsafe fn accumulate(
    run: HeadRun<'_, '_>,
    js: Range<usize>,
    w: &mut [[f32; RUN]],
    d: usize,
    o: &mut [f32],
) {
    dispatch!(accumulate_with, run.kv.dtype, w.len(), run, js, w, d, o)
}

#[inline(always)]
unsafe fn accumulate_with<C: Codes, const R: usize>(
    run: HeadRun<'_, '_>,
    js: Range<usize>,
    w: &mut [[f32; RUN]],
    d: usize,
    o: &mut [f32],
) {
    debug_assert!(o.len() >= R * d && w.len() == R && js.end <= RUN);
    if C::FACTOR != 1.0 || !matches!(run.kv.scales, super::Scales::None) {
        for j in js.clone() {
            let s = run.scale(j, true);
            for w in w.iter_mut().take(R) {
                w[j] = w[j] * C::FACTOR * s;
            }
        }
    }
    let op = o.as_mut_ptr();
    let stride = run.kv.pos_stride * C::SIZE;
    let base = run.base(C::SIZE, true);
    let mut c = 0;
    while c < d {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm256_loadu_ps(op.add(r * d + c));
            acc[1] = _mm256_loadu_ps(op.add(r * d + c + 8));
        }
        for j in js.clone() {
            let (x0, x1) = C::load16(base.add(j * stride + c * C::SIZE));
            for (r, acc) in acc.iter_mut().enumerate() {
                let wb = _mm256_set1_ps(w[r][j]);
                acc[0] = _mm256_fmadd_ps(wb, x0, acc[0]);
                acc[1] = _mm256_fmadd_ps(wb, x1, acc[1]);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(op.add(r * d + c), acc[0]);
            _mm256_storeu_ps(op.add(r * d + c + 8), acc[1]);
        }
        c += STEP;
    }
}

/// The sum of the eight lanes.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Fp8;
    use half::{bf16, f16};

    /// `C::load16 * C::FACTOR` over every 16-element chunk of `bytes`.
    fn convert<C: Codes>(bytes: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        for chunk in bytes.chunks_exact(16 * C::SIZE) {
            let mut v = [0f32; 16];
            // SAFETY: the chunk holds 16 elements; the caller checked the CPU.
            unsafe {
                let (a, b) = C::load16(chunk.as_ptr());
                _mm256_storeu_ps(v.as_mut_ptr(), a);
                _mm256_storeu_ps(v.as_mut_ptr().add(8), b);
            }
            out.extend(v.iter().map(|x| x * C::FACTOR));
        }
        out
    }

    fn same(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{what} element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn every_dtype_converts_as_its_codec_on_every_code() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            return;
        }
        let codes: Vec<u8> = (0..=255u8).collect();
        for (f, name) in [(Fp8::E4M3, "e4m3"), (Fp8::E5M2, "e5m2")] {
            let want: Vec<f32> = codes.iter().map(|&c| f.decode(c)).collect();
            let got = match f {
                Fp8::E4M3 => convert::<Fp8Codes<true>>(&codes),
                Fp8::E5M2 => convert::<Fp8Codes<false>>(&codes),
            };
            same(&got, &want, name);
        }
        let want: Vec<f32> = codes.iter().map(|&c| c as i8 as f32).collect();
        same(&convert::<I8Codes>(&codes), &want, "int8");
        let values: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) * 0.37e-3).collect();
        let f16s: Vec<u8> = values
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect();
        let want: Vec<f32> = values.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        same(&convert::<F16Codes>(&f16s), &want, "float16");
        let bf16s: Vec<u8> = values
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        let want: Vec<f32> = values.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        same(&convert::<Bf16Codes>(&bf16s), &want, "bfloat16");
        let f32s: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        same(&convert::<F32Codes>(&f32s), &values, "float32");
    }
}
