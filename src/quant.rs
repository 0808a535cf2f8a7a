//! 8-bit formats for stored keys and values, element by element and row by row: the
//! two OCP fp8 formats (`E4M3FN`, `E5M2`) with a scale the caller gives, and symmetric
//! int8 with one scale per row (a head vector) computed from the row.
//!
//! Encoding rounds to nearest, ties to even, and saturates: a value beyond the format's
//! largest finite number (infinities included) becomes that number with its sign, so
//! no finite input is ever stored as NaN or infinity (CUDA's `__NV_SATFINITE`). NaN
//! stays NaN. Decoding is exact: every code's value is an f32. The slice encoder counts
//! the values it saturates ([`Fp8::saturates`]) in the same loop.

#[cfg(target_arch = "x86_64")]
use crate::write_avx2;

/// One of the OCP 8-bit floating-point formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8 {
    /// 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN `S.1111.111`;
    /// largest finite 448 (ml_dtypes' `float8_e4m3fn`, vLLM's and FlashInfer's fp8).
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits, IEEE-style infinities and NaNs;
    /// largest finite 57344 (`float8_e5m2`).
    E5M2,
}

impl Fp8 {
    /// Mantissa bits.
    const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8::E4M3 => 3,
            Fp8::E5M2 => 2,
        }
    }

    /// Exponent bias.
    const fn bias(self) -> i32 {
        match self {
            Fp8::E4M3 => 7,
            Fp8::E5M2 => 15,
        }
    }

    /// The largest finite value.
    pub const fn max(self) -> f32 {
        match self {
            Fp8::E4M3 => 448.0,
            Fp8::E5M2 => 57344.0,
        }
    }

    /// The smallest magnitude that saturates ([`Fp8::saturates`]): the first float past
    /// 464 for E4M3 (464, halfway between 448 and the 480 the format lacks, ties to
    /// 448's even code), 61440 for E5M2 (halfway between 57344 and 65536, whose even
    /// code is infinity).
    pub const fn saturation_limit(self) -> f32 {
        match self {
            Fp8::E4M3 => f32::from_bits(464f32.to_bits() + 1),
            Fp8::E5M2 => 61440.0,
        }
    }

    /// The smallest positive normal value, `2^(1 - bias)`.
    fn min_normal(self) -> f32 {
        f32::powi(2.0, 1 - self.bias())
    }

    /// Encodes `x`: round to nearest even, saturating at `±max()`.
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8::E4M3 => encode_as::<3, 7, 0x7e, 0x7f>(x, E4M3_LIMIT),
            Fp8::E5M2 => encode_as::<2, 15, 0x7b, 0x7e>(x, E5M2_LIMIT),
        }
    }

    /// Whether encoding `x` saturates: rounding it to nearest even would go past the
    /// largest finite value (`|x| >= saturation_limit()`, infinities included), so the
    /// encoder stores `±max()` instead, where ml_dtypes' unclamped cast gives NaN
    /// (E4M3FN) or infinity (E5M2). A value between `max()` and the limit rounds to
    /// `max()` as any value rounds to its nearest code, and does not count; NaN does not
    /// either (it stays NaN).
    #[inline(always)]
    pub fn saturates(self, x: f32) -> bool {
        x.abs() >= self.saturation_limit()
    }

    /// Encodes every element of `src` into `dst` (same length), as [`Fp8::encode`], and
    /// returns how many of them saturated ([`Fp8::saturates`]): 32 elements at a time
    /// with AVX-512 or AVX2 where the CPU has it (chosen at run time), the rest by one branch-free
    /// loop per format. The count costs an add per element: its compare is the one the
    /// clamp makes.
    pub fn encode_slice(self, dst: &mut [u8], src: &[f32]) -> usize {
        let n = dst.len().min(src.len());
        let (mut done, mut saturated) = (0, 0);
        #[cfg(target_arch = "x86_64")]
        if write_avx2::avx512::available() {
            // SAFETY: the CPU has AVX-512 F, BW and VL.
            (done, saturated) =
                unsafe { write_avx2::avx512::encode_fp8(&mut dst[..n], &src[..n], self.format()) };
        } else if write_avx2::available() {
            // SAFETY: the CPU has AVX2.
            (done, saturated) =
                unsafe { write_avx2::fp8::encode_fp8(&mut dst[..n], &src[..n], self.format()) };
        }
        let (dst, src) = (&mut dst[done..n], &src[done..n]);
        saturated
            + match self {
                Fp8::E4M3 => encode_counting::<3, 7, 0x7e, 0x7f>(dst, src, E4M3_LIMIT),
                Fp8::E5M2 => encode_counting::<2, 15, 0x7b, 0x7e>(dst, src, E5M2_LIMIT),
            }
    }

    /// The constants of [`Fp8::encode`], for the vectorised encoder.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn format(self) -> write_avx2::fp8::Format {
        let (max, nan) = match self {
            Fp8::E4M3 => (0x7e, 0x7f),
            Fp8::E5M2 => (0x7b, 0x7e),
        };
        write_avx2::fp8::Format {
            m: self.mantissa_bits(),
            bias: self.bias(),
            max,
            nan,
            limit: self.saturation_limit(),
        }
    }

    /// The value of `code`.
    pub fn decode(self, code: u8) -> f32 {
        self.table()[code as usize]
    }

    /// The value of every code, by its index.
    pub fn table(self) -> &'static [f32; 256] {
        static E4M3: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
        static E5M2: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
        let cell = match self {
            Fp8::E4M3 => &E4M3,
            Fp8::E5M2 => &E5M2,
        };
        cell.get_or_init(|| std::array::from_fn(|c| self.decode_slow(c as u8)))
    }

    /// The value of `code` from its fields.
    fn decode_slow(self, code: u8) -> f32 {
        let m = self.mantissa_bits();
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = ((code & 0x7f) >> m) as i32;
        let man = (code & ((1 << m) - 1)) as f32;
        let top = (1 << (7 - m)) - 1;
        match self {
            Fp8::E4M3 if code & 0x7f == 0x7f => return f32::NAN,
            Fp8::E5M2 if exp == top && man != 0.0 => return f32::NAN,
            Fp8::E5M2 if exp == top => return sign * f32::INFINITY,
            _ => {}
        }
        let frac = man / (1 << m) as f32;
        if exp == 0 {
            sign * frac * self.min_normal()
        } else {
            sign * (1.0 + frac) * f32::powi(2.0, exp - self.bias())
        }
    }

    /// Stores `src / scale` into `dst` (same length).
    pub fn quantize_row(self, dst: &mut [u8], src: &[f32], scale: f32) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = self.encode(x / scale);
        }
    }

    /// Reads `dst[i] = value(src[i]) * scale` (same length).
    pub fn dequantize_row(self, dst: &mut [f32], src: &[u8], scale: f32) {
        let table = self.table();
        for (d, &c) in dst.iter_mut().zip(src) {
            *d = table[c as usize] * scale;
        }
    }
}

/// [`Fp8::saturation_limit`] of each format, as constants for the encoder's loops.
const E4M3_LIMIT: f32 = Fp8::E4M3.saturation_limit();
const E5M2_LIMIT: f32 = Fp8::E5M2.saturation_limit();

/// `y` rounded to the nearest integer, ties to even, for `|y| < 2^22`: adding 1.5 * 2^23
/// leaves the rounding to the FPU and the integer in the sum's low mantissa bits, so no
/// call, branch or float-to-int conversion is needed (a loop of it vectorises).
#[inline(always)]
fn round_small(y: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    (y + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

/// [`Fp8::encode`] for a format of `M` mantissa bits and exponent bias `BIAS`, whose
/// largest finite value has code `MAX`, NaN code `NAN` (sign bit clear), and magnitudes
/// from `limit` on round past the largest value ([`Fp8::saturation_limit`]). Both paths
/// are computed and the result selected, so that a loop of it vectorises: subnormals
/// are a multiple of `2^(1 - BIAS - M)` (scaling by a power of two is exact, and a
/// result of `2^M` is the smallest normal's code, as it should be); normals round the
/// f32 mantissa to `M` bits (a carry moves into the exponent) and rebias the exponent.
/// Magnitudes below `limit` round to `MAX` at most; from `limit` on, `MAX` is stored
/// (the compare [`encode_counting`] counts with, so that counting costs no second one).
#[inline(always)]
fn encode_as<const M: u32, const BIAS: i32, const MAX: u32, const NAN: u32>(
    x: f32,
    limit: f32,
) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let a = f32::from_bits(bits & 0x7fff_ffff);
    let abits = bits & 0x7fff_ffff;
    // 2^(1 - BIAS), the smallest normal, and 2^(BIAS - 1 + M), the subnormal step's
    // inverse, built from their exponent fields.
    let min_normal = f32::from_bits(((128 - BIAS) as u32) << 23);
    let sub_scale = f32::from_bits(((126 + BIAS + M as i32) as u32) << 23);
    let drop = 23 - M;
    let subnormal = round_small(a * sub_scale) as u32;
    let normal = ((abits + (1 << (drop - 1)) - 1 + ((abits >> drop) & 1)) >> drop)
        .wrapping_sub(((127 - BIAS) as u32) << M);
    let code = if a < min_normal { subnormal } else { normal };
    let code = if a >= limit { MAX } else { code.min(MAX) };
    let code = if a.is_nan() { NAN } else { code };
    (sign | code) as u8
}

/// Encodes `src` into `dst` as [`encode_as`] and counts the elements that saturate:
/// magnitudes from `limit` on (NaN compares false). The count runs in 32-bit lanes
/// beside the encoder's, chunk by chunk so that it cannot overflow.
#[inline(always)]
fn encode_counting<const M: u32, const BIAS: i32, const MAX: u32, const NAN: u32>(
    dst: &mut [u8],
    src: &[f32],
    limit: f32,
) -> usize {
    const CHUNK: usize = 1 << 16;
    let mut total = 0usize;
    for (dst, src) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        let mut n = 0u32;
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = encode_as::<M, BIAS, MAX, NAN>(x, limit);
            n += (x.abs() >= limit) as u32;
        }
        total += n as usize;
    }
    total
}

/// The largest magnitude an int8 code stores: codes are symmetric, `-127..=127`.
pub const I8_MAX: f32 = 127.0;

/// Quantizes one row symmetrically into `dst` (same length) and returns its scale:
/// `scale = max|x| / 127` and `q = clamp(round_ties_even(x / scale), -127, 127)`, in
/// f32 (NaNs count as zero). An all-zero row has scale 0 and codes 0.
///
/// It saturates like fp8: infinities count as `±f32::MAX` (code ±127), and when
/// `max|x| / 127` rounds up so far that `127 * scale` would overflow, the scale is the
/// largest float with `127 * scale <= f32::MAX`. Every dequantized value is finite.
pub fn quantize_row_i8(dst: &mut [i8], src: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if write_avx2::available() {
        // SAFETY: the CPU has AVX2.
        return unsafe { write_avx2::int8::quantize_row(dst, src) };
    }
    quantize_row_i8_scalar(dst, src)
}

/// [`quantize_row_i8`] one element at a time: the reference the vectorised loop equals.
pub(crate) fn quantize_row_i8_scalar(dst: &mut [i8], src: &[f32]) -> f32 {
    let amax = src
        .iter()
        .fold(0f32, |m, &x| if x.abs() > m { x.abs() } else { m });
    if amax == 0.0 {
        dst.fill(0);
        return 0.0;
    }
    let scale = i8_scale(amax);
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = i8_code(x, scale);
    }
    scale
}

/// The code of `x` in a row of `scale`: |x / scale| <= 127 except for infinities and,
/// with a stepped-down scale, the row's largest values, which the clamp saturates
/// (before rounding, so that the rounding trick stays in its range); NaN is 0.
#[inline(always)]
pub(crate) fn i8_code(x: f32, scale: f32) -> i8 {
    let q = round_small((x / scale).clamp(-I8_MAX, I8_MAX));
    if x.is_nan() {
        0
    } else {
        q as i8
    }
}

/// The scale of a row whose largest magnitude is `amax` (> 0, possibly infinite):
/// `amax / 127`, with `amax` saturated to `f32::MAX`, stepped down one ulp when
/// `127 * scale` would overflow (only `f32::MAX / 127` rounds that far up).
#[inline(always)]
pub(crate) fn i8_scale(amax: f32) -> f32 {
    let scale = amax.min(f32::MAX) / I8_MAX;
    if (scale * I8_MAX).is_infinite() {
        f32::from_bits(scale.to_bits() - 1)
    } else {
        scale
    }
}

/// Reads `dst[i] = src[i] * scale` (same length).
pub fn dequantize_row_i8(dst: &mut [f32], src: &[i8], scale: f32) {
    for (d, &q) in dst.iter_mut().zip(src) {
        *d = q as f32 * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reference: the finite code nearest to `x` (saturating), ties to the even
    /// code, found by searching every code's decoded value.
    fn nearest(f: Fp8, x: f32) -> u8 {
        let x = x.clamp(-f.max(), f.max());
        let mut best: Option<(f64, u8)> = None;
        for c in 0..=255u8 {
            let v = f.decode(c);
            if !v.is_finite() || (v == 0.0 && c == 0x80) {
                continue; // -0 is x = -0's code only; checked separately
            }
            let d = (v as f64 - x as f64).abs();
            let better = match best {
                None => true,
                Some((bd, bc)) => d < bd || (d == bd && c & 1 == 0 && bc & 1 == 1),
            };
            if better {
                best = Some((d, c));
            }
        }
        let c = best.expect("some code").1;
        // A negative value that rounds to zero keeps its sign.
        if c == 0 && x.is_sign_negative() {
            0x80
        } else {
            c
        }
    }

    #[test]
    fn the_slice_encoder_equals_the_scalar_one_on_any_bits() {
        let xs: Vec<f32> = (0..200_000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .collect();
        for f in [Fp8::E4M3, Fp8::E5M2] {
            let mut out = vec![0u8; xs.len()];
            f.encode_slice(&mut out, &xs);
            for (x, c) in xs.iter().zip(&out) {
                assert_eq!(*c, f.encode(*x), "{f:?} {x}");
            }
        }
    }

    #[test]
    fn decoding_matches_the_formats_definitions() {
        let e4 = Fp8::E4M3;
        assert_eq!(e4.decode(0x7e), 448.0);
        assert_eq!(e4.decode(0xfe), -448.0);
        assert_eq!(e4.decode(0x08), f32::powi(2.0, -6)); // smallest normal
        assert_eq!(e4.decode(0x01), f32::powi(2.0, -9)); // smallest subnormal
        assert_eq!(e4.decode(0x38), 1.0);
        assert!(e4.decode(0x7f).is_nan() && e4.decode(0xff).is_nan());
        let e5 = Fp8::E5M2;
        assert_eq!(e5.decode(0x7b), 57344.0);
        assert_eq!(e5.decode(0x04), f32::powi(2.0, -14));
        assert_eq!(e5.decode(0x01), f32::powi(2.0, -16));
        assert_eq!(e5.decode(0x3c), 1.0);
        assert_eq!(e5.decode(0x7c), f32::INFINITY);
        assert!(e5.decode(0x7e).is_nan());
        // E5M2 is the top byte of an IEEE half: every finite code agrees with half.
        for c in 0..=255u8 {
            let h = half::f16::from_bits((c as u16) << 8).to_f32();
            let v = e5.decode(c);
            assert!(v == h || (v.is_nan() && h.is_nan()), "{c:#x}");
        }
    }

    #[test]
    fn every_code_round_trips_and_saturation_never_makes_nan_or_inf() {
        for f in [Fp8::E4M3, Fp8::E5M2] {
            for c in 0..=255u8 {
                let v = f.decode(c);
                if v.is_finite() {
                    assert_eq!(f.encode(v), c, "{f:?} {c:#x}");
                }
            }
            let max_code = f.encode(f.max());
            assert_eq!(f.decode(max_code), f.max());
            for x in [f32::INFINITY, 1e30, f.max() * 1.06, f.max() + 1.0] {
                assert_eq!(f.encode(x), max_code);
                assert_eq!(f.encode(-x), 0x80 | max_code);
            }
            assert!(f.decode(f.encode(f32::NAN)).is_nan());
            assert_eq!(f.encode(0.0), 0);
            assert_eq!(f.encode(-0.0), 0x80);
        }
    }

    #[test]
    fn ties_go_to_the_even_code() {
        let e4 = Fp8::E4M3;
        // 1 + 1/16 is halfway between 1 (0x38) and 1 + 1/8 (0x39): even wins.
        assert_eq!(e4.encode(1.0 + 1.0 / 16.0), 0x38);
        // 1 + 3/16 is halfway between 0x39 and 0x3a: even (0x3a) wins.
        assert_eq!(e4.encode(1.0 + 3.0 / 16.0), 0x3a);
        // Halfway between the two smallest subnormals.
        assert_eq!(e4.encode(1.5 * f32::powi(2.0, -9)), 0x02);
        assert_eq!(e4.encode(0.5 * f32::powi(2.0, -9)), 0x00);
    }

    #[test]
    fn int8_rows_are_symmetric_and_exact_at_the_extremes() {
        let src = [0.5f32, -2.0, 1.0, 0.0, f32::NAN];
        let mut q = [0i8; 5];
        let scale = quantize_row_i8(&mut q, &src);
        assert_eq!(scale, 2.0 / 127.0);
        assert_eq!(q, [32, -127, 64, 0, 0]);
        let mut back = [0f32; 5];
        dequantize_row_i8(&mut back, &q, scale);
        assert_eq!(back[1], -2.0);
        assert_eq!(quantize_row_i8(&mut q, &[0.0; 5]), 0.0);
        assert_eq!(q, [0; 5]);
        let s = quantize_row_i8(&mut q[..2], &[f32::INFINITY, 1.0]);
        assert!(s.is_finite() && q[..2] == [127, 0]);
    }

    /// Quantizes `row` and returns its codes, scale and dequantized values.
    fn int8_round_trip(row: &[f32]) -> (Vec<i8>, f32, Vec<f32>) {
        let mut q = vec![0i8; row.len()];
        let scale = quantize_row_i8(&mut q, row);
        let mut back = vec![0f32; row.len()];
        dequantize_row_i8(&mut back, &q, scale);
        (q, scale, back)
    }

    #[test]
    fn int8_saturates_at_the_largest_float() {
        let m = f32::MAX;
        // The scale is the largest float whose 127 multiple is finite.
        let top = f32::from_bits((m / I8_MAX).to_bits() - 1);
        assert!((m / I8_MAX * I8_MAX).is_infinite(), "max / 127 rounds up");
        assert!((top * I8_MAX).is_finite());
        let rows: [&[f32]; 6] = [
            &[m],
            &[-m, 1.0],
            &[f32::INFINITY, -1e30, 0.0],
            &[f32::NEG_INFINITY, m],
            &[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 3e38],
            &[1.0, m, -m, 2e38, -3e38],
        ];
        for row in rows {
            let (q, scale, back) = int8_round_trip(row);
            assert_eq!(scale, top, "{row:?}");
            assert!(back.iter().all(|v| v.is_finite()), "{row:?} -> {back:?}");
            for ((&x, &c), &y) in row.iter().zip(&q).zip(&back) {
                match x {
                    _ if x.is_nan() => assert_eq!(c, 0),
                    _ if x.abs() >= m => assert_eq!(c, if x > 0.0 { 127 } else { -127 }),
                    _ => assert!((x - y).abs() <= 0.5 * scale, "{x} -> {y}"),
                }
            }
        }
        // Just below the overflow, amax / 127 is kept.
        let below = f32::from_bits(m.to_bits() - 1);
        assert_eq!(int8_round_trip(&[below]).1, below / I8_MAX);
    }

    /// The reference count, one element at a time: those whose nearest value, found
    /// by rounding without a largest value (`nearest_unbounded`), lies past the format's
    /// largest finite value (NaN never counts).
    fn saturated_reference(f: Fp8, xs: &[f32]) -> usize {
        xs.iter()
            .filter(|x| !x.is_nan() && nearest_unbounded(f, x.abs() as f64) > f.max() as f64)
            .count()
    }

    /// `a` (>= 0) rounded to nearest, ties to even, among the values of `f`'s normal
    /// binade pattern continued past its largest exponent: what a format with no
    /// largest value would store.
    fn nearest_unbounded(f: Fp8, a: f64) -> f64 {
        if a.is_infinite() || a >= 2.0 * f.max() as f64 {
            return f64::INFINITY;
        }
        if a < f.max() as f64 {
            return a; // below the top: rounds to a finite code at most max
        }
        // [max, 2 max): the top binade, steps of 2^(e - M); max is 1.75 * 2^e in both.
        let step = f.max() as f64 / 7.0 * if f == Fp8::E4M3 { 0.5 } else { 1.0 };
        let k = a / step;
        let (lo, frac) = (k.floor(), k - k.floor());
        let q = if frac > 0.5 || (frac == 0.5 && lo as i64 % 2 == 1) {
            lo + 1.0
        } else {
            lo
        };
        q * step
    }

    #[test]
    fn saturation_counts_what_rounds_past_the_largest_value() {
        for f in [Fp8::E4M3, Fp8::E5M2] {
            let m = f.max();
            let limit = f.saturation_limit();
            let below = f32::from_bits(limit.to_bits() - 1);
            let just_past_max = f32::from_bits(m.to_bits() + 1);
            let xs = [
                m,
                -m,
                just_past_max, // rounds to max: not saturated
                below,
                limit,
                -limit,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -f32::NAN,
                0.0,
                1e30,
            ];
            let mut out = [0u8; 12];
            assert_eq!(f.encode_slice(&mut out, &xs), 5, "{f:?}");
            assert_eq!(saturated_reference(f, &xs), 5, "{f:?}");
            assert!(!f.saturates(m) && !f.saturates(below) && f.saturates(limit));
            assert!(!f.saturates(f32::NAN));
            // Saturated elements are stored as the largest value, with their sign; the
            // values below the limit round to it.
            for (i, want) in [(2, m), (3, m), (4, m), (5, -m), (7, -m), (11, m)] {
                assert_eq!(f.decode(out[i]), want, "{f:?} {}", xs[i]);
            }
        }
        // The halfway points: E4M3's 464 ties to 448's even code, E5M2's 61440 to
        // infinity's.
        assert!(!Fp8::E4M3.saturates(464.0) && Fp8::E4M3.saturates(464.00003));
        assert!(!Fp8::E5M2.saturates(61439.996) && Fp8::E5M2.saturates(61440.0));
    }

    proptest! {
        #[test]
        fn the_counting_encoder_counts_what_a_scalar_loop_counts(
            bits in prop::collection::vec(any::<u32>(), 0..600),
            values in prop::collection::vec(-1e5f32..1e5, 0..600),
            scale in 0.001f32..1000.0,
        ) {
            // Any bit patterns (NaNs and infinities included), and values around the
            // formats' largest ones, divided by a scale as the caches do.
            let xs: Vec<f32> = bits
                .iter()
                .map(|&b| f32::from_bits(b))
                .chain(values.iter().map(|&v| v / scale))
                .collect();
            for f in [Fp8::E4M3, Fp8::E5M2] {
                let mut out = vec![0u8; xs.len()];
                let n = f.encode_slice(&mut out, &xs);
                prop_assert_eq!(n, saturated_reference(f, &xs), "{:?}", f);
                for (x, c) in xs.iter().zip(&out) {
                    prop_assert_eq!(*c, f.encode(*x));
                }
            }
        }

        #[test]
        fn conversions_and_strided_copies_count_what_they_clamp(
            values in prop::collection::vec(-1e6f32..1e6, 1..700),
            transpose in any::<bool>(),
        ) {
            use crate::dtype::{convert_contiguous, DType};
            use crate::tensor::copy_strided;
            for (f, dtype) in [(Fp8::E4M3, DType::F8E4M3), (Fp8::E5M2, DType::F8E5M2)] {
                let want = saturated_reference(f, &values);
                let mut out = vec![0u8; values.len()];
                // SAFETY: both buffers hold `values.len()` elements of their dtypes.
                let n = unsafe {
                    convert_contiguous(
                        out.as_mut_ptr(), dtype, values.as_ptr() as *const u8, DType::F32, values.len(),
                    )
                };
                prop_assert_eq!(n, want);
                // The element-by-element path (a non-unit inner stride) counts the same.
                let len = values.len();
                let (rows, cols) = if transpose && len % 2 == 0 { (2, len / 2) } else { (1, len) };
                let dst_strides = if rows == 2 { [0, 1, 2] } else { [0, 0, 1] };
                // SAFETY: every index of [1, rows, cols] lies in both buffers.
                let n = unsafe {
                    copy_strided(
                        out.as_mut_ptr(), dtype, dst_strides,
                        values.as_ptr() as *const u8, DType::F32, [0, cols as isize, 1],
                        [1, rows, cols],
                    )
                };
                prop_assert_eq!(n, want);
                // A copy of codes into codes encodes nothing.
                let codes = out.clone();
                // SAFETY: as above, both of `len` fp8 elements.
                let n = unsafe {
                    copy_strided(
                        out.as_mut_ptr(), dtype, [0, 0, 1],
                        codes.as_ptr(), dtype, [0, 0, 1], [1, 1, len],
                    )
                };
                prop_assert_eq!(n, 0);
            }
        }

        #[test]
        fn encoding_is_the_nearest_code(bits in any::<u32>(), small in -20.0f32..20.0) {
            for f in [Fp8::E4M3, Fp8::E5M2] {
                // Any f32, and values spread over the format's range (subnormals included).
                for x in [f32::from_bits(bits), small.exp2() * if bits & 1 == 0 { 1.0 } else { -1.0 }] {
                    if x.is_nan() {
                        continue;
                    }
                    prop_assert_eq!(f.encode(x), nearest(f, x), "{:?} {}", f, x);
                }
            }
        }

        #[test]
        fn int8_error_is_at_most_half_a_step(row in prop::collection::vec(-1e4f32..1e4, 1..64)) {
            let (_, scale, back) = int8_round_trip(&row);
            for (x, y) in row.iter().zip(&back) {
                prop_assert!((x - y).abs() <= 0.5 * scale * (1.0 + 1e-5) + f32::EPSILON * x.abs());
            }
        }

        #[test]
        fn int8_dequantizes_finite_values_from_any_non_nan_row(
            bits in prop::collection::vec(any::<u32>(), 1..64),
            huge in prop::collection::vec(any::<bool>(), 64),
        ) {
            // Any float (infinities included, NaNs skipped), half of them pushed up
            // against f32::MAX so that the overflowing scale is hit often.
            let row: Vec<f32> = bits
                .iter()
                .zip(&huge)
                .map(|(&b, &h)| f32::from_bits(if h { b | 0x7f7f_fff0 } else { b }))
                .filter(|x| !x.is_nan())
                .collect();
            let (_, scale, back) = int8_round_trip(&row);
            prop_assert!(scale.is_finite() && (scale * I8_MAX).is_finite());
            for (x, y) in row.iter().zip(&back) {
                prop_assert!(y.is_finite(), "{} -> {}", x, y);
                if x.is_finite() {
                    // Half a step, plus the few ulps a stepped-down scale costs at the top.
                    prop_assert!(
                        (x - y).abs() <= 0.5 * scale * (1.0 + 1e-5) + f32::EPSILON * x.abs(),
                        "{} -> {} (scale {})", x, y, scale
                    );
                }
            }
        }
    }
}
