//! The paged pool's bulk operations on the device, one launch each: the scatter of a
//! batch's tokens by slot (`kvrs_scatter_*`; int8 computes each vector's scale), the
//! gather of a block table's positions (`kvrs_gather_*`) and whole-block copies
//! (`kvrs_copy_blocks`, codes and int8 scales alike).

use super::gpu::{Args, DevicePtr, THREADS};
use super::kernels::{gather_kernel, kernel, Kernel};
use super::storage::CudaStorage;
use crate::error::Result;
use crate::layout::BlockId;
use crate::storage::{PagedTensor, Storage};
use crate::tensor::{TensorMut, TensorRef};

impl CudaStorage {
    /// Whether the scatter kernel can write `k`, `v`: both on this device, of one dtype,
    /// with `head_dim` contiguous (otherwise the region copies do it).
    pub(super) fn scatters(&self, k: &TensorRef, v: &TensorRef) -> Result<bool> {
        let local = self.is_local("k", k.device())? && self.is_local("v", v.device())?;
        Ok(local
            && k.strides3()[2] == 1
            && v.strides3()[2] == 1
            && k.dtype() == v.dtype()
            && !k.dtype().is_quantized())
    }

    /// Launches the scatter of `n` token rows of `k`, `v` to the slots `slots` writes.
    pub(super) fn scatter(
        &self,
        t: PagedTensor,
        n: usize,
        k: &TensorRef,
        v: &TensorRef,
        slots: impl FnOnce(&mut Vec<u64>),
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let sh = t.shape;
        let cache = self.device_addr(sh.block_offset(t.index, 0));
        let (ks, vs) = (k.strides3(), v.strides3());
        // int8: the scales of the tensor's vectors (the q8 kernel's extra argument).
        let scales = self
            .scales
            .as_ref()
            .map(|sc| sc.device_addr(sh.block_offset(t.index, 0) / self.head_dim));
        let fill = |w: &mut Vec<u64>| {
            w.extend([
                k.as_ptr() as u64,
                v.as_ptr() as u64,
                cache,
                scales.unwrap_or(0),
            ]);
            slots(w);
        };
        self.with_upload(fill, |base| {
            let args = Args::new().u64(base).u64(base + 8).u64(base + 16);
            let args = if scales.is_some() {
                args.u64(base + 24)
            } else {
                args
            };
            let args = args
                .u64(base + 32)
                .i64(ks[0] as i64)
                .i64(ks[1] as i64)
                .i64(vs[0] as i64)
                .i64(vs[1] as i64);
            // The slots lie in this storage (`check_slots`) and k and v are [n, H, D]
            // device tensors (`check_rows`), both checked by the caller.
            let name = kernel(Kernel::Scatter, k.dtype(), self.dtype())?;
            self.launch_rows(name, n, &sh, args)
        })
    }

    /// Launches the gather of positions `start..start + n` of cache tensor `t` through
    /// `blocks` into `k_out`, `v_out` (`[H, >= n, D]` on this device, the storage's dtype,
    /// head_dim contiguous): raw copies, no conversion.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather(
        &self,
        t: PagedTensor,
        blocks: &[BlockId],
        start: usize,
        n: usize,
        k_out: &mut TensorMut,
        v_out: &mut TensorMut,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let sh = t.shape;
        let cache = self.device_addr(sh.block_offset(t.index, 0));
        let (ks, vs) = (k_out.strides3(), v_out.strides3());
        let outs = [k_out.as_mut_ptr() as u64, v_out.as_mut_ptr() as u64];
        let fill = |w: &mut Vec<u64>| {
            w.push(cache);
            w.extend(outs);
            // The int32 block table, two entries per word.
            w.extend(
                blocks
                    .chunks(2)
                    .map(|c| c[0] as u64 | (c.get(1).copied().unwrap_or(0) as u64) << 32),
            );
        };
        self.with_upload(fill, |base| {
            let args = Args::new()
                .u64(base)
                .u64(base + 24)
                .i64(start as i64)
                .u64(base + 8)
                .u64(base + 16)
                .i64(ks[0] as i64)
                .i64(ks[1] as i64)
                .i64(vs[0] as i64)
                .i64(vs[1] as i64);
            // The table holds the positions, in this storage (`check_positions`), and the
            // outputs are [H, >= n, D] device tensors (`check_outputs`), both checked by
            // the caller.
            self.launch_rows(gather_kernel(self.dtype()), n, &sh, args)
        })
    }

    /// Launches the copy of whole blocks `pairs` (src, dst) of `block_words` 32-bit words
    /// in each tensor starting at `bases`.
    pub(super) fn launch_copy_blocks(
        &self,
        bases: impl Iterator<Item = DevicePtr> + Clone,
        pairs: &[(BlockId, BlockId)],
        block_words: usize,
    ) -> Result<()> {
        let tensors = bases.clone().count();
        let fill = |w: &mut Vec<u64>| {
            w.extend(bases);
            w.extend(pairs.iter().flat_map(|&(s, d)| [s as u64, d as u64]));
        };
        self.with_upload(fill, |base| {
            let args = Args::new()
                .u64(base)
                .u64(base + 8 * tensors as u64)
                .i64(block_words as i64);
            // SAFETY: the blocks lie inside every tensor (`check_blocks`, by the callers).
            unsafe {
                self.gpu.launch(
                    "kvrs_copy_blocks",
                    [pairs.len() as u32, tensors as u32, 1],
                    [THREADS, 1, 1],
                    &args,
                    self.stream(),
                )
            }
        })
    }
}
