//! The block swaps of the offload tiers on the device: whole blocks of every cache
//! tensor packed into device scratch by one launch (`kvrs_save_blocks`, 16-byte accesses
//! where the block size allows) and moved by one
//! transfer through the storage's page-locked buffer, or the reverse
//! (`kvrs_load_blocks`). Long swaps go in chunks of [`SWAP_CHUNK`] bytes.

use super::gpu::{Args, DevicePtr, THREADS};
use super::kernels::{WordsKernel, LOAD_BLOCKS, SAVE_BLOCKS};
use super::pinned::SWAP_CHUNK;
use super::storage::CudaStorage;
use crate::error::Result;
use crate::layout::{BlockId, PagedShape};
use crate::storage::Storage;

/// Bytes of one block one thread block moves (256 threads x 16 bytes x 4 in flight).
const SWAP_CHUNK_BYTES: usize = 16 << 10;

impl CudaStorage {
    /// Launches `kernel` (`kvrs_load_blocks` or `kvrs_save_blocks`) over `blocks` of
    /// `tensors` tensors of `shape`, the packed blocks at `packed`.
    fn launch_swap(
        &self,
        kernel: WordsKernel,
        shape: PagedShape,
        tensors: usize,
        blocks: &[BlockId],
        packed: DevicePtr,
    ) -> Result<()> {
        let block_bytes = shape.block_elems() * self.dtype().size();
        let mut words: Vec<u64> = (0..tensors)
            .map(|t| self.device_addr(shape.block_offset(t, 0)))
            .collect();
        let vec = [16usize, 8, 4]
            .into_iter()
            .find(|&b| {
                block_bytes.is_multiple_of(b)
                    && packed.is_multiple_of(b as u64)
                    && words.iter().all(|&a| a.is_multiple_of(b as u64))
            })
            .expect("blocks of whole 32-bit words");
        words.extend(blocks.iter().map(|&b| b as u64));
        let chunk = SWAP_CHUNK_BYTES.min(block_bytes);
        let args = Args::new()
            .u64(packed)
            .i64(block_bytes as i64)
            .i64(chunk as i64)
            .i32(vec as i32);
        let grid = [
            blocks.len() as u32,
            tensors as u32,
            block_bytes.div_ceil(chunk) as u32,
        ];
        // The blocks lie inside every tensor (`check_blocks`) and the packed buffer
        // holds blocks x tensors blocks (the caller's buffers were checked against the
        // blocks: `check_packed`, `check_data`).
        self.launch_words(kernel, words, args, grid, [THREADS, 1, 1])
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
        let mut pinned = self.pinned.lock();
        let mut swaps = blocks.chunks(chunk).zip(out.chunks_mut(chunk * per_block));
        Some(swaps.try_for_each(|(bs, dst)| {
            let bytes = dst.len();
            self.with_upload_and_scratch(
                |_| {},
                bytes,
                |_, packed| {
                    self.launch_swap(SAVE_BLOCKS, shape, tensors, bs, packed)?;
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
        let mut pinned = self.pinned.lock();
        let mut swaps = blocks.chunks(chunk).zip(data.chunks(chunk));
        Some(swaps.try_for_each(|(bs, ds)| {
            let bytes = ds.len() * per_block;
            self.with_upload_and_scratch(
                |_| {},
                bytes,
                |_, packed| {
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
                    self.launch_swap(LOAD_BLOCKS, shape, tensors, bs, packed)
                },
            )
        }))
    }

    /// Bytes of page-locked host memory the swaps hold now.
    pub fn pinned_bytes(&self) -> usize {
        self.pinned.lock().capacity()
    }
}
