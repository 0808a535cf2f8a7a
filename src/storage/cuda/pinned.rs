//! [`PinnedBuffer`]: page-locked host memory that the block swaps of the offload tiers
//! pass through. A copy between device memory and pageable memory runs through the
//! driver's own small staging buffers at a fraction of the bus speed; from pinned memory
//! it is one DMA at full speed, asynchronous on the way in.
//!
//! Invariants: the buffer is allocated on first use and grows only when a swap needs
//! more (never per call); a copy queued from it is recorded (`pending`), and the next
//! use waits for that stream before the bytes are overwritten or freed.

use super::gpu::{Gpu, StreamHandle};
use crate::error::Result;

/// Bytes a swap moves per transfer at most: a longer swap goes in chunks, so the
/// page-locked memory stays small whatever the prefix length (a block larger than this
/// goes alone, and the buffer grows to hold it).
pub const SWAP_CHUNK: usize = 32 << 20;

/// Page-locked host memory of one storage, reused by every swap.
#[derive(Debug)]
pub(super) struct PinnedBuffer {
    ptr: *mut u8,
    bytes: usize,
    /// The stream of an asynchronous copy still reading the buffer.
    pending: Option<StreamHandle>,
}

// SAFETY: the pointer is page-locked host memory owned by this buffer alone; the storage
// holds the buffer behind a mutex.
unsafe impl Send for PinnedBuffer {}

impl Default for PinnedBuffer {
    fn default() -> Self {
        PinnedBuffer {
            ptr: std::ptr::null_mut(),
            bytes: 0,
            pending: None,
        }
    }
}

impl PinnedBuffer {
    /// At least `bytes` of the buffer, free to overwrite: waits for a copy still reading
    /// it, and reallocates when it is shorter.
    pub(super) fn reserve(&mut self, gpu: &dyn Gpu, bytes: usize) -> Result<&mut [u8]> {
        self.settle(gpu)?;
        if self.bytes < bytes {
            self.release(gpu);
            self.ptr = gpu.alloc_pinned(bytes)?;
            self.bytes = bytes;
        }
        // SAFETY: `ptr` holds `self.bytes >= bytes` bytes that no copy uses now.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, bytes) })
    }

    /// Records an asynchronous copy from the buffer queued on `stream`.
    pub(super) fn queued_on(&mut self, stream: StreamHandle) {
        self.pending = Some(stream);
    }

    /// Waits for the copy still reading the buffer, if any.
    fn settle(&mut self, gpu: &dyn Gpu) -> Result<()> {
        if let Some(stream) = self.pending {
            gpu.synchronize(stream)?;
            self.pending = None;
        }
        Ok(())
    }

    /// Frees the memory (after the copy still reading it); the buffer is empty after.
    pub(super) fn release(&mut self, gpu: &dyn Gpu) {
        if self.ptr.is_null() {
            return;
        }
        if self.settle(gpu).is_err() {
            // The device failed: the copy can no longer run, and freeing could race it.
            // Leaking the buffer is the safe choice.
            self.ptr = std::ptr::null_mut();
            self.bytes = 0;
            return;
        }
        // SAFETY: allocated by this gpu's alloc_pinned, no copy reads it, freed once.
        unsafe { gpu.free_pinned(self.ptr) };
        self.ptr = std::ptr::null_mut();
        self.bytes = 0;
    }

    /// Bytes allocated now.
    pub(super) fn capacity(&self) -> usize {
        self.bytes
    }
}
