//! int8 storage on the device: region writes quantize each head vector on the device
//! (`kvrs_quantize3_*`) and storing its scale beside the codes; reads into float
//! tensors dequantize (`kvrs_dequantize3_*`). The codes and their scales are addressed
//! by the same regions, as in the host's [`crate::storage::Int8Storage`], so the paged
//! pool's copies, forks and persistence carry the scales unchanged.

use super::gpu::{blocks_for, Args, DevicePtr, THREADS};
use super::kernels::{kernel, Kernel};
use super::storage::{contiguous, pack, CudaStorage};
use crate::dtype::DType;
use crate::error::Result;
use crate::storage::int8::scale_region;
use crate::storage::Region;
use crate::tensor::{copy_strided, TensorMut, TensorRef, MAX_RANK};

impl CudaStorage {
    /// The scales' device address and region for the codes' region `r` (int8 only).
    fn scales_of(&self, r: &Region) -> (DevicePtr, Region) {
        let sc = self.scales.as_ref().expect("an int8 storage");
        let sr = scale_region(r, self.head_dim);
        (sc.device_addr(sr.offset), sr)
    }

    /// Quantizes `src` (floats, host or this device) into region `dst` of int8 codes,
    /// one scale per head vector.
    pub(super) fn write_quantized(&self, dst: Region, src: &TensorRef) -> Result<()> {
        let (scales, sr) = self.scales_of(&dst);
        let launch = |from: DevicePtr, strides: [isize; MAX_RANK]| {
            let vectors = dst.numel() / self.head_dim;
            if vectors == 0 {
                return Ok(());
            }
            let args = Args::new()
                .u64(self.device_addr(dst.offset))
                .strides(dst.signed_strides())
                .u64(scales)
                .i64(sr.strides[0] as i64)
                .i64(sr.strides[1] as i64)
                .u64(from)
                .strides(strides)
                .dims(dst.shape)
                .i32(self.head_dim as i32);
            let name = kernel(Kernel::Quantize3, src.dtype(), DType::I8)?;
            // SAFETY: the region and its scales lie in this storage (checked by the
            // caller and scale_region); the source holds dst's shape (checked by
            // `write`), readable by its contract.
            unsafe {
                self.gpu().launch(
                    name,
                    [blocks_for(vectors), 1, 1],
                    [THREADS, 1, 1],
                    &args,
                    self.stream(),
                )
            }
        };
        if self.is_local("the source", src.device())? {
            return launch(src.as_ptr() as DevicePtr, src.strides3());
        }
        self.with_upload(
            |words| pack(src, words),
            |staged| launch(staged, contiguous(dst.shape)),
        )
    }

    /// Reads region `src` of int8 codes into `dst` (floats, host or this device), each
    /// code times its vector's scale.
    pub(super) fn read_dequantized(&self, src: Region, dst: &mut TensorMut) -> Result<()> {
        let (scales, sr) = self.scales_of(&src);
        let n = src.numel();
        if n == 0 {
            return Ok(());
        }
        let launch = |to: DevicePtr, dtype: DType, strides: [isize; MAX_RANK]| {
            let args = Args::new()
                .u64(to)
                .strides(strides)
                .u64(self.device_addr(src.offset))
                .strides(src.signed_strides())
                .u64(scales)
                .i64(sr.strides[0] as i64)
                .i64(sr.strides[1] as i64)
                .dims(src.shape)
                .i32(self.head_dim as i32);
            let name = kernel(Kernel::Dequantize3, DType::I8, dtype)?;
            // SAFETY: the region and its scales lie in this storage; the destination
            // holds src's shape (checked by `read`, or the staging buffer reserved below).
            unsafe {
                self.gpu().launch(
                    name,
                    [blocks_for(n), 1, 1],
                    [THREADS, 1, 1],
                    &args,
                    self.stream(),
                )
            }
        };
        if self.is_local("the destination", dst.device())? {
            return launch(dst.as_mut_ptr() as DevicePtr, dst.dtype(), dst.strides3());
        }
        let bytes = 4 * n;
        let mut host = vec![0u64; bytes.div_ceil(8)];
        let stream = self.stream();
        let mut st = self.staging.lock();
        self.reserve_staging(&mut st, bytes)?;
        launch(st.ptr, DType::F32, contiguous(src.shape))?;
        // SAFETY: `host` holds `bytes`; the staging buffer holds the dequantized region.
        unsafe {
            self.gpu()
                .dtoh(host.as_mut_ptr() as *mut u8, st.ptr, bytes, stream)?;
            copy_strided(
                dst.as_mut_ptr(),
                dst.dtype(),
                dst.strides3(),
                host.as_ptr() as *const u8,
                DType::F32,
                contiguous(src.shape),
                src.shape,
            );
        }
        Ok(())
    }
}
