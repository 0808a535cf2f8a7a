//! The block swaps of the offload tiers on the device: whole blocks of every cache
//! tensor packed into device scratch by one launch (`kvrs_save_blocks`) and moved by one
//! transfer through the storage's page-locked buffer, or the reverse
//! (`kvrs_load_blocks`). Long swaps go in chunks of [`SWAP_CHUNK`] bytes.

use super::gpu::{Args, DevicePtr, THREADS};
use super::pinned::SWAP_CHUNK;
use super::storage::CudaStorage;
use crate::error::Result;
use crate::layout::{BlockId, PagedShape};
use crate::storage::Storage;

impl CudaStorage {
    /// The device addresses of cache tensors `0..tensors`' block 0, then `blocks`: the
    /// words of a block-swap launch.
    fn swap_words(&self, shape: PagedShape, tensors: usize, blocks: &[BlockId], w: &mut Vec<u64>) {
        w.extend((0..tensors).map(|t| self.device_addr(shape.block_offset(t, 0))));
        w.extend(blocks.iter().map(|&b| b as u64));
    }

    /// Launches `kvrs_load_blocks` or `kvrs_save_blocks` over `items` blocks of
    /// `tensors` tensors, the pointer table at `table` and the packed words at `packed`.
    fn launch_swap(
        &self,
        name: &str,
        table: DevicePtr,
        tensors: usize,
        items: usize,
        packed: DevicePtr,
        block_words: usize,
    ) -> Result<()> {
        let args = Args::new()
            .u64(table)
            .u64(table + 8 * tensors as u64)
            .u64(packed)
            .i64(block_words as i64);
        // SAFETY: the blocks lie inside every tensor (`check_blocks`) and the packed
        // buffer holds items x tensors blocks (the caller's buffers were checked against
        // the blocks: `check_packed`, `check_data`).
        unsafe {
            self.gpu.launch(
                name,
                [items as u32, tensors as u32, 1],
                [THREADS, 1, 1],
                &args,
                self.stream(),
            )
        }
    }

    /// Bytes of one block of every one of `tensors` cache tensors, and the blocks a
    /// chunk holds; `None` when blocks are not whole 32-bit words (the kernels move
    /// words; the region copies do it then).
    fn swap_sizes(
        &self,
        shape: &PagedShape,
        tensors: usize,
        blocks: usize,
    ) -> Option<(usize, usize)> {
        let block_bytes = shape.block_elems() * self.dtype().size();
        if !block_bytes.is_multiple_of(4) || blocks == 0 || tensors == 0 {
            return None;
        }
        let per_block = tensors * block_bytes;
        Some((per_block, (SWAP_CHUNK / per_block).max(1)))
    }

    /// [`Storage::read_blocks`]: per chunk, one launch packs the blocks into device
    /// scratch and one transfer brings them to the page-locked buffer (straight into
    /// `out` when no page-locked memory can be had); `None` when blocks are not whole
    /// 32-bit words.
    pub(super) fn save_blocks(
        &self,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Option<Result<()>> {
        let (per_block, chunk) = self.swap_sizes(&shape, tensors, blocks.len())?;
        self.check_blocks(&shape, tensors, blocks.iter().map(|&b| b as u64));
        let words = per_block / tensors / 4;
        let mut pinned = self.pinned.lock();
        let mut swaps = blocks.chunks(chunk).zip(out.chunks_mut(chunk * per_block));
        Some(swaps.try_for_each(|(bs, dst)| {
            let bytes = dst.len();
            self.with_upload_and_scratch(
                |w| self.swap_words(shape, tensors, bs, w),
                bytes,
                |table, packed| {
                    self.launch_swap("kvrs_save_blocks", table, tensors, bs.len(), packed, words)?;
                    let stream = self.stream();
                    match pinned.reserve(self.gpu.as_ref(), bytes) {
                        Ok(bounce) => {
                            // SAFETY: `bounce` holds `bytes`; the scratch holds the packed blocks.
                            unsafe { self.gpu.dtoh(bounce.as_mut_ptr(), packed, bytes, stream)? };
                            dst.copy_from_slice(bounce);
                            Ok(())
                        }
                        // SAFETY: as above, into `dst`.
                        Err(_) => unsafe { self.gpu.dtoh(dst.as_mut_ptr(), packed, bytes, stream) },
                    }
                },
            )
        }))
    }

    /// [`Storage::write_blocks`]: per chunk, the blocks' bytes gathered into the
    /// page-locked buffer, one transfer into device scratch (queued: the buffer's next
    /// use waits for it) and one launch; `None` when blocks are not whole 32-bit words.
    pub(super) fn load_blocks(
        &self,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        data: &[&[u8]],
    ) -> Option<Result<()>> {
        let (per_block, chunk) = self.swap_sizes(&shape, tensors, blocks.len())?;
        self.check_blocks(&shape, tensors, blocks.iter().map(|&b| b as u64));
        let words = per_block / tensors / 4;
        let mut pinned = self.pinned.lock();
        let mut swaps = blocks.chunks(chunk).zip(data.chunks(chunk));
        Some(swaps.try_for_each(|(bs, ds)| {
            let bytes = ds.len() * per_block;
            self.with_upload_and_scratch(
                |w| self.swap_words(shape, tensors, bs, w),
                bytes,
                |table, packed| {
                    let stream = self.stream();
                    match pinned.reserve(self.gpu.as_ref(), bytes) {
                        Ok(bounce) => {
                            for (dst, src) in bounce.chunks_exact_mut(per_block).zip(ds) {
                                dst.copy_from_slice(src);
                            }
                            // SAFETY: `bounce` holds `bytes`, and so does the scratch.
                            unsafe { self.gpu.htod(packed, bounce.as_ptr(), bytes, stream)? };
                            pinned.queued_on(stream);
                        }
                        Err(_) => {
                            for (i, src) in ds.iter().enumerate() {
                                let at = packed + (i * per_block) as u64;
                                // SAFETY: block `i` of the scratch holds `per_block` bytes.
                                unsafe { self.gpu.htod(at, src.as_ptr(), per_block, stream)? };
                            }
                        }
                    }
                    self.launch_swap("kvrs_load_blocks", table, tensors, bs.len(), packed, words)
                },
            )
        }))
    }

    /// Bytes of page-locked host memory the swaps hold now.
    pub fn pinned_bytes(&self) -> usize {
        self.pinned.lock().capacity()
    }
}
