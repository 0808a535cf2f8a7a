//! The paged pool's bulk operations on a storage, as region copies: what the host
//! backend runs, and the reference the CUDA backend's one-launch kernels must equal.

use super::Storage;
use crate::error::Result;
use crate::layout::{BlockId, Kv, PagedShape};
use crate::tensor::TensorRef;

/// One cache tensor of a paged pool's storage.
#[derive(Clone, Copy, Debug)]
pub struct PagedTensor {
    /// The pool's sizes and layout.
    pub shape: PagedShape,
    /// Which of the storage's cache tensors.
    pub index: usize,
}

/// Writes `k`, `v` (`[n, H, D]`) at `slots` (`block * block_size + offset`; -1 skips),
/// consecutive slots of one block as one region.
pub fn write_slots<S: Storage + ?Sized>(
    s: &mut S,
    t: PagedTensor,
    slots: &[i64],
    k: &TensorRef,
    v: &TensorRef,
) -> Result<()> {
    let bs = t.shape.block_size;
    let n = slots.len();
    let mut i = 0;
    while i < n {
        if slots[i] < 0 {
            i += 1;
            continue;
        }
        let (b, off) = ((slots[i] as usize / bs) as BlockId, slots[i] as usize % bs);
        let mut run = 1;
        while i + run < n && off + run < bs && slots[i + run] == slots[i] + run as i64 {
            run += 1;
        }
        for (kv, src) in [(Kv::Key, k), (Kv::Value, v)] {
            s.write(
                t.shape.positions(t.index, kv, b, off, run),
                &src.slice(0, i, run),
            )?;
        }
        i += run;
    }
    Ok(())
}

/// Writes `k`, `v` (`[n, H, D]`) at positions `start..start + n` through `blocks`.
pub fn write_positions<S: Storage + ?Sized>(
    s: &mut S,
    t: PagedTensor,
    blocks: &[BlockId],
    start: usize,
    k: &TensorRef,
    v: &TensorRef,
) -> Result<()> {
    let bs = t.shape.block_size;
    let n = k.shape3()[0];
    let mut i = 0;
    while i < n {
        let pos = start + i;
        let run = (bs - pos % bs).min(n - i);
        let block = blocks[pos / bs];
        for (kv, src) in [(Kv::Key, k), (Kv::Value, v)] {
            s.write(
                t.shape.positions(t.index, kv, block, pos % bs, run),
                &src.slice(0, i, run),
            )?;
        }
        i += run;
    }
    Ok(())
}

/// Reads positions `start..start + n` through `blocks` into `[H, >= n, D]` outputs.
pub fn read_positions<S: Storage + ?Sized>(
    s: &S,
    t: PagedTensor,
    blocks: &[BlockId],
    start: usize,
    n: usize,
    k_out: &TensorRef,
    v_out: &TensorRef,
) -> Result<()> {
    let bs = t.shape.block_size;
    let mut i = 0;
    while i < n {
        let pos = start + i;
        let run = (bs - pos % bs).min(n - i);
        let block = blocks[pos / bs];
        for (kv, out) in [(Kv::Key, k_out), (Kv::Value, v_out)] {
            let dst = out.slice(1, i, run).transposed(0, 1);
            s.read(t.shape.positions(t.index, kv, block, pos % bs, run), &dst)?;
        }
        i += run;
    }
    Ok(())
}

/// Copies whole blocks `(src, dst)` in cache tensors `0..tensors`.
pub fn copy_blocks<S: Storage + ?Sized>(
    s: &mut S,
    shape: PagedShape,
    tensors: usize,
    pairs: &[(BlockId, BlockId)],
) -> Result<()> {
    for t in 0..tensors {
        for &(src, dst) in pairs {
            s.copy_within(shape.whole_block(t, src), shape.whole_block(t, dst))?;
        }
    }
    Ok(())
}

/// Bytes of one block of one cache tensor of `shape`, stored as `s` stores it.
fn block_bytes<S: Storage + ?Sized>(s: &S, shape: &PagedShape) -> usize {
    shape.block_elems() * s.dtype().size()
}

/// Reads whole `blocks` of cache tensors `0..tensors` into `out`, packed block-major:
/// block `i`'s tensor `t` at byte `(i * tensors + t) * block bytes` (raw storage
/// elements: codes for 8-bit storage).
pub fn read_blocks<S: Storage + ?Sized>(
    s: &S,
    shape: PagedShape,
    tensors: usize,
    blocks: &[BlockId],
    out: &mut [u8],
) -> Result<()> {
    let bb = block_bytes(s, &shape);
    assert_eq!(out.len(), blocks.len() * tensors * bb, "packed blocks");
    for (i, &b) in blocks.iter().enumerate() {
        for t in 0..tensors {
            let at = (i * tensors + t) * bb;
            // SAFETY: `out[at..at + bb]` holds one block of the storage dtype; callers
            // pass 8-byte aligned buffers, so every block starts aligned for its dtype.
            let dst = unsafe {
                TensorRef::contiguous(
                    out[at..].as_mut_ptr(),
                    s.dtype(),
                    &[1, 1, shape.block_elems()],
                )?
            };
            s.read(shape.whole_block(t, b), &dst)?;
        }
    }
    Ok(())
}

/// Writes whole `blocks` of cache tensors `0..tensors` from `packed`, laid out as
/// [`read_blocks`] reads them.
pub fn write_blocks<S: Storage + ?Sized>(
    s: &mut S,
    shape: PagedShape,
    tensors: usize,
    blocks: &[BlockId],
    packed: &[u8],
) -> Result<()> {
    let bb = block_bytes(s, &shape);
    assert_eq!(packed.len(), blocks.len() * tensors * bb, "packed blocks");
    for (i, &b) in blocks.iter().enumerate() {
        for t in 0..tensors {
            let at = (i * tensors + t) * bb;
            // SAFETY: as in read_blocks.
            let src = unsafe {
                TensorRef::contiguous(
                    packed[at..].as_ptr(),
                    s.dtype(),
                    &[1, 1, shape.block_elems()],
                )?
            };
            s.write(shape.whole_block(t, b), &src)?;
        }
    }
    Ok(())
}
