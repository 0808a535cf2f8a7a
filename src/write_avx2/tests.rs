//! The vectorised loops against the scalar codec (the portable build's): every float16
//! and bfloat16, f32 bits of every kind (subnormals, ties, the saturation limits, NaN and
//! infinities), rows of any length.

use half::{bf16, f16};
use proptest::prelude::*;

use super::available;
use crate::dtype::{convert_contiguous, DType};
use crate::quant::{quantize_row_i8, quantize_row_i8_scalar, Fp8};

const FORMATS: [(Fp8, DType); 2] = [(Fp8::E4M3, DType::F8E4M3), (Fp8::E5M2, DType::F8E5M2)];

/// Every 16-bit pattern (every 97th under Miri, which runs the same paths far slower).
fn all_bits() -> impl Iterator<Item = u16> {
    (0..=u16::MAX).step_by(if cfg!(miri) { 97 } else { 1 })
}

/// The scalar codes of `xs` and how many saturate.
fn scalar_fp8(f: Fp8, xs: &[f32]) -> (Vec<u8>, usize) {
    let codes = xs.iter().map(|&x| f.encode(x)).collect();
    (codes, xs.iter().filter(|&&x| f.saturates(x)).count())
}

/// `convert_contiguous` of `src` (elements of `dtype`) into fp8 codes, with the count.
fn converted<T: Copy>(dst_dtype: DType, src: &[T], dtype: DType) -> (Vec<u8>, usize) {
    let mut out = vec![0u8; src.len()];
    // SAFETY: both buffers hold src.len() elements of their dtypes.
    let n = unsafe {
        convert_contiguous(
            out.as_mut_ptr(),
            dst_dtype,
            src.as_ptr() as *const u8,
            dtype,
            src.len(),
        )
    };
    (out, n)
}

#[test]
fn every_float16_and_bfloat16_encodes_to_the_scalar_fp8_code() {
    // All 65,536 bit patterns, then again from an odd start so the 32-lane blocks and the
    // tail fall elsewhere.
    let halves: Vec<f16> = all_bits().map(f16::from_bits).collect();
    let brains: Vec<bf16> = all_bits().map(bf16::from_bits).collect();
    for (f, dt) in FORMATS {
        for skip in [0, 7] {
            let xs: Vec<f32> = halves[skip..].iter().map(|h| h.to_f32()).collect();
            assert_eq!(
                converted(dt, &halves[skip..], DType::F16),
                scalar_fp8(f, &xs),
                "{f:?} f16"
            );
            check_f32_encoders(f, &xs);
            let xs: Vec<f32> = brains[skip..].iter().map(|h| h.to_f32()).collect();
            check_f32_encoders(f, &xs);
            assert_eq!(
                converted(dt, &brains[skip..], DType::BF16),
                scalar_fp8(f, &xs),
                "{f:?} bf16"
            );
        }
    }
}

/// The float16 loops each CPU runs: AVX2, and AVX-512 where it has it (each skipped
/// where it does not).
fn f16_encoders() -> Vec<(&'static str, F16Encoder)> {
    let mut all: Vec<(&'static str, F16Encoder)> = Vec::new();
    if available() {
        all.push(("avx2", |e4m3, dst, src| {
            // SAFETY: checked above.
            unsafe {
                if e4m3 {
                    super::fp8::encode_fp8_f16::<true>(dst, src)
                } else {
                    super::fp8::encode_fp8_f16::<false>(dst, src)
                }
            }
        }));
    }
    if super::avx512::available() {
        all.push(("avx512", |e4m3, dst, src| {
            // SAFETY: checked above.
            unsafe {
                if e4m3 {
                    super::avx512::encode_fp8_f16::<true>(dst, src)
                } else {
                    super::avx512::encode_fp8_f16::<false>(dst, src)
                }
            }
        }));
    }
    all
}

type F32Encoder = fn(&mut [u8], &[f32], Fp8) -> (usize, usize);

/// The f32 encoders each CPU runs, as [`f16_encoders`].
fn f32_encoders() -> Vec<(&'static str, F32Encoder)> {
    let mut all: Vec<(&'static str, F32Encoder)> = Vec::new();
    if available() {
        // SAFETY: checked above.
        all.push(("avx2", |dst, src, f| unsafe {
            super::fp8::encode_fp8(dst, src, f.format())
        }));
    }
    if super::avx512::available() {
        // SAFETY: checked above.
        all.push(("avx512", |dst, src, f| unsafe {
            super::avx512::encode_fp8(dst, src, f.format())
        }));
    }
    all
}

/// Each f32 encoder's codes and count for the leading whole blocks of `xs` against the
/// scalar ones.
fn check_f32_encoders(f: Fp8, xs: &[f32]) {
    for (name, encode) in f32_encoders() {
        let mut out = vec![0u8; xs.len()];
        let (n, saturated) = encode(&mut out, xs, f);
        assert_eq!(n, xs.len() / 32 * 32, "{name}");
        let (codes, count) = scalar_fp8(f, &xs[..n]);
        for (x, (a, b)) in xs.iter().zip(out.iter().zip(&codes)) {
            assert_eq!(a, b, "{name} {f:?} {:#010x}", x.to_bits());
        }
        assert_eq!(saturated, count, "{name} {f:?}");
    }
}

type F16Encoder = fn(bool, &mut [u8], &[f16]) -> (usize, usize);
type F16Quantizer = fn(usize, &mut [i8], &mut f32, &[f16]);

/// The int8 float16 row loops each CPU runs, as [`f16_encoders`].
fn f16_quantizers() -> Vec<(&'static str, F16Quantizer)> {
    let mut all: Vec<(&'static str, F16Quantizer)> = Vec::new();
    if available() {
        all.push(("avx2", |d, codes, scale, row| {
            let rows = std::iter::once((codes.as_mut_ptr(), scale as *mut f32, row.as_ptr()));
            // SAFETY: checked above; the pointers hold the row.
            unsafe { super::int8::quantize_rows_f16(d, rows) }
        }));
    }
    if super::avx512::available() {
        all.push(("avx512", |d, codes, scale, row| {
            let rows = std::iter::once((codes.as_mut_ptr(), scale as *mut f32, row.as_ptr()));
            // SAFETY: checked above; the pointers hold the row.
            unsafe { super::avx512::quantize_rows_f16(d, rows) }
        }));
    }
    all
}

#[test]
fn the_direct_float16_encoders_equal_the_scalar_one() {
    let halves: Vec<f16> = all_bits().map(f16::from_bits).collect();
    for (name, encode) in f16_encoders() {
        for (f, _) in FORMATS {
            // From odd starts too, so the blocks and the tail fall elsewhere.
            for skip in [0, 7, 39] {
                let halves = &halves[skip..];
                let mut out = vec![0u8; halves.len()];
                let (n, saturated) = encode(f == Fp8::E4M3, &mut out, halves);
                assert_eq!(n, halves.len() / 32 * 32);
                let xs: Vec<f32> = halves[..n].iter().map(|h| h.to_f32()).collect();
                let (codes, count) = scalar_fp8(f, &xs);
                for (h, (a, b)) in halves.iter().zip(out.iter().zip(&codes)) {
                    assert_eq!(a, b, "{name} {f:?} {:#06x}", h.to_bits());
                }
                assert_eq!(saturated, count, "{name} {f:?}");
            }
        }
    }
}

#[test]
fn float16_rows_widen_exactly() {
    let halves: Vec<f16> = all_bits().map(f16::from_bits).collect();
    let mut out = vec![0f32; halves.len() - 3];
    // SAFETY: both buffers hold out.len() elements.
    unsafe {
        let src = halves[3..].as_ptr() as *const u8;
        convert_contiguous(
            out.as_mut_ptr() as *mut u8,
            DType::F32,
            src,
            DType::F16,
            out.len(),
        );
    }
    for (h, x) in halves[3..].iter().zip(&out) {
        assert_eq!(h.to_f32().to_bits(), x.to_bits());
    }
}

/// f32 bits that reach every branch: any bits, subnormals, the codes' midpoints (ties)
/// and their neighbours, the region around each format's saturation limit.
fn f32_bits() -> impl Strategy<Value = f32> {
    let midpoint = (0u8..=255, any::<bool>(), -1i32..=1).prop_map(|(c, e4, nudge)| {
        let f = if e4 { Fp8::E4M3 } else { Fp8::E5M2 };
        let (a, b) = (f.decode(c & 0x7f) as f64, f.decode((c & 0x7f) + 1) as f64);
        let mid = if a.is_finite() && b.is_finite() {
            ((a + b) / 2.0) as f32
        } else {
            1.0
        };
        let mid = f32::from_bits(mid.to_bits().wrapping_add_signed(nudge));
        if c & 0x80 != 0 {
            -mid
        } else {
            mid
        }
    });
    let limit = (any::<bool>(), -4i32..=4).prop_map(|(e4, d)| {
        let f = if e4 { Fp8::E4M3 } else { Fp8::E5M2 };
        f32::from_bits(f.saturation_limit().to_bits().wrapping_add_signed(d))
    });
    prop_oneof![
        any::<u32>().prop_map(f32::from_bits),
        (0u32..0x0080_0000, any::<bool>()).prop_map(|(m, s)| f32::from_bits(m | (s as u32) << 31)),
        midpoint,
        limit,
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(f32::NAN),
    ]
}

/// Int8 rows: one magnitude class per row (so codes spread over -127..=127), halves of
/// the row's step (ties) and their neighbours, subnormals; with a few specials.
fn int8_row() -> impl Strategy<Value = Vec<f32>> {
    let scale = prop_oneof![
        Just(1.0f32),
        (-140i32..120).prop_map(|e| f32::powi(2.0, e)),
        any::<u32>()
            .prop_map(|b| f32::from_bits(b & 0x7fff_ffff))
            .prop_filter("finite", |s| s.is_finite() && *s > 0.0),
    ];
    (scale, 1usize..300).prop_flat_map(|(scale, n)| {
        let x = prop_oneof![
            // k + 1/2 steps (exact ties when the scale is a power of two), nudged.
            (-127i32..127, -2i32..=2).prop_map(move |(k, d)| {
                let t = (k as f32 + 0.5) * scale;
                f32::from_bits(t.to_bits().wrapping_add_signed(d))
            }),
            (-1.0f32..1.0).prop_map(move |u| u * 127.0 * scale),
            any::<u32>().prop_map(|b| f32::from_bits(b & 0x807f_ffff)),
            Just(0.0f32),
            Just(-0.0f32),
            Just(f32::NAN),
            Just(f32::INFINITY),
            Just(f32::MAX),
        ];
        // Rows have their largest magnitude at 127 steps (unless a special is larger).
        let row = prop::collection::vec(x, n).prop_map(move |mut r| {
            let top = 127.0 * scale;
            r[0] = if top.is_finite() { top } else { r[0] };
            r
        });
        (row, prop::collection::vec(any::<bool>(), n)).prop_map(|(mut r, keep_special)| {
            // Specials in roughly one row in three.
            if keep_special.iter().filter(|&&k| k).count() * 3 > r.len() * 2 {
                return r;
            }
            for x in r.iter_mut() {
                if !x.is_finite() || x.abs() == f32::MAX {
                    *x = 1.0;
                }
            }
            r
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn f32s_encode_to_the_scalar_fp8_codes(xs in prop::collection::vec(f32_bits(), 0..200)) {
        for (f, dt) in FORMATS {
            let mut codes = vec![0u8; xs.len()];
            let saturated = f.encode_slice(&mut codes, &xs);
            prop_assert_eq!((codes, saturated), scalar_fp8(f, &xs));
            prop_assert_eq!(converted(dt, &xs, DType::F32), scalar_fp8(f, &xs));
            check_f32_encoders(f, &xs);
        }
    }

    #[test]
    fn int8_rows_equal_the_scalar_quantizer(row in int8_row()) {
        let mut want = vec![0i8; row.len()];
        let want_scale = quantize_row_i8_scalar(&mut want, &row);
        let mut got = vec![0i8; row.len()];
        let scale = quantize_row_i8(&mut got, &row);
        prop_assert_eq!(scale.to_bits(), want_scale.to_bits());
        prop_assert_eq!(&got, &want);
        // The same row as float16 values, straight from their bits, by each loop.
        let halves: Vec<f16> = row.iter().map(|&x| f16::from_f32(x)).collect();
        let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
        let want_scale = quantize_row_i8_scalar(&mut want, &widened);
        for (name, quantize) in f16_quantizers() {
            let mut scale = 0f32;
            got.fill(0);
            quantize(halves.len(), &mut got, &mut scale, &halves);
            prop_assert_eq!(scale.to_bits(), want_scale.to_bits(), "{}", name);
            prop_assert_eq!(&got, &want, "{}", name);
        }
    }
}

#[test]
fn int8_ties_round_to_even_in_both_loops() {
    // amax = 127 gives scale 1: every k + 1/2 is an exact tie.
    let mut row: Vec<f32> = (-127..127).map(|k| k as f32 + 0.5).collect();
    row.push(127.0);
    let mut got = vec![0i8; row.len()];
    let mut want = vec![0i8; row.len()];
    assert_eq!(quantize_row_i8(&mut got, &row), 1.0);
    quantize_row_i8_scalar(&mut want, &row);
    assert_eq!(got, want);
    assert_eq!(&got[..4], &[-126, -126, -124, -124]);
}

#[test]
fn every_finite_float16_quantizes_to_the_scalar_int8_code() {
    // The finite values, spread over rows of 128 by a multiplicative permutation (so rows
    // mix subnormals, whose vectors convert in integers, with normals), then the small
    // ones alone (rows whose scale makes the subnormals' codes large).
    let finite: Vec<f16> = all_bits()
        .map(f16::from_bits)
        .filter(|h| h.is_finite())
        .collect();
    let spread: Vec<f16> = (0..finite.len())
        .map(|i| finite[i.wrapping_mul(40_503) % finite.len()])
        .collect();
    let small: Vec<f16> = finite
        .iter()
        .copied()
        .filter(|h| h.to_f32().abs() < 1e-3)
        .collect();
    for values in [&spread, &small] {
        // Rows of 128, and of 100 (a tail past the 32-element blocks).
        for row in values.chunks(128).chain(values.chunks(100)) {
            let widened: Vec<f32> = row.iter().map(|h| h.to_f32()).collect();
            let mut want = vec![0i8; row.len()];
            let want_scale = quantize_row_i8_scalar(&mut want, &widened);
            for (name, quantize) in f16_quantizers() {
                let (mut got, mut scale) = (vec![0i8; row.len()], 0f32);
                quantize(row.len(), &mut got, &mut scale, row);
                assert_eq!(
                    (scale.to_bits(), &got),
                    (want_scale.to_bits(), &want),
                    "{name}"
                );
            }
        }
    }
}

#[test]
fn many_float16_rows_in_one_call_equal_the_scalar_int8_rows() {
    // Every float16 in rows of 128 (specials, subnormals, zeros and normals mixed within
    // the loops' batches), with a zero row and a row of NaNs, all in one call.
    let mut values: Vec<f16> = all_bits().map(f16::from_bits).collect();
    values.extend([f16::ZERO; 128]);
    values.extend([f16::NAN; 128]);
    let d = 128;
    let rows = values.len() / d;
    let (mut want, mut want_scales) = (vec![0i8; rows * d], vec![0f32; rows]);
    for (i, row) in values.chunks(d).take(rows).enumerate() {
        let widened: Vec<f32> = row.iter().map(|h| h.to_f32()).collect();
        want_scales[i] = quantize_row_i8_scalar(&mut want[i * d..(i + 1) * d], &widened);
    }
    let mut loops: Vec<&str> = Vec::new();
    if available() {
        loops.push("avx2");
    }
    if super::avx512::available() {
        loops.push("avx512");
    }
    for name in loops {
        let (mut got, mut scales) = (vec![0i8; rows * d], vec![0f32; rows]);
        let (q, s) = (got.as_mut_ptr(), scales.as_mut_ptr());
        // Out of order, so that each row's pointers matter.
        let all = (0..rows)
            .rev()
            .map(|i| unsafe { (q.add(i * d), s.add(i), values.as_ptr().add(i * d)) });
        // SAFETY: checked above; the pointers hold distinct rows.
        unsafe {
            if name == "avx2" {
                super::int8::quantize_rows_f16(d, all)
            } else {
                super::avx512::quantize_rows_f16(d, all)
            }
        }
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&scales), bits(&want_scales), "{name}");
        assert_eq!(got, want, "{name}");
    }
}
