//! 8-bit formats for stored keys and values, element by element and row by row: the
//! two OCP fp8 formats (`E4M3FN`, `E5M2`) with a scale the caller gives, and symmetric
//! int8 with one scale per row (a head vector) computed from the row.
//!
//! Encoding rounds to nearest, ties to even, and saturates: a value beyond the format's
//! largest finite number (infinities included) becomes that number with its sign, so
//! no finite input is ever stored as NaN or infinity (CUDA's `__NV_SATFINITE`). NaN
//! stays NaN. Decoding is exact: every code's value is an f32.

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

    /// The smallest positive normal value, `2^(1 - bias)`.
    fn min_normal(self) -> f32 {
        f32::powi(2.0, 1 - self.bias())
    }

    /// Encodes `x`: round to nearest even, saturating at `±max()`.
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8::E4M3 => encode_as::<3, 7, 0x7e, 0x7f>(x, 448.0),
            Fp8::E5M2 => encode_as::<2, 15, 0x7b, 0x7e>(x, 57344.0),
        }
    }

    /// Encodes every element of `src` into `dst` (same length), as [`Fp8::encode`]:
    /// one branch-free loop per format, which the compiler vectorises (with AVX2 where
    /// the CPU has it, chosen at run time).
    pub fn encode_slice(self, dst: &mut [u8], src: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { self.encode_slice_avx2(dst, src) };
        }
        self.encode_slice_with(dst, src)
    }

    /// [`Fp8::encode_slice`] compiled for AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn encode_slice_avx2(self, dst: &mut [u8], src: &[f32]) {
        self.encode_slice_with(dst, src)
    }

    /// The loop of [`Fp8::encode_slice`], inlined into each build.
    #[inline(always)]
    fn encode_slice_with(self, dst: &mut [u8], src: &[f32]) {
        match self {
            Fp8::E4M3 => {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = encode_as::<3, 7, 0x7e, 0x7f>(x, 448.0);
                }
            }
            Fp8::E5M2 => {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = encode_as::<2, 15, 0x7b, 0x7e>(x, 57344.0);
                }
            }
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

/// `y` rounded to the nearest integer, ties to even, for `|y| < 2^22`: adding 1.5 * 2^23
/// leaves the rounding to the FPU and the integer in the sum's low mantissa bits, so no
/// call, branch or float-to-int conversion is needed (a loop of it vectorises).
#[inline(always)]
fn round_small(y: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    (y + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

/// [`Fp8::encode`] for a format of `M` mantissa bits and exponent bias `BIAS`, whose
/// largest finite value is `max`, its code `MAX`, and NaN code `NAN` (sign bit clear). Both paths are
/// computed and the result selected, so that a loop of it vectorises: subnormals are a
/// multiple of `2^(1 - BIAS - M)` (scaling by a power of two is exact, and a result of
/// `2^M` is the smallest normal's code, as it should be); normals round the f32
/// mantissa to `M` bits (a carry moves into the exponent) and rebias the exponent.
#[inline(always)]
fn encode_as<const M: u32, const BIAS: i32, const MAX: u32, const NAN: u32>(
    x: f32,
    max: f32,
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
    let code = if a >= max { MAX } else { code.min(MAX) };
    let code = if a.is_nan() { NAN } else { code };
    (sign | code) as u8
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
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { quantize_row_i8_avx2(dst, src) };
    }
    quantize_row_i8_with(dst, src)
}

/// [`quantize_row_i8`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_i8_avx2(dst: &mut [i8], src: &[f32]) -> f32 {
    quantize_row_i8_with(dst, src)
}

/// The loop of [`quantize_row_i8`], inlined into each build.
#[inline(always)]
fn quantize_row_i8_with(dst: &mut [i8], src: &[f32]) -> f32 {
    let amax = src
        .iter()
        .fold(0f32, |m, &x| if x.abs() > m { x.abs() } else { m });
    if amax == 0.0 {
        dst.fill(0);
        return 0.0;
    }
    let scale = i8_scale(amax);
    for (d, &x) in dst.iter_mut().zip(src) {
        // |x / scale| <= 127 except for infinities and, with a stepped-down scale, the
        // row's largest values, which the clamp saturates (before rounding, so that the
        // rounding trick stays in its range).
        let q = round_small((x / scale).clamp(-I8_MAX, I8_MAX));
        *d = if x.is_nan() { 0 } else { q as i8 };
    }
    scale
}

/// The scale of a row whose largest magnitude is `amax` (> 0, possibly infinite):
/// `amax / 127`, with `amax` saturated to `f32::MAX`, stepped down one ulp when
/// `127 * scale` would overflow (only `f32::MAX / 127` rounds that far up).
#[inline(always)]
fn i8_scale(amax: f32) -> f32 {
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

    proptest! {
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
