//! Element types of stored keys and values, and conversion between them.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

use crate::error::KvError;
use crate::quant::{Fp8, I8_MAX};

/// The element type of a cache's storage (and of the tensors written into it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the upper half of a binary32).
    BF16,
    /// OCP fp8 E4M3FN (largest finite 448), stored with a float32 scale per layer and
    /// KV head ([`crate::quant::Fp8::E4M3`]). A storage dtype only.
    F8E4M3,
    /// OCP fp8 E5M2 (largest finite 57344), stored with a float32 scale per layer and KV
    /// head ([`crate::quant::Fp8::E5M2`]). A storage dtype only.
    F8E5M2,
    /// Symmetric int8 codes with one float32 scale per (token, KV head) stored beside
    /// them ([`crate::quant::quantize_row_i8`]). A storage dtype only.
    I8,
}

impl DType {
    /// The 8-bit storage dtypes.
    pub const QUANTIZED: [DType; 3] = [DType::F8E4M3, DType::F8E5M2, DType::I8];

    /// Every storage dtype, in the order documented to users.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I8,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 => 1,
        }
    }

    /// Whether this is an 8-bit storage dtype (stored with scales).
    pub const fn is_quantized(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2 | DType::I8)
    }

    /// The fp8 format of an fp8 dtype (unstable: `Fp8` is internal).
    #[doc(hidden)]
    pub const fn fp8(self) -> Option<Fp8> {
        match self {
            DType::F8E4M3 => Some(Fp8::E4M3),
            DType::F8E5M2 => Some(Fp8::E5M2),
            _ => None,
        }
    }

    /// Bytes one stored head vector of `head_dim` elements takes, its scale included
    /// (int8 keeps a float32 scale beside every head vector).
    pub const fn bytes_per_vector(self, head_dim: usize) -> usize {
        head_dim * self.size() + if matches!(self, DType::I8) { 4 } else { 0 }
    }

    /// The canonical name: `"float32"`, `"float16"`, `"bfloat16"` (as NumPy spells
    /// them), `"fp8_e4m3"`, `"fp8_e5m2"` or `"int8"` (as vLLM spells them).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F8E4M3 => "fp8_e4m3",
            DType::F8E5M2 => "fp8_e5m2",
            DType::I8 => "int8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = KvError;

    /// Parses `float32`/`fp32`/`float`, `float16`/`fp16`/`half`, `bfloat16`/`bf16`,
    /// `fp8_e4m3`/`fp8`/`float8_e4m3fn`, `fp8_e5m2`/`float8_e5m2` and `int8`/`i8`.
    fn from_str(s: &str) -> Result<Self, KvError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "float32" | "fp32" | "f32" | "float" => Ok(DType::F32),
            "float16" | "fp16" | "f16" | "half" => Ok(DType::F16),
            "bfloat16" | "bf16" => Ok(DType::BF16),
            "fp8_e4m3" | "fp8" | "float8_e4m3fn" | "fp8_e4m3fn" | "e4m3" => Ok(DType::F8E4M3),
            "fp8_e5m2" | "float8_e5m2" | "e5m2" => Ok(DType::F8E5M2),
            "int8" | "i8" => Ok(DType::I8),
            _ => Err(KvError::UnknownDType(s.to_string())),
        }
    }
}

/// Converts `n` contiguous elements from `src` (of `src_dtype`) into `dst` (of `dst_dtype`);
/// returns how many of them saturated an fp8 `dst_dtype` ([`Fp8::saturates`]; 0 for
/// other dtypes).
///
/// Narrowing conversions round to nearest, ties to even (the `half` crate, with
/// F16C/NEON instructions where the CPU has them).
///
/// # Safety
/// `src` must be valid for reading `n` elements of `src_dtype` and `dst` valid for
/// writing `n` elements of `dst_dtype`; the two ranges must not overlap. Neither
/// pointer needs to be aligned.
pub unsafe fn convert_contiguous(
    dst: *mut u8,
    dst_dtype: DType,
    src: *const u8,
    src_dtype: DType,
    n: usize,
) -> usize {
    if n == 0 {
        return 0;
    }
    if dst_dtype == src_dtype {
        std::ptr::copy_nonoverlapping(src, dst, n * dst_dtype.size());
        return 0;
    }
    // Aligned fast paths use half's vectorised slice converters; unaligned inputs
    // (rare: a NumPy view at an odd byte offset) take the scalar path.
    let aligned = (src as usize).is_multiple_of(src_dtype.size())
        && (dst as usize).is_multiple_of(dst_dtype.size());
    if aligned && !src_dtype.is_quantized() && !dst_dtype.is_quantized() {
        use DType::*;
        match (dst_dtype, src_dtype) {
            (F16, F32) => slice_mut::<f16>(dst, n).convert_from_f32_slice(slice::<f32>(src, n)),
            (BF16, F32) => slice_mut::<bf16>(dst, n).convert_from_f32_slice(slice::<f32>(src, n)),
            (F32, F16) => {
                let (dst, src) = (slice_mut::<f32>(dst, n), slice::<f16>(src, n));
                let mut done = 0;
                #[cfg(target_arch = "x86_64")]
                if crate::write_avx2::available() {
                    // SAFETY: the CPU has AVX2 and F16C.
                    done = crate::write_avx2::f16_to_f32(dst, src);
                }
                src[done..].convert_to_f32_slice(&mut dst[done..]);
            }
            (F32, BF16) => slice::<bf16>(src, n).convert_to_f32_slice(slice_mut::<f32>(dst, n)),
            (F16, BF16) => {
                for (d, s) in slice_mut::<f16>(dst, n)
                    .iter_mut()
                    .zip(slice::<bf16>(src, n))
                {
                    *d = f16::from_f32(s.to_f32());
                }
            }
            (BF16, F16) => {
                for (d, s) in slice_mut::<bf16>(dst, n)
                    .iter_mut()
                    .zip(slice::<f16>(src, n))
                {
                    *d = bf16::from_f32(s.to_f32());
                }
            }
            _ => unreachable!("equal and 8-bit dtypes are handled above and below"),
        }
        return 0;
    }
    if let (Some(f), false) = (dst_dtype.fp8(), src_dtype.is_quantized()) {
        // float16 straight to fp8 with AVX2, the rest a chunk at a time through f32 with
        // the vectorised encoder.
        let (mut done, mut saturated) = (0, 0);
        #[cfg(target_arch = "x86_64")]
        if src_dtype == DType::F16 && aligned && crate::write_avx2::available() {
            use crate::write_avx2::fp8::encode_fp8_f16;
            let (codes, halves) = (slice_mut::<u8>(dst, n), slice::<f16>(src, n));
            use crate::write_avx2::avx512;
            // SAFETY: the CPU has AVX2 and F16C, and AVX-512 F, BW and VL where checked.
            (done, saturated) = match (f, avx512::available()) {
                (Fp8::E4M3, true) => avx512::encode_fp8_f16::<true>(codes, halves),
                (Fp8::E5M2, true) => avx512::encode_fp8_f16::<false>(codes, halves),
                (Fp8::E4M3, false) => encode_fp8_f16::<true>(codes, halves),
                (Fp8::E5M2, false) => encode_fp8_f16::<false>(codes, halves),
            };
        }
        let (dst, src, n) = (dst.add(done), src.add(done * src_dtype.size()), n - done);
        let mut buf = [0f32; 256];
        for start in (0..n).step_by(buf.len()) {
            let len = buf.len().min(n - start);
            let chunk = &mut buf[..len];
            convert_contiguous(
                chunk.as_mut_ptr() as *mut u8,
                DType::F32,
                src.add(start * src_dtype.size()),
                src_dtype,
                len,
            );
            saturated += f.encode_slice(slice_mut::<u8>(dst.add(start), len), chunk);
        }
        return saturated;
    }
    let fp8 = dst_dtype.fp8();
    let mut saturated = 0;
    for i in 0..n {
        let v = read_f32(src.add(i * src_dtype.size()), src_dtype);
        saturated += fp8.is_some_and(|f| f.saturates(v)) as usize;
        write_f32(dst.add(i * dst_dtype.size()), dst_dtype, v);
    }
    saturated
}

/// Reads one element of `dtype` at `p` (any alignment) as f32. 8-bit elements read as
/// their codes' values, unscaled (an int8 code reads as the integer).
///
/// # Safety
/// `p` must be valid for reading one element of `dtype`.
pub unsafe fn read_f32(p: *const u8, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => (p as *const f32).read_unaligned(),
        DType::F16 => (p as *const f16).read_unaligned().to_f32(),
        DType::BF16 => (p as *const bf16).read_unaligned().to_f32(),
        DType::F8E4M3 => Fp8::E4M3.decode(p.read()),
        DType::F8E5M2 => Fp8::E5M2.decode(p.read()),
        DType::I8 => (p as *const i8).read() as f32,
    }
}

/// Writes `v` as one element of `dtype` at `p` (any alignment), rounding to nearest even;
/// fp8 saturates at its largest finite value and int8 at ±127 (NaN becomes 0), unscaled.
///
/// # Safety
/// `p` must be valid for writing one element of `dtype`.
pub unsafe fn write_f32(p: *mut u8, dtype: DType, v: f32) {
    match dtype {
        DType::F32 => (p as *mut f32).write_unaligned(v),
        DType::F16 => (p as *mut f16).write_unaligned(f16::from_f32(v)),
        DType::BF16 => (p as *mut bf16).write_unaligned(bf16::from_f32(v)),
        DType::F8E4M3 => p.write(Fp8::E4M3.encode(v)),
        DType::F8E5M2 => p.write(Fp8::E5M2.encode(v)),
        DType::I8 => {
            let q = if v.is_nan() { 0.0 } else { v.round_ties_even() };
            (p as *mut i8).write(q.clamp(-I8_MAX, I8_MAX) as i8)
        }
    }
}

unsafe fn slice<'a, T>(p: *const u8, n: usize) -> &'a [T] {
    std::slice::from_raw_parts(p as *const T, n)
}

unsafe fn slice_mut<'a, T>(p: *mut u8, n: usize) -> &'a mut [T] {
    std::slice::from_raw_parts_mut(p as *mut T, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(values: &[f32], to: DType) -> Vec<f32> {
        let mut buf = vec![0u8; values.len() * to.size()];
        let mut back = vec![0f32; values.len()];
        unsafe {
            convert_contiguous(
                buf.as_mut_ptr(),
                to,
                values.as_ptr() as *const u8,
                DType::F32,
                values.len(),
            );
            convert_contiguous(
                back.as_mut_ptr() as *mut u8,
                DType::F32,
                buf.as_ptr(),
                to,
                values.len(),
            );
        }
        back
    }

    #[test]
    fn parses_names_and_aliases() {
        assert_eq!("float16".parse::<DType>().unwrap(), DType::F16);
        assert_eq!("BF16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("float".parse::<DType>().unwrap(), DType::F32);
        assert_eq!("float8_e4m3fn".parse::<DType>().unwrap(), DType::F8E4M3);
        assert_eq!("int8".parse::<DType>().unwrap(), DType::I8);
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("int4".parse::<DType>().is_err());
    }

    #[test]
    fn f32_to_f16_rounds_to_nearest_even() {
        // 1 + 2^-11 lies halfway between 1 and the next f16 (1 + 2^-10): ties go to even (1).
        let half_way = 1.0 + f32::powi(2.0, -11);
        // 1 + 3 * 2^-11 lies halfway between 1 + 2^-10 and 1 + 2^-9: ties go to even (1 + 2^-9).
        let half_way_up = 1.0 + 3.0 * f32::powi(2.0, -11);
        let out = convert(&[half_way, half_way_up, 65504.0, 1e-8], DType::F16);
        assert_eq!(out, vec![1.0, 1.0 + f32::powi(2.0, -9), 65504.0, 0.0]);
    }

    #[test]
    fn f32_to_bf16_rounds_to_nearest_even() {
        let half_way = 1.0 + f32::powi(2.0, -8);
        assert_eq!(convert(&[half_way, -2.5], DType::BF16), vec![1.0, -2.5]);
    }

    #[test]
    fn unaligned_and_cross_half_conversions_match_the_scalar_path() {
        let values: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.377).collect();
        for (from, to) in [
            (DType::F16, DType::BF16),
            (DType::BF16, DType::F16),
            (DType::F32, DType::F16),
        ] {
            let mut src = vec![0u8; values.len() * from.size() + 1];
            let mut dst = vec![0u8; values.len() * to.size() + 1];
            unsafe {
                for (i, v) in values.iter().enumerate() {
                    write_f32(src.as_mut_ptr().add(1 + i * from.size()), from, *v);
                }
                convert_contiguous(
                    dst.as_mut_ptr().add(1),
                    to,
                    src.as_ptr().add(1),
                    from,
                    values.len(),
                );
                for (i, v) in values.iter().enumerate() {
                    let expect = read_f32(src.as_ptr().add(1 + i * from.size()), from);
                    let mut one = [0u8; 4];
                    write_f32(one.as_mut_ptr(), to, expect);
                    assert_eq!(
                        read_f32(dst.as_ptr().add(1 + i * to.size()), to),
                        read_f32(one.as_ptr(), to),
                        "{v}"
                    );
                }
            }
        }
    }
}
