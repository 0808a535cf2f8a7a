//! Reading a sequence: the span a layer holds, and gathers of its positions into
//! contiguous K/V (split across rayon's threads when large).

use rayon::prelude::*;

use super::pool::{PoolCore, SeqId};
use crate::error::{check_index, KvError, Result};
use crate::layout::BlockId;
use crate::layout::Kv;
use crate::scales::multiply_heads;
use crate::storage::Device;
use crate::tensor::{check_disjoint, TensorMut};

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
        k_out: &mut TensorMut,
        v_out: &mut TensorMut,
    ) -> Result<(usize, usize)> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        let (first, end) = self.layer_span(id, layer)?;
        let len = end - first;
        for (name, out, d) in [
            ("k_out", &*k_out, sh.head_dim),
            ("v_out", &*v_out, sh.v_head_dim),
        ] {
            let o = out.shape();
            if o.len() != 3 || o[0] != sh.num_kv_heads || o[1] < len || o[2] != d {
                return Err(KvError::Shape {
                    name,
                    got: o.to_vec(),
                    expected: format!("[{}, >= {len}, {d}]", sh.num_kv_heads),
                });
            }
        }
        check_disjoint(("k_out", k_out), ("v_out", v_out))?;
        let blocks = &self.seq(id)?.tables[self.groups.group_of[layer]].blocks;
        let bytes =
            len * sh.num_kv_heads * (sh.head_dim + sh.v_head_dim) * self.storage.dtype().size();
        let on_host = self.device() == Device::Cpu;
        let parallel = on_host && bytes >= PARALLEL_GATHER_BYTES && crate::parallel::threads() >= 2;
        match (k_out.share(), v_out.share()) {
            (Some(k_shared), Some(v_shared)) if parallel => {
                // Whole blocks per task, a few tasks per thread; each writes its own
                // positions.
                let per_task = len.div_ceil(4 * crate::parallel::threads());
                let chunk = per_task.div_ceil(sh.block_size) * sh.block_size;
                crate::parallel::install(|| {
                    (0..len).into_par_iter().step_by(chunk).try_for_each(|t| {
                        let n = chunk.min(len - t);
                        // SAFETY: each task takes positions t..t + n of dimension 1, a range
                        // no other task takes; neither output addresses an element twice
                        // (`share`) and they do not overlap each other (`check_disjoint`).
                        let (mut k, mut v) =
                            unsafe { (k_shared.slice(1, t, n), v_shared.slice(1, t, n)) };
                        self.read_positions(blocks, layer, first + t, n, &mut k, &mut v)
                    })
                })?;
            }
            _ => self.read_positions(blocks, layer, first, len, k_out, v_out)?,
        }
        Ok((first, len))
    }

    /// The per-token scales of the positions sequence `id`'s `layer` holds (int8 pools):
    /// `(first, n, k, v)` with `k` and `v` row-major `[heads, n, chunks]`, `chunks` the
    /// scales per vector (`dim / scale_unit`: 1 when K and V have one head size).
    pub fn gather_scales(
        &self,
        id: SeqId,
        layer: i64,
    ) -> Result<(usize, usize, Vec<f32>, Vec<f32>)> {
        let sh = self.shape;
        let layer = check_index("layer", layer, sh.num_layers)?;
        if self.storage.row_scales().is_none() {
            return Err(KvError::NotSupported(format!(
                "a {} pool keeps no per-token scales (int8 does)",
                self.dtype()
            )));
        }
        let (first, end) = self.layer_span(id, layer)?;
        let (n, h, bs) = (end - first, sh.num_kv_heads, sh.block_size);
        let blocks = &self.seq(id)?.tables[self.groups.group_of[layer]].blocks;
        let tensor = self.tensor_of(layer);
        let chunks = [Kv::Key, Kv::Value].map(|kv| sh.dim(kv) / sh.scale_unit());
        let mut out = chunks.map(|c| vec![0f32; h * n * c]);
        // One block's run of positions at a time, [positions, heads, chunks], transposed
        // into the [heads, n, chunks] outputs (the scales may live on a device).
        let mut run = vec![0f32; bs * h * chunks[0].max(chunks[1])];
        for ((kv, dst), c) in [Kv::Key, Kv::Value].into_iter().zip(&mut out).zip(chunks) {
            let mut p = first;
            while p < end {
                let len = (bs - p % bs).min(end - p);
                let r = sh.positions(tensor, kv, blocks[p / bs], p % bs, len);
                let run = &mut run[..len * h * c];
                self.storage.read_row_scales(r, run)?;
                for (i, row) in run.chunks_exact(h * c).enumerate() {
                    for (head, x) in row.chunks_exact(c).enumerate() {
                        let at = (head * n + p - first + i) * c;
                        dst[at..at + c].copy_from_slice(x);
                    }
                }
                p += len;
            }
        }
        let [k, v] = out;
        Ok((first, n, k, v))
    }

    /// Reads positions `start..start + n` of `layer` through its group's block table into
    /// `[H, >= n, D]` outputs.
    pub(crate) fn read_positions(
        &self,
        blocks: &[BlockId],
        layer: usize,
        start: usize,
        n: usize,
        k_out: &mut TensorMut,
        v_out: &mut TensorMut,
    ) -> Result<()> {
        let t = self.paged_tensor(layer);
        self.storage
            .read_positions(t, blocks, start, n, k_out, v_out)?;
        for (mut out, kv) in [(k_out.reborrow(), Kv::Key), (v_out.reborrow(), Kv::Value)] {
            multiply_heads(
                self.storage.scaler(),
                &mut out.slice(1, 0, n),
                0,
                self.scales.heads(layer, kv),
            )?;
        }
        Ok(())
    }
}
