//! Reading a sequence: the span a layer holds, and gathers of its positions into
//! contiguous K/V (split across rayon's threads when large).

use rayon::prelude::*;

use super::pool::{PoolCore, SeqId};
use crate::error::{check_index, KvError, Result};
use crate::layout::BlockId;
use crate::storage::Device;
use crate::tensor::TensorRef;

/// Gathers of at least this many bytes are split across rayon's threads, as torch splits
/// its large copies: one thread rarely saturates memory bandwidth.
const PARALLEL_GATHER_BYTES: usize = 1 << 20;

impl PoolCore {
    /// Positions `layer` of sequence `id` holds: `(first, end)`.
    pub fn layer_span(&self, id: SeqId, layer: usize) -> Result<(usize, usize)> {
        let s = self.seq(id)?;
        Ok((
            s.tables[self.groups.group_of[layer]].start,
            s.layer_len[layer],
        ))
    }

    /// Gathers the positions sequence `id`'s `layer` holds into `k_out`, `v_out`
    /// (`[heads, >= n, head_dim]`) and returns `(first, n)`: positions `first..first + n`.
    pub fn gather(
        &self,
        id: SeqId,
        layer: i64,
        k_out: &TensorRef,
        v_out: &TensorRef,
    ) -> Result<(usize, usize)> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let (first, end) = self.layer_span(id, layer)?;
        let len = end - first;
        for (name, out) in [("k_out", k_out), ("v_out", v_out)] {
            let o = out.shape();
            if o.len() != 3 || o[0] != sh.num_kv_heads || o[1] < len || o[2] != sh.head_dim {
                return Err(KvError::Shape {
                    name,
                    got: o.to_vec(),
                    expected: format!("[{}, >= {len}, {}]", sh.num_kv_heads, sh.head_dim),
                });
            }
        }
        let blocks = &self.seq(id)?.tables[self.groups.group_of[layer]].blocks;
        let bytes = 2 * len * sh.num_kv_heads * sh.head_dim * self.storage.dtype().size();
        let on_host = self.device() == Device::Cpu;
        if !on_host || bytes < PARALLEL_GATHER_BYTES || rayon::current_num_threads() < 2 {
            self.read_positions(blocks, layer, first, len, k_out, v_out)?;
        } else {
            // Whole blocks per task, a few tasks per thread; each writes its own positions.
            let per_task = len.div_ceil(4 * rayon::current_num_threads());
            let chunk = per_task.div_ceil(sh.block_size) * sh.block_size;
            (0..len).into_par_iter().step_by(chunk).try_for_each(|t| {
                let n = chunk.min(len - t);
                let (k, v) = (k_out.slice(1, t, n), v_out.slice(1, t, n));
                self.read_positions(blocks, layer, first + t, n, &k, &v)
            })?;
        }
        Ok((first, len))
    }

    /// Reads positions `start..start + n` of `layer` through its group's block table into
    /// `[H, >= n, D]` outputs.
    pub(crate) fn read_positions(
        &self,
        blocks: &[BlockId],
        layer: usize,
        start: usize,
        n: usize,
        k_out: &TensorRef,
        v_out: &TensorRef,
    ) -> Result<()> {
        let t = self.paged_tensor(layer);
        self.storage
            .read_positions(t, blocks, start, n, k_out, v_out)
    }
}
