//! The paged pool's bulk operations on a storage, as region copies: what the host
//! backend runs, and the reference the CUDA backend's one-launch kernels must equal.

use super::Storage;
use crate::error::{KvError, Result};
use crate::layout::{BlockId, Kv, PagedShape};
use crate::tensor::{TensorMut, TensorRef};

/// One cache tensor of a paged pool's storage.
#[derive(Clone, Copy, Debug)]
pub struct PagedTensor {
    /// The pool's sizes and layout.
    pub shape: PagedShape,
    /// Which of the storage's cache tensors.
    pub index: usize,
}

/// One layer of a multi-layer write ([`super::Storage::write_layers`]): the layer's
/// cache tensor, its slots (`block * block_size + offset`; -1 skips) and its rows
/// (`[n, H, D]`, `n` the number of slots).
#[derive(Clone, Copy, Debug)]
pub struct LayerRows<'a> {
    /// The layer's cache tensor.
    pub tensor: PagedTensor,
    /// One slot per token.
    pub slots: &'a [i64],
    /// The layer's keys.
    pub k: TensorRef<'a>,
    /// The layer's values.
    pub v: TensorRef<'a>,
}

/// Fails unless `k` and `v` are both `[n, H, D]` token rows for cache tensor `t`
/// (`n`: `rows`, or `k`'s when `None`); returns `n`. Every write of token rows checks
/// this before it copies: the copies and the device's scatter read `n` whole rows.
pub(crate) fn check_rows(
    t: &PagedTensor,
    rows: Option<usize>,
    k: &TensorRef,
    v: &TensorRef,
) -> Result<usize> {
    let h = t.shape.num_kv_heads;
    let n = rows.unwrap_or(k.shape3()[0]);
    for (name, x, d) in [("k", k, t.shape.head_dim), ("v", v, t.shape.v_head_dim)] {
        if x.shape3() != [n, h, d] {
            return Err(KvError::Shape {
                name,
                got: x.shape().to_vec(),
                expected: format!("[{n}, {h}, {d}] ([tokens, num_kv_heads, head_dim])"),
            });
        }
    }
    Ok(n)
}

/// Fails unless `k_out` and `v_out` are both `[H, >= n, D]` for cache tensor `t`: what
/// every read of `n` positions checks before it copies.
pub(crate) fn check_outputs(
    t: &PagedTensor,
    n: usize,
    k_out: &TensorMut,
    v_out: &TensorMut,
) -> Result<()> {
    let h = t.shape.num_kv_heads;
    for (name, out, d) in [
        ("k_out", k_out, t.shape.head_dim),
        ("v_out", v_out, t.shape.v_head_dim),
    ] {
        let [a, b, c] = out.shape3();
        if a != h || b < n || c != d {
            return Err(KvError::Shape {
                name,
                got: out.shape().to_vec(),
                expected: format!("[{h}, >= {n}, {d}] ([num_kv_heads, positions, head_dim])"),
            });
        }
    }
    Ok(())
}

/// Fails unless a packed buffer (`name`) of `len` bytes holds exactly `blocks` blocks
/// of `tensors` cache tensors of `shape` as `s` stores them: what the block swaps
/// check before they copy.
pub(crate) fn check_packed<S: Storage + ?Sized>(
    s: &S,
    name: &'static str,
    len: usize,
    shape: &PagedShape,
    tensors: usize,
    blocks: usize,
) -> Result<()> {
    let want = blocks
        .checked_mul(tensors)
        .and_then(|b| b.checked_mul(block_bytes(s, shape)));
    if want != Some(len) {
        return Err(KvError::Shape {
            name,
            got: vec![len],
            expected: format!(
                "{blocks} blocks of {tensors} cache tensors, {} bytes each, packed",
                block_bytes(s, shape)
            ),
        });
    }
    Ok(())
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
    check_rows(&t, Some(slots.len()), k, v)?;
    for_slot_runs(t.shape.block_size, slots, |b, off, i, run| {
        for (kv, src) in [(Kv::Key, k), (Kv::Value, v)] {
            s.write(
                t.shape.positions(t.index, kv, b, off, run),
                &src.slice(0, i, run),
            )?;
        }
        Ok(())
    })
}

/// Sets K and V at `slots` (-1 skips) to zero, consecutive slots of one block as one
/// region.
pub fn zero_slots<S: Storage + ?Sized>(s: &mut S, t: PagedTensor, slots: &[i64]) -> Result<()> {
    for_slot_runs(t.shape.block_size, slots, |b, off, _, run| {
        for kv in [Kv::Key, Kv::Value] {
            s.fill_zero(t.shape.positions(t.index, kv, b, off, run))?;
        }
        Ok(())
    })
}

/// Calls `f(block, offset, first index, length)` for each run of consecutive slots of
/// one block (`block * block_size + offset`; -1 skips).
fn for_slot_runs(
    bs: usize,
    slots: &[i64],
    mut f: impl FnMut(BlockId, usize, usize, usize) -> Result<()>,
) -> Result<()> {
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
        f(b, off, i, run)?;
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
    let n = check_rows(&t, None, k, v)?;
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
    k_out: &mut TensorMut,
    v_out: &mut TensorMut,
) -> Result<()> {
    check_outputs(&t, n, k_out, v_out)?;
    let bs = t.shape.block_size;
    let mut i = 0;
    while i < n {
        let pos = start + i;
        let run = (bs - pos % bs).min(n - i);
        let block = blocks[pos / bs];
        for (kv, mut out) in [(Kv::Key, k_out.reborrow()), (Kv::Value, v_out.reborrow())] {
            s.read(
                t.shape.positions(t.index, kv, block, pos % bs, run),
                &mut out.slice(1, i, run).transposed(0, 1),
            )?;
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

/// Runs `f` on the address of `bytes`, or of an 8-byte aligned copy when it is not
/// aligned so (the blocks' elements are read as their dtype).
pub fn with_aligned<R>(bytes: &[u8], f: impl FnOnce(*const u8) -> R) -> R {
    if (bytes.as_ptr() as usize).is_multiple_of(8) {
        return f(bytes.as_ptr());
    }
    let mut copy = vec![0u64; bytes.len().div_ceil(8)];
    // SAFETY: `copy` holds at least `bytes.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), copy.as_mut_ptr() as *mut u8, bytes.len())
    };
    f(copy.as_ptr() as *const u8)
}

/// Runs `f` on the address of `out`, or of an 8-byte aligned buffer copied into `out`
/// after when it is not aligned so.
fn with_aligned_mut<R>(out: &mut [u8], f: impl FnOnce(*mut u8) -> R) -> R {
    if (out.as_ptr() as usize).is_multiple_of(8) {
        return f(out.as_mut_ptr());
    }
    let mut buf = vec![0u64; out.len().div_ceil(8)];
    let r = f(buf.as_mut_ptr() as *mut u8);
    // SAFETY: `buf` holds at least `out.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(buf.as_ptr() as *const u8, out.as_mut_ptr(), out.len())
    };
    r
}

/// One block of one cache tensor at `ptr` as a tensor of the storage's dtype.
///
/// # Safety
/// `ptr` holds one block of `s`'s dtype, aligned for it.
unsafe fn block_at<'a, S: Storage + ?Sized>(
    s: &S,
    shape: &PagedShape,
    ptr: *mut u8,
) -> Result<TensorMut<'a>> {
    TensorMut::contiguous(ptr, s.dtype(), &[1, 1, shape.block_elems()])
}

/// Reads whole `blocks` of cache tensors `0..tensors` into `out` (any alignment),
/// packed block-major: block `i`'s tensor `t` at byte `(i * tensors + t) * block bytes`
/// (raw storage elements: codes for 8-bit storage).
pub fn read_blocks<S: Storage + ?Sized>(
    s: &S,
    shape: PagedShape,
    tensors: usize,
    blocks: &[BlockId],
    out: &mut [u8],
) -> Result<()> {
    check_packed(s, "out", out.len(), &shape, tensors, blocks.len())?;
    let bb = block_bytes(s, &shape);
    with_aligned_mut(out, |base| {
        for (i, &b) in blocks.iter().enumerate() {
            for t in 0..tensors {
                // SAFETY: `base` is 8-byte aligned and holds every block, each a whole
                // number of elements.
                let mut dst = unsafe { block_at(s, &shape, base.add((i * tensors + t) * bb))? };
                s.read(shape.whole_block(t, b), &mut dst)?;
            }
        }
        Ok(())
    })
}

/// Fails unless `data` holds one slice per one of `blocks`, each exactly one block of
/// cache tensors `0..tensors` as `s` stores them: what the swap-ins check before they
/// copy.
pub(crate) fn check_data<S: Storage + ?Sized>(
    s: &S,
    shape: &PagedShape,
    tensors: usize,
    blocks: &[BlockId],
    data: &[&[u8]],
) -> Result<()> {
    if data.len() != blocks.len() {
        return Err(KvError::Shape {
            name: "data",
            got: vec![data.len()],
            expected: format!("[{}] (one slice per block)", blocks.len()),
        });
    }
    data.iter()
        .try_for_each(|one| check_packed(s, "data", one.len(), shape, tensors, 1))
}

/// Writes whole `blocks` of cache tensors `0..tensors`, block `i` from `data[i]` (any
/// alignment; its tensors one after another, as [`read_blocks`] packs a block).
pub fn write_blocks<S: Storage + ?Sized>(
    s: &mut S,
    shape: PagedShape,
    tensors: usize,
    blocks: &[BlockId],
    data: &[&[u8]],
) -> Result<()> {
    check_data(s, &shape, tensors, blocks, data)?;
    let bb = block_bytes(s, &shape);
    for (&b, one) in blocks.iter().zip(data) {
        with_aligned(one, |base| {
            for t in 0..tensors {
                // SAFETY: as in read_blocks, for this block's tensors.
                let src = unsafe { block_at(s, &shape, base.add(t * bb) as *mut u8)? };
                s.write(shape.whole_block(t, b), &src.as_ref())?;
            }
            Ok::<(), crate::error::KvError>(())
        })?;
    }
    Ok(())
}
