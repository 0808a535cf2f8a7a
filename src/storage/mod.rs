//! The storage interface: one region of device or host memory, allocated once, that
//! caches address through strided [`Region`]s. The host backend lives in `host`; the
//! CUDA backend ([`cuda`]) implements the same trait, so the caches never look at the
//! device. The paged pool's bulk operations have region-by-region defaults
//! ([`paged_ops`]) that a device backend replaces with one kernel launch each.

pub mod cuda;
mod host;
pub(crate) mod int8;
pub mod paged_ops;

pub use host::HostStorage;
pub use int8::Int8Storage;
pub use paged_ops::{LayerRows, PagedTensor};

use std::fmt;

use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::layout::{BlockId, PagedShape};
pub use crate::layout::{Device, Region};
use crate::tensor::{Span, TensorMut, TensorRef};

/// One allocation of keys and values, made once and addressed by regions.
///
/// Implementations allocate in their constructor and never reallocate, so the pointer
/// behind [`Storage::data_ptr`] is stable for the storage's whole life and zero-copy
/// views of it never dangle while the storage lives.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Where the memory lives.
    fn device(&self) -> Device;
    /// The element type stored.
    fn dtype(&self) -> DType;
    /// Size in elements.
    fn numel(&self) -> usize;
    /// Address of element 0 (a host pointer, or a device address for device storages).
    fn data_ptr(&self) -> *mut u8;
    /// Writes `src` (host memory, or memory on this storage's device; any supported
    /// dtype) into `dst`, converting to the storage dtype. Fails (a shape error, nothing
    /// written) unless `src` has `dst`'s shape.
    fn write(&mut self, dst: Region, src: &TensorRef) -> Result<()>;
    /// Reads `src` into `dst` (host memory, or memory on this storage's device; any
    /// supported dtype), converting from the storage dtype. Fails (a shape error, `dst`
    /// untouched) unless `dst` has `src`'s shape.
    fn read(&self, src: Region, dst: &mut TensorMut) -> Result<()>;
    /// Copies region `src` onto region `dst` of the same storage (same shape; the two
    /// must not overlap): copy-on-write and forks.
    fn copy_within(&mut self, src: Region, dst: Region) -> Result<()>;
    /// Sets every element of `dst` to zero.
    fn fill_zero(&mut self, dst: Region) -> Result<()>;
    /// Sets every element of a caller's tensor to zero (host memory, or memory on this
    /// storage's device).
    fn zero(&self, t: &mut TensorMut) -> Result<()>;

    /// Writes `k`, `v` (`[n, H, D]`, `n` the number of slots: a shape error otherwise)
    /// at paged `slots` (`block * block_size + offset`; -1 skips) of cache tensor `t`.
    fn write_slots(
        &mut self,
        t: PagedTensor,
        slots: &[i64],
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        paged_ops::write_slots(self, t, slots, k, v)
    }
    /// Writes each of `layers` as [`Storage::write_slots`] does, in order (the CUDA
    /// backend: one launch for all of them where it can).
    fn write_layers(&mut self, layers: &[LayerRows<'_>]) -> Result<()> {
        layers
            .iter()
            .try_for_each(|l| self.write_slots(l.tensor, l.slots, &l.k, &l.v))
    }
    /// Sets K and V at paged `slots` (-1 skips) of cache tensor `t` to zero: positions a
    /// holder claims without writing them (reserved slots) then never show the K/V an
    /// earlier holder of the block left there.
    fn zero_slots(&mut self, t: PagedTensor, slots: &[i64]) -> Result<()> {
        paged_ops::zero_slots(self, t, slots)
    }
    /// Writes `k`, `v` (both `[n, H, D]`: a shape error otherwise) at positions
    /// `start..start + n` of cache tensor `t` through the block table `blocks`.
    fn write_positions(
        &mut self,
        t: PagedTensor,
        blocks: &[BlockId],
        start: usize,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        paged_ops::write_positions(self, t, blocks, start, k, v)
    }
    /// Reads positions `start..start + n` of cache tensor `t` through the block table
    /// `blocks` into `[H, >= n, D]` outputs (a shape error otherwise).
    #[allow(clippy::too_many_arguments)]
    fn read_positions(
        &self,
        t: PagedTensor,
        blocks: &[BlockId],
        start: usize,
        n: usize,
        k_out: &mut TensorMut,
        v_out: &mut TensorMut,
    ) -> Result<()> {
        paged_ops::read_positions(self, t, blocks, start, n, k_out, v_out)
    }
    /// Copies whole blocks `(src, dst)` in cache tensors `0..tensors` (copy-on-write and
    /// forks).
    fn copy_blocks(
        &mut self,
        shape: PagedShape,
        tensors: usize,
        pairs: &[(BlockId, BlockId)],
    ) -> Result<()> {
        paged_ops::copy_blocks(self, shape, tensors, pairs)
    }

    /// Reads whole `blocks` of cache tensors `0..tensors` into `out` (any alignment;
    /// exactly their size, an error otherwise), packed block-major, raw storage
    /// elements: the swap-out of the offload tiers, one launch and one transfer per chunk
    /// on a device.
    fn read_blocks(
        &self,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<()> {
        paged_ops::read_blocks(self, shape, tensors, blocks, out)
    }
    /// Writes whole `blocks` of cache tensors `0..tensors`, block `i` from `data[i]`
    /// (any alignment; its tensors one after another, as [`Storage::read_blocks`]
    /// packs one block; one slice per block, each exactly one block of every tensor, an
    /// error otherwise): the swap-in, straight from the tiers' payloads.
    fn write_blocks(
        &mut self,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        data: &[&[u8]],
    ) -> Result<()> {
        paged_ops::write_blocks(self, shape, tensors, blocks, data)
    }

    /// Reads the scales of `src`'s scaled chunks (one per `RowScales::row_len`
    /// elements: a head vector's when K and V have one size), row-major, into `dst` (int8
    /// storages; the others hold none and fail).
    fn read_row_scales(&self, src: Region, dst: &mut [f32]) -> Result<()> {
        let _ = (src, dst);
        Err(no_row_scales(self.dtype()))
    }

    /// Sets the scales of `dst`'s scaled chunks from `src`, row-major (int8 storages,
    /// whose writes of int8 codes store them as they are).
    fn write_row_scales(&mut self, dst: Region, src: &[f32]) -> Result<()> {
        let _ = (dst, src);
        Err(no_row_scales(self.dtype()))
    }

    /// The per-chunk scales of an int8 storage (on its device); `None` for the others.
    fn row_scales(&self) -> Option<RowScales> {
        None
    }

    /// Elements the writes into this storage have saturated so far: rounded past an fp8
    /// dtype's largest finite value and clamped to it ([`crate::quant::Fp8::saturates`];
    /// NaN never counts),
    /// counted by the host encoder as it stores them. `None` where nothing is counted:
    /// other dtypes, and device storages, whose kernels encode (the committed PTX has no
    /// counter).
    fn saturated(&self) -> Option<u64> {
        None
    }

    /// What applies an fp8 cache's per-head scales to tensors on this storage's device
    /// (`None` on the host, where `crate::scales` does it in host memory).
    fn scaler(&self) -> Option<cuda::DeviceScaler> {
        None
    }

    /// This storage as the CUDA backend, for what only a device does (the captured
    /// decode loop's position counter, streams); `None` on the host.
    fn as_cuda(&self) -> Option<&cuda::CudaStorage> {
        None
    }

    /// Size in bytes.
    fn nbytes(&self) -> usize {
        self.numel() * self.dtype().size()
    }

    /// The byte ranges of this storage's allocations (on its device): the elements, and
    /// an int8 storage's scales. No caller's tensor may overlap them in a call that
    /// writes the storage.
    fn spans(&self) -> Vec<Span> {
        let base = self.data_ptr() as usize;
        let mut out = vec![Span {
            start: base,
            end: base + self.numel() * self.dtype().size(),
        }];
        if let Some(r) = self.row_scales() {
            let at = r.ptr as usize;
            out.push(Span {
                start: at,
                end: at + 4 * r.len,
            });
        }
        out
    }
}

fn no_row_scales(dtype: DType) -> KvError {
    KvError::NotSupported(format!("{dtype} storage keeps no per-vector scales"))
}

/// The float32 scales of an int8 storage: element `i` of the codes is
/// `code * ptr[i / row_len]`. They live where the storage does (host memory, or device
/// memory for a CUDA storage: read them there with [`Storage::read_row_scales`]).
#[derive(Clone, Copy, Debug)]
pub struct RowScales {
    /// Scale 0 (on the storage's device, valid while the storage lives).
    pub ptr: *mut f32,
    /// Elements per scale: `gcd(head_dim, v_head_dim)`, the head dimension when K and V
    /// have one size.
    pub row_len: usize,
    /// Number of scales.
    pub len: usize,
}

/// Fails unless the CUDA kernel behind `what` (the captured append) can run on `device`
/// over keys of `dims[0]` and values of `dims[1]` elements: it takes one head size for
/// both. Storage of two head sizes on a device (writes, reads, copies, forks, swaps)
/// goes through the region copies, and attention through the generic kernel, so those
/// need no check.
pub fn check_kernel_dims(what: &str, device: Device, dims: [usize; 2]) -> Result<()> {
    if device != Device::Cpu && dims[0] != dims[1] {
        return Err(KvError::NotSupported(format!(
            "{what} on {device} with v_head_dim={} beside head_dim={}: the CUDA kernels of \
             {what} take one head size for K and V; keep this cache on the host \
             (device='cpu') to {what}",
            dims[1], dims[0]
        )));
    }
    Ok(())
}

/// Allocates zero-filled storage of `numel` elements of `dtype` on `device`; int8 keeps
/// a scale per `scale_unit` elements (`gcd(head_dim, v_head_dim)`, see
/// `crate::sizes::int8_scale_unit`).
pub fn allocate(
    device: Device,
    dtype: DType,
    numel: usize,
    scale_unit: usize,
) -> Result<Box<dyn Storage>> {
    match device {
        Device::Cpu if dtype == DType::I8 => Ok(Box::new(Int8Storage::zeroed(numel, scale_unit)?)),
        Device::Cpu => Ok(Box::new(HostStorage::zeroed(dtype, numel)?)),
        Device::Cuda(ordinal) => Ok(Box::new(cuda::CudaStorage::zeroed(
            ordinal, dtype, numel, scale_unit,
        )?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("CUDA:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert!("tpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn region_end_and_numel() {
        let r = Region {
            offset: 10,
            shape: [2, 3, 4],
            strides: [100, 4, 1],
        };
        assert_eq!(r.end(), 10 + 100 + 8 + 3 + 1);
        assert_eq!(r.numel(), 24);
        let empty = Region {
            offset: 5,
            shape: [0, 3, 4],
            strides: [1, 1, 1],
        };
        assert_eq!(empty.end(), 5);
    }

    #[test]
    fn eight_bit_storage_keeps_scales_only_for_int8() {
        for dtype in DType::QUANTIZED {
            let host = allocate(Device::Cpu, dtype, 16, 4).unwrap();
            assert_eq!(host.dtype(), dtype);
            assert_eq!(host.row_scales().is_some(), dtype == DType::I8);
            assert_eq!(host.nbytes(), 16 + if dtype == DType::I8 { 16 } else { 0 });
            assert!(allocate(Device::Cpu, DType::I8, 18, 4).is_err());
        }
    }

    #[test]
    #[cfg(not(feature = "cuda-sim"))]
    fn cuda_is_a_device_error_or_a_device_storage() {
        match allocate(Device::Cuda(0), DType::F16, 4, 4) {
            Ok(s) => assert_eq!(s.device(), Device::Cuda(0)),
            Err(e) => assert!(matches!(e, crate::error::KvError::Device(_)), "{e}"),
        }
    }
}
