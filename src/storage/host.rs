//! Host (CPU) memory storage: one zero-filled, 64-byte-aligned allocation.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use rayon::prelude::*;

use super::{paged_ops, Device, Region, Storage};
use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::layout::{BlockId, PagedShape};
use crate::tensor::{copy_strided, TensorMut, TensorRef};

/// Alignment of host allocations (a cache line, and enough for any SIMD load).
const ALIGN: usize = 64;

/// Keys and values in host memory.
#[derive(Debug)]
pub struct HostStorage {
    /// Element 0: `base` rounded up to [`ALIGN`].
    ptr: NonNull<u8>,
    /// The allocation, and its layout.
    base: NonNull<u8>,
    layout: Layout,
    dtype: DType,
    numel: usize,
    /// Elements [`Storage::write`] has clamped to an fp8 dtype's largest value so far.
    saturated: u64,
}

// SAFETY: HostStorage owns its allocation outright; mutation goes through &mut self.
unsafe impl Send for HostStorage {}
unsafe impl Sync for HostStorage {}

impl HostStorage {
    /// Allocates `numel` zeroed elements of `dtype`; fails cleanly (no abort) when the
    /// allocator refuses.
    pub fn zeroed(dtype: DType, numel: usize) -> Result<Self> {
        let bytes = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| too_large(numel, dtype))?;
        // Allocated with the allocator's own alignment and aligned by hand: zeroed memory
        // then comes from calloc, whose large allocations are fresh pages the kernel zeroes
        // on first touch, so a large pool costs nothing until it is written.
        let layout = bytes
            .checked_add(ALIGN)
            .and_then(|b| Layout::from_size_align(b, 16).ok())
            .ok_or_else(|| too_large(numel, dtype))?;
        // SAFETY: the layout has a non-zero size.
        let base = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(KvError::OutOfMemory {
            what: "the K/V storage (host memory)",
            bytes,
        })?;
        let skip = base.as_ptr().align_offset(ALIGN);
        // SAFETY: `skip < ALIGN`, and the allocation has `ALIGN` bytes to spare.
        let ptr = unsafe { NonNull::new_unchecked(base.as_ptr().add(skip)) };
        Ok(HostStorage {
            ptr,
            base,
            layout,
            dtype,
            numel,
            saturated: 0,
        })
    }

    /// Panics unless `r` lies inside the allocation.
    pub(crate) fn check_region(&self, r: &Region) {
        // Regions are computed by the caches from validated arguments; one that runs past
        // the allocation is a bug in kvrs, and stopping beats corrupting memory.
        assert!(
            r.end() <= self.numel,
            "region {r:?} exceeds storage of {} elements",
            self.numel
        );
    }

    fn at(&self, offset: usize) -> *mut u8 {
        // SAFETY: offsets come from checked regions, inside the allocation.
        unsafe { self.ptr.as_ptr().add(offset * self.dtype.size()) }
    }
}

/// The storage's address, shared by the threads of a parallel copy into disjoint regions.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);

// SAFETY: used only for copies into disjoint regions while `&mut HostStorage` is held.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The address `offset` bytes in.
    ///
    /// # Safety
    /// `offset` lies inside the allocation.
    unsafe fn at(self, offset: usize) -> *mut u8 {
        unsafe { self.0.add(offset) }
    }
}

/// Fails unless a tensor on `device` is host memory: a device tensor cannot be read from
/// the host.
pub(crate) fn on_host(name: &str, device: Device) -> Result<()> {
    if device != Device::Cpu {
        return Err(KvError::Device(format!(
            "{name} lives on {device}; this cache lives on the host, so pass a CPU tensor"
        )));
    }
    Ok(())
}

fn too_large(numel: usize, dtype: DType) -> KvError {
    KvError::InvalidArgument {
        name: "size",
        value: format!("{numel} {dtype} elements"),
        reason: format!("exceeds the address space (at most {} bytes)", isize::MAX),
    }
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.base.as_ptr(), self.layout) }
    }
}

impl Storage for HostStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn numel(&self) -> usize {
        self.numel
    }

    fn data_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whole blocks from packed bytes (a tier's payloads), copied in parallel when the
    /// blocks are distinct (the copies then never overlap).
    fn write_blocks(
        &mut self,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        data: &[&[u8]],
    ) -> Result<()> {
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let in_range = sorted
            .last()
            .is_none_or(|&b| (b as usize) < shape.num_blocks);
        if sorted.len() != blocks.len() || !in_range {
            // Repeated blocks (or ids past the shape's, whose regions may alias another
            // tensor's): one copy after another.
            return paged_ops::write_blocks(self, shape, tensors, blocks, data);
        }
        paged_ops::check_data(self, &shape, tensors, blocks, data)?;
        let bb = shape.block_elems() * self.dtype.size();
        let copies: Vec<(usize, &[u8])> = blocks
            .iter()
            .zip(data)
            .flat_map(|(&b, one)| {
                (0..tensors).map(move |t| (shape.whole_block(t, b), &one[t * bb..(t + 1) * bb]))
            })
            .map(|(r, src)| {
                self.check_region(&r);
                (r.offset * self.dtype.size(), src)
            })
            .collect();
        let base = SendPtr(self.ptr.as_ptr());
        crate::parallel::install(|| {
            copies.par_iter().with_min_len(16).for_each(|&(at, src)| {
                // SAFETY: each region was checked to lie in the allocation; the blocks are
                // distinct and below the shape's block count, so the regions (one block
                // of one tensor each) never overlap; `&mut self` excludes every other
                // access, and `src` is a separate buffer of the region's length.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.at(at), src.len()) }
            })
        });
        Ok(())
    }

    fn write(&mut self, dst: Region, src: &TensorRef) -> Result<()> {
        self.check_region(&dst);
        on_host("the source", src.device())?;
        src.expect_region("the source", &dst)?;
        // SAFETY: dst checked above; src holds dst's shape (checked above), readable by
        // the TensorRef's contract.
        let saturated = unsafe {
            copy_strided(
                self.at(dst.offset),
                self.dtype,
                dst.signed_strides(),
                src.as_ptr(),
                src.dtype(),
                src.strides3(),
                dst.shape,
            )
        };
        self.saturated += saturated as u64;
        Ok(())
    }

    fn saturated(&self) -> Option<u64> {
        self.dtype.fp8().map(|_| self.saturated)
    }

    fn read(&self, src: Region, dst: &mut TensorMut) -> Result<()> {
        self.check_region(&src);
        on_host("the destination", dst.device())?;
        dst.expect_region("the destination", &src)?;
        // SAFETY: as in `write`, with the roles swapped (dst is borrowed mutably).
        unsafe {
            copy_strided(
                dst.as_mut_ptr(),
                dst.dtype(),
                dst.strides3(),
                self.at(src.offset),
                self.dtype,
                src.signed_strides(),
                src.shape,
            )
        };
        Ok(())
    }

    fn copy_within(&mut self, src: Region, dst: Region) -> Result<()> {
        self.check_region(&src);
        self.check_region(&dst);
        assert!(
            src.end() <= dst.offset || dst.end() <= src.offset,
            "overlapping copy {src:?} -> {dst:?}"
        );
        assert_eq!(
            src.shape, dst.shape,
            "copy between regions of different shapes"
        );
        // SAFETY: both regions checked and disjoint.
        unsafe {
            copy_strided(
                self.at(dst.offset),
                self.dtype,
                dst.signed_strides(),
                self.at(src.offset),
                self.dtype,
                src.signed_strides(),
                dst.shape,
            )
        };
        Ok(())
    }

    fn fill_zero(&mut self, dst: Region) -> Result<()> {
        self.check_region(&dst);
        if dst.shape.contains(&0) {
            return Ok(());
        }
        // Zeroing runs on every claim of a position (reserve, start_forward): plain
        // memsets over the region's rows, no tensor built.
        let size = self.dtype.size();
        let [n0, n1, n2] = dst.shape;
        let [s0, s1, s2] = dst.strides;
        let contiguous = s2 == 1 && (n1 == 1 || s1 == n2) && (n0 == 1 || s0 == n1 * n2);
        let (rows, row_len) = if contiguous {
            (1, n0 * n1 * n2)
        } else {
            (n0 * n1, n2)
        };
        for row in 0..rows {
            let (i, j) = (row / n1, row % n1);
            let start = dst.offset + i * s0 + j * s1;
            // SAFETY: dst checked above: every element of the region lies inside the
            // allocation, which `&mut self` borrows exclusively; zero bytes are a zero
            // of every dtype.
            unsafe {
                if contiguous || s2 == 1 {
                    std::ptr::write_bytes(self.at(start), 0, row_len * size);
                } else {
                    for k in 0..n2 {
                        std::ptr::write_bytes(self.at(start + k * s2), 0, size);
                    }
                }
            }
        }
        Ok(())
    }

    fn zero(&self, t: &mut TensorMut) -> Result<()> {
        on_host("the output", t.device())?;
        t.fill_zero();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvLayout;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whole-block writes (the parallel copy of distinct blocks, the sequential one
        /// of repeated blocks) leave the storage as one copy after another would.
        #[test]
        fn write_blocks_matches_copies_one_after_another(
            layers in 1usize..4,
            num_blocks in 1usize..12,
            picks in proptest::collection::vec(0usize..12, 1..12),
            seed in any::<u8>(),
        ) {
            let shape = PagedShape {
                num_layers: layers,
                num_kv_heads: 2,
                head_dim: 4,
                v_head_dim: 4,
                block_size: 3,
                num_blocks,
                layout: KvLayout::Nhd,
            };
            let tensors = layers;
            // Ids past the pool's blocks too (regions that alias another tensor's).
            let blocks: Vec<BlockId> = picks.iter().map(|&p| (p % (num_blocks + 2)) as BlockId).collect();
            let bb = shape.block_elems() * 4;
            let data: Vec<Vec<u8>> = (0..blocks.len())
                .map(|i| (0..tensors * bb).map(|j| (i * 31 + j * 7) as u8 ^ seed).collect())
                .collect();
            let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let numel = tensors * shape.layer_elems() + 2 * shape.block_elems();
            let mut fast = HostStorage::zeroed(DType::F32, numel).unwrap();
            let mut slow = HostStorage::zeroed(DType::F32, numel).unwrap();
            fast.write_blocks(shape, tensors, &blocks, &refs).unwrap();
            paged_ops::write_blocks(&mut slow, shape, tensors, &blocks, &refs).unwrap();
            // SAFETY: each storage holds `numel` f32 elements, nothing else uses them here.
            let (got, want) = unsafe {
                (
                    std::slice::from_raw_parts(fast.data_ptr(), numel * 4),
                    std::slice::from_raw_parts(slow.data_ptr(), numel * 4),
                )
            };
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn write_read_round_trip_and_zero_fill() {
        let mut s = HostStorage::zeroed(DType::F32, 64).unwrap();
        assert_eq!(s.data_ptr() as usize % ALIGN, 0);
        let region = Region {
            offset: 8,
            shape: [1, 2, 3],
            strides: [0, 10, 1],
        };
        let data = [1f32, 2., 3., 4., 5., 6.];
        s.write(region, &TensorRef::from_f32(&data, &[1, 2, 3]).unwrap())
            .unwrap();
        let mut out = [0f32; 6];
        s.read(
            region,
            &mut TensorMut::from_f32_mut(&mut out, &[1, 2, 3]).unwrap(),
        )
        .unwrap();
        assert_eq!(out, data);
        s.fill_zero(region).unwrap();
        s.read(
            region,
            &mut TensorMut::from_f32_mut(&mut out, &[1, 2, 3]).unwrap(),
        )
        .unwrap();
        assert_eq!(out, [0.0; 6]);
    }

    #[test]
    #[should_panic(expected = "exceeds storage")]
    fn a_region_whose_end_wraps_is_caught() {
        let mut s = HostStorage::zeroed(DType::F32, 4).unwrap();
        s.fill_zero(Region {
            offset: 0,
            shape: [3, 1, 1],
            strides: [1 << 63, 0, 1],
        })
        .unwrap();
    }

    #[test]
    #[should_panic(expected = "exceeds storage")]
    fn out_of_bounds_region_is_caught() {
        let mut s = HostStorage::zeroed(DType::F16, 4).unwrap();
        s.fill_zero(Region {
            offset: 2,
            shape: [1, 1, 3],
            strides: [0, 0, 1],
        })
        .unwrap();
    }
}
