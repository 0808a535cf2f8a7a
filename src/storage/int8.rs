//! Host storage of int8 keys and values with one float32 scale per chunk of `unit`
//! elements.
//!
//! The unit is `gcd(head_dim, v_head_dim)` ([`crate::sizes::int8_scale_unit`]): one
//! scale per head vector when keys and values have one head size, and several per vector
//! otherwise (an MLA latent of 512 keys and 64 values: one per 64 elements). Codes and
//! scales are two allocations addressed by the same regions: element `i` of the codes
//! has its scale at `i / unit` of the scales. Every region the caches build keeps whole
//! head vectors (the last axis is contiguous and a multiple of `unit` long, and every
//! offset and stride is a multiple of `unit`), so a region of codes maps to a region of
//! scales by dividing it by `unit`, and every copy of a block (copy-on-write, forks,
//! shifts) carries its scales with it.
//!
//! A write quantizes each chunk on its own ([`quantize_row_i8`]); a read into a float
//! tensor dequantizes, and a read into an int8 tensor returns the raw codes.

use std::cell::RefCell;

use super::{Device, HostStorage, Region, RowScales, Storage};
use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::quant::{dequantize_row_i8, quantize_row_i8};
use crate::tensor::{copy_strided, TensorMut, TensorRef};

thread_local! {
    /// Rows of f32 between a caller's tensor and the codes, reused across calls so that
    /// a decode step allocates nothing.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The region of scales that belongs to the region `r` of int8 codes, for chunks of `d`
/// elements (one scale each). Panics on a region that splits chunks (see the module
/// docs): that is a bug in the cache that built it.
pub(crate) fn scale_region(r: &Region, d: usize) -> Region {
    assert!(
        r.offset.is_multiple_of(d)
            && r.shape[2].is_multiple_of(d)
            && (r.shape[2] <= d || r.strides[2] == 1)
            && (0..2).all(|i| r.shape[i] <= 1 || r.strides[i].is_multiple_of(d)),
        "region {r:?} splits head vectors of {d}"
    );
    Region {
        offset: r.offset / d,
        shape: [r.shape[0], r.shape[1], r.shape[2] / d],
        strides: [r.strides[0] / d, r.strides[1] / d, 1],
    }
}

/// int8 codes and their per-chunk scales in host memory.
#[derive(Debug)]
pub struct Int8Storage {
    codes: HostStorage,
    scales: HostStorage,
    /// Elements per scale.
    unit: usize,
}

impl Int8Storage {
    /// Allocates `numel` zero codes (and `numel / unit` zero scales, one per `unit`
    /// elements: [`crate::sizes::int8_scale_unit`] of the head sizes).
    pub fn zeroed(numel: usize, unit: usize) -> Result<Self> {
        if unit == 0 || !numel.is_multiple_of(unit) {
            return Err(KvError::InvalidArgument {
                name: "scale_unit",
                value: unit.to_string(),
                reason: format!("must divide the storage's {numel} elements"),
            });
        }
        Ok(Int8Storage {
            codes: HostStorage::zeroed(DType::I8, numel)?,
            scales: HostStorage::zeroed(DType::F32, numel / unit)?,
            unit,
        })
    }

    /// The region of scales that belongs to the region `r` of codes.
    fn scale_region(&self, r: &Region) -> Region {
        scale_region(r, self.unit)
    }

    /// Calls `f` with the row-major f32 scratch of `n` elements.
    fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < n {
                s.resize(n, 0.0);
            }
            f(&mut s[..n])
        })
    }

    /// Each scaled chunk of `r`, in row-major order of the region: (element offset of
    /// its codes, index of its scale).
    fn vectors(&self, r: &Region) -> impl Iterator<Item = (usize, usize)> + '_ {
        let d = self.unit;
        let [a, b, c] = r.shape;
        let (offset, strides) = (r.offset, r.strides);
        (0..a).flat_map(move |i| {
            (0..b).flat_map(move |j| {
                (0..c / d).map(move |k| {
                    let at = offset + i * strides[0] + j * strides[1] + k * d;
                    (at, at / d)
                })
            })
        })
    }
}

impl Int8Storage {
    /// Quantizes a float16 source of whole vectors (its last axis contiguous) straight
    /// into `dst`'s codes and scales with AVX2 and F16C, and returns true; false (having
    /// written nothing) for other sources or CPUs.
    #[cfg(target_arch = "x86_64")]
    fn write_f16(&mut self, dst: &Region, src: &TensorRef) -> bool {
        use crate::write_avx2::{available, int8::quantize_rows_f16};
        let [s0, s1, s2] = src.strides3();
        let base = src.as_ptr() as *const half::f16;
        if src.dtype() != DType::F16
            || s2 != 1
            || !(base as usize).is_multiple_of(2)
            || !available()
        {
            return false;
        }
        let d = self.unit;
        let [a, b, c] = dst.shape;
        let (offset, strides) = (dst.offset, dst.strides);
        // Chunks start at multiples of d ([`Self::vectors`]'s `at / d`).
        debug_assert!([offset, strides[0], strides[1]].iter().all(|x| x % d == 0));
        let (first, step) = (offset / d, [strides[0] / d, strides[1] / d]);
        let codes = self.codes.data_ptr() as *mut i8;
        let scales = self.scales.data_ptr() as *mut f32;
        // The region's chunks in row-major order ([`Self::vectors`]), each beside its source,
        // counted by hand: three nested `flat_map`s cost as much as a row's codes.
        let kn = c / d;
        let (mut i, mut j, mut k) = (0, 0, 0);
        let rows = std::iter::from_fn(move || {
            if i >= a || b == 0 || kn == 0 {
                return None;
            }
            let at = offset + i * strides[0] + j * strides[1] + k * d;
            let from = i as isize * s0 + j as isize * s1 + (k * d) as isize;
            let scale = first + i * step[0] + j * step[1] + k;
            k += 1;
            if k == kn {
                k = 0;
                j += 1;
                if j == b {
                    j = 0;
                    i += 1;
                }
            }
            // SAFETY: the region was checked against both allocations and the source
            // holds its shape (the caller's checks).
            Some(unsafe { (codes.add(at), scales.add(scale), base.offset(from)) })
        });
        // SAFETY: as above; the CPU has AVX2 and F16C (and AVX-512 F, BW and VL where
        // checked); the region's chunks are distinct.
        unsafe {
            if crate::write_avx2::avx512::available() {
                crate::write_avx2::avx512::quantize_rows_f16(d, rows)
            } else {
                quantize_rows_f16(d, rows)
            }
        };
        true
    }
}

impl Storage for Int8Storage {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn dtype(&self) -> DType {
        DType::I8
    }

    fn numel(&self) -> usize {
        self.codes.numel()
    }

    fn data_ptr(&self) -> *mut u8 {
        self.codes.data_ptr()
    }

    fn write(&mut self, dst: Region, src: &TensorRef) -> Result<()> {
        src.expect_region("the source", &dst)?;
        self.scale_region(&dst);
        if src.dtype() == DType::I8 {
            // Codes as they are; their scales come through `write_row_scales`.
            return self.codes.write(dst, src);
        }
        self.codes.check_region(&dst);
        if src.device() != Device::Cpu {
            return Err(KvError::Device(format!(
                "the source lives on {}; this cache lives on the host, so pass a CPU tensor",
                src.device()
            )));
        }
        let n = dst.numel();
        let d = self.unit;
        let codes = self.codes.data_ptr() as *mut i8;
        let scales = self.scales.data_ptr() as *mut f32;
        #[cfg(target_arch = "x86_64")]
        if self.write_f16(&dst, src) {
            return Ok(());
        }
        Self::with_scratch(n, |rows| {
            let [_, b, c] = dst.shape;
            // SAFETY: `rows` holds n f32s; src holds dst's shape (checked above),
            // readable by the TensorRef's contract.
            unsafe {
                copy_strided(
                    rows.as_mut_ptr() as *mut u8,
                    DType::F32,
                    [(b * c) as isize, c as isize, 1],
                    src.as_ptr(),
                    src.dtype(),
                    src.strides3(),
                    dst.shape,
                )
            };
            for ((at, s), row) in self.vectors(&dst).zip(rows.chunks_exact(d)) {
                // SAFETY: the region was checked against both allocations above.
                unsafe {
                    let q = std::slice::from_raw_parts_mut(codes.add(at), d);
                    *scales.add(s) = quantize_row_i8(q, row);
                }
            }
        });
        Ok(())
    }

    fn read(&self, src: Region, dst: &mut TensorMut) -> Result<()> {
        dst.expect_region("the destination", &src)?;
        if dst.dtype() == DType::I8 {
            return self.codes.read(src, dst);
        }
        self.scale_region(&src);
        self.codes.check_region(&src);
        if dst.device() != Device::Cpu {
            return Err(KvError::Device(format!(
                "the destination lives on {}; this cache lives on the host, so pass a CPU tensor",
                dst.device()
            )));
        }
        let d = self.unit;
        let codes = self.codes.data_ptr() as *const i8;
        let scales = self.scales.data_ptr() as *const f32;
        Self::with_scratch(src.numel(), |rows| {
            for ((at, s), row) in self.vectors(&src).zip(rows.chunks_exact_mut(d)) {
                // SAFETY: the region was checked against both allocations above.
                unsafe {
                    let q = std::slice::from_raw_parts(codes.add(at), d);
                    dequantize_row_i8(row, q, *scales.add(s));
                }
            }
            let [_, b, c] = src.shape;
            // SAFETY: `rows` holds the region's values row-major; dst holds src's shape
            // (checked above), writable and borrowed mutably by the TensorMut's contract.
            unsafe {
                copy_strided(
                    dst.as_mut_ptr(),
                    dst.dtype(),
                    dst.strides3(),
                    rows.as_ptr() as *const u8,
                    DType::F32,
                    [(b * c) as isize, c as isize, 1],
                    src.shape,
                )
            };
        });
        Ok(())
    }

    fn copy_within(&mut self, src: Region, dst: Region) -> Result<()> {
        let (ss, ds) = (self.scale_region(&src), self.scale_region(&dst));
        self.codes.copy_within(src, dst)?;
        self.scales.copy_within(ss, ds)
    }

    fn fill_zero(&mut self, dst: Region) -> Result<()> {
        let ds = self.scale_region(&dst);
        self.codes.fill_zero(dst)?;
        self.scales.fill_zero(ds)
    }

    fn zero(&self, t: &mut TensorMut) -> Result<()> {
        self.codes.zero(t)
    }

    fn read_row_scales(&self, src: Region, dst: &mut [f32]) -> Result<()> {
        let r = self.scale_region(&src);
        check_scales_len(dst.len(), &r)?;
        self.scales
            .read(r, &mut TensorMut::from_f32_mut(dst, &r.shape)?)
    }

    fn write_row_scales(&mut self, dst: Region, src: &[f32]) -> Result<()> {
        let r = self.scale_region(&dst);
        check_scales_len(src.len(), &r)?;
        self.scales.write(r, &TensorRef::from_f32(src, &r.shape)?)
    }

    fn row_scales(&self) -> Option<RowScales> {
        Some(RowScales {
            ptr: self.scales.data_ptr() as *mut f32,
            row_len: self.unit,
            len: self.scales.numel(),
        })
    }

    fn nbytes(&self) -> usize {
        self.codes.nbytes() + self.scales.nbytes()
    }
}

/// Fails unless a buffer of `len` scales holds exactly region `r`'s elements.
pub(crate) fn check_scales_len(len: usize, r: &Region) -> Result<()> {
    if len != r.numel() {
        return Err(KvError::Shape {
            name: "scales",
            got: vec![len],
            expected: format!("[{}]", r.numel()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::I8_MAX;

    fn tensor<'a>(data: &'a [f32], shape: &[usize]) -> TensorRef<'a> {
        TensorRef::from_f32(data, shape).unwrap()
    }

    /// A tensor the storage may write into.
    fn out<'a>(data: &'a mut [f32], shape: &[usize]) -> TensorMut<'a> {
        TensorMut::from_f32_mut(data, shape).unwrap()
    }

    #[test]
    fn a_row_quantizes_with_its_own_scale_and_reads_back_within_half_a_step() {
        // Two positions x two heads of four, in a [pos][head][dim] region of 2 x 8.
        let mut s = Int8Storage::zeroed(32, 4).unwrap();
        let region = Region {
            offset: 8,
            shape: [2, 2, 4],
            strides: [8, 4, 1],
        };
        let x: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) * 0.3).collect();
        s.write(region, &tensor(&x, &[2, 2, 4])).unwrap();
        let mut back = vec![0f32; 16];
        s.read(region, &mut out(&mut back, &[2, 2, 4])).unwrap();
        let scales = s.row_scales().unwrap();
        for (r, (row, got)) in x.chunks(4).zip(back.chunks_mut(4)).enumerate() {
            let scale = unsafe { *scales.ptr.add(2 + r) };
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scale, amax / I8_MAX);
            for (a, b) in row.iter().zip(got.iter()) {
                assert!((a - b).abs() <= scale / 2.0 + 1e-7, "{a} vs {b}");
            }
        }
        // Raw codes read back as int8; the untouched rows stay zero.
        let mut codes = [0i8; 16];
        let mut raw =
            TensorMut::from_bytes_mut(bytemuck::cast_slice_mut(&mut codes), DType::I8, &[2, 2, 4])
                .unwrap();
        s.read(region, &mut raw).unwrap();
        assert!(codes.iter().any(|&c| c == 127 || c == -127));
        assert_eq!(unsafe { *scales.ptr }, 0.0);
    }

    #[test]
    fn a_float16_source_quantizes_as_its_values_do() {
        // Three positions x two heads of 2 x 40 (two scaled chunks per head vector), the
        // source strided (every other head of four), including a NaN, an infinity and a
        // zero row: codes and scales equal those of the same values given as f32.
        let (d, region) = (
            40,
            Region {
                offset: 160,
                shape: [3, 2, 80],
                strides: [320, 80, 1],
            },
        );
        let values: Vec<f32> = (0..3 * 4 * 80)
            .map(|i| match i {
                7 => f32::NAN,
                500 => f32::INFINITY,
                800..=839 => 0.0,
                _ => ((i as u32).wrapping_mul(2_654_435_761) >> 16) as f32 / 4096.0 - 8.0,
            })
            .collect();
        let halves: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
        let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
        let picked: Vec<f32> = (0..3)
            .flat_map(|i| (0..2).flat_map(move |j| (0..80).map(move |k| (i * 4 + j * 2) * 80 + k)))
            .map(|at| widened[at])
            .collect();
        let mut from_f16 = Int8Storage::zeroed(1120, d).unwrap();
        let mut from_f32 = Int8Storage::zeroed(1120, d).unwrap();
        // SAFETY: the strides address elements of `halves` only.
        let src = unsafe {
            TensorRef::new(
                halves.as_ptr() as *const u8,
                DType::F16,
                &[3, 2, 80],
                &[320, 160, 1],
            )
        }
        .unwrap();
        from_f16.write(region, &src).unwrap();
        from_f32
            .write(region, &tensor(&picked, &[3, 2, 80]))
            .unwrap();
        let read = |s: &Int8Storage| {
            let mut codes = vec![0i8; 480];
            let bytes = bytemuck::cast_slice_mut(&mut codes);
            s.read(
                region,
                &mut TensorMut::from_bytes_mut(bytes, DType::I8, &[3, 2, 80]).unwrap(),
            )
            .unwrap();
            let scales = s.row_scales().unwrap();
            let scales: Vec<u32> = (0..28)
                .map(|r| unsafe { *scales.ptr.add(r) }.to_bits())
                .collect();
            (codes, scales)
        };
        assert_eq!(read(&from_f16), read(&from_f32));
        assert!(read(&from_f16).1.iter().filter(|&&s| s != 0).count() == 11);
    }

    #[test]
    fn copies_and_zero_fills_carry_the_scales() {
        let mut s = Int8Storage::zeroed(16, 4).unwrap();
        let at = |offset| Region {
            offset,
            shape: [1, 1, 8],
            strides: [0, 0, 1],
        };
        let x = [1.0, -2.0, 3.0, 4.0, 100.0, 0.0, -50.0, 25.0];
        s.write(at(0), &tensor(&x, &[1, 1, 8])).unwrap();
        s.copy_within(at(0), at(8)).unwrap();
        let mut back = [0f32; 8];
        s.read(at(8), &mut out(&mut back, &[1, 1, 8])).unwrap();
        let mut first = [0f32; 8];
        s.read(at(0), &mut out(&mut first, &[1, 1, 8])).unwrap();
        assert_eq!(back, first);
        assert_eq!(back[4], 100.0);
        s.fill_zero(at(0)).unwrap();
        s.read(at(0), &mut out(&mut back, &[1, 1, 8])).unwrap();
        assert_eq!(back, [0.0; 8]);
        assert_eq!(s.nbytes(), 16 + 4 * 4);
    }

    #[test]
    fn vectors_longer_than_the_unit_keep_a_scale_per_chunk() {
        // A key of 8 and a value of 4 (unit 4): the key's halves quantize on their own.
        let mut s = Int8Storage::zeroed(24, 4).unwrap();
        let key = Region {
            offset: 0,
            shape: [1, 1, 8],
            strides: [0, 0, 1],
        };
        let x = [0.01, -0.02, 0.03, 0.04, 100.0, 0.0, -50.0, 25.0];
        s.write(key, &tensor(&x, &[1, 1, 8])).unwrap();
        let mut scales = [0f32; 2];
        s.read_row_scales(key, &mut scales).unwrap();
        assert_eq!(scales, [0.04 / I8_MAX, 100.0 / I8_MAX]);
        let mut back = [0f32; 8];
        s.read(key, &mut out(&mut back, &[1, 1, 8])).unwrap();
        for (i, (a, b)) in x.iter().zip(back).enumerate() {
            assert!((a - b).abs() <= scales[i / 4] / 2.0 + 1e-9, "{a} vs {b}");
        }
        assert!(s.read_row_scales(key, &mut [0f32; 1]).is_err());
        assert_eq!(s.row_scales().unwrap().row_len, 4);
    }

    #[test]
    #[should_panic(expected = "splits head vectors")]
    fn a_region_that_splits_a_vector_is_a_bug() {
        let mut s = Int8Storage::zeroed(16, 4).unwrap();
        let x = [0f32; 2];
        let r = Region {
            offset: 2,
            shape: [1, 1, 2],
            strides: [0, 0, 1],
        };
        let _ = s.write(r, &tensor(&x, &[1, 1, 2]));
    }
}
