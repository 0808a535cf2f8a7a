//! Paged attention on the device: `kvrs_paged_attention_*` for a batch of query rows
//! (decode tokens and extend/prefill chunks alike), with the semantics of
//! [`crate::attention`] (the CPU core), against which the simulated device checks it.
//! The launch follows an [`AttentionPlan`]: rows of one sequence share K/V tiles, long
//! histories are split across blocks (split-K) and the splits merged by
//! `kvrs_attention_merge_*`.

use super::attention_plan::{plan, AttentionPlan, PlanShape};
use super::gpu::Args;
use super::kernels::{attention_kernel, attention_merge_kernel};
use super::storage::CudaStorage;
use crate::attention::AttnOptions;
use crate::error::{KvError, Result};
use crate::layout::KvLayout;
use crate::storage::{PagedTensor, Storage};
use crate::tensor::{TensorMut, TensorRef};

/// One query row for the kernel: `[token, offset of its block table in the tables,
/// position, first visible position, one past the last]`.
pub type DeviceRow = [i64; 5];

/// Threads per block of the merge (a warp per query head).
const MERGE_THREADS: u32 = 128;

/// Appends `words` to `w`, two 32-bit words per 64-bit one.
fn pack(w: &mut Vec<u64>, words: impl IntoIterator<Item = u32>) {
    let mut words = words.into_iter();
    while let Some(a) = words.next() {
        w.push(a as u64 | (words.next().unwrap_or(0) as u64) << 32);
    }
}

impl CudaStorage {
    /// Attention of `q` (`[tokens, q_heads, head_dim]` on this device, head_dim
    /// contiguous; the storage's dtype, or any float dtype over 8-bit storage) into `out`
    /// (`[tokens, q_heads, v_head_dim]`, q's dtype, C-contiguous, on this device) over cache tensor `t`: each of
    /// `rows` reads its sequence's block table at its offset in `tables`; the rows of one
    /// sequence are consecutive. An fp8 storage multiplies its codes by `head_scales`
    /// (K's and V's, one per KV head); int8 by its own per-vector scales. `scale` and
    /// `opts` were validated by the caller.
    ///
    /// Crate-private: the kernel trusts `rows` and `tables` (tokens inside `q` and `out`,
    /// positions held by tables of this storage's blocks), which only the pool builds.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn paged_attention(
        &self,
        t: PagedTensor,
        q: &TensorRef,
        out: &mut TensorMut,
        tables: &[u32],
        rows: &[DeviceRow],
        scale: f32,
        opts: &AttnOptions<'_>,
        head_scales: [&[f32]; 2],
    ) -> Result<()> {
        for (name, device, dtype) in [
            ("q", q.device(), q.dtype()),
            ("out", out.device(), out.dtype()),
        ] {
            if !self.is_local(name, device)? {
                return Err(KvError::Device(format!(
                    "{name} is a host tensor; attention over a pool on {} takes tensors on that device",
                    self.device()
                )));
            }
            let eight_bit = self.dtype().is_quantized();
            if (!eight_bit && dtype != self.dtype()) || dtype != q.dtype() {
                return Err(KvError::InvalidArgument {
                    name,
                    value: dtype.to_string(),
                    reason: format!(
                        "must have the pool's dtype ({}) on a CUDA pool",
                        self.dtype()
                    ),
                });
            }
        }
        let sh = t.shape;
        if self.scales.is_some() && sh.head_dim != sh.v_head_dim {
            return Err(KvError::NotSupported(format!(
                "attention over int8 storage on {} with v_head_dim={} beside head_dim={}: its \
                 scales cover {}-element chunks of a row, and the CUDA kernel applies one scale \
                 per row; store the cache as fp8_e4m3, bfloat16 or float16, or attend on the \
                 host (device='cpu')",
                self.device(),
                sh.v_head_dim,
                sh.head_dim,
                sh.scale_unit()
            )));
        }
        let name = attention_kernel(q.dtype(), self.dtype(), [sh.head_dim, sh.v_head_dim])?;
        if rows.is_empty() {
            return Ok(());
        }
        let qs = q.strides3();
        let q_heads = q.shape3()[1];
        let shape = PlanShape {
            q_heads,
            kv_heads: sh.num_kv_heads,
            head_dim: sh.head_dim,
            v_head_dim: sh.v_head_dim,
            elem_size: self.dtype().size(),
            sm_count: self.gpu().sm_count(),
        };
        let p: AttentionPlan = plan(rows, &shape);
        // The upload, in 64-bit words: rows, items, merges, tables, sinks, ALiBi slopes,
        // fp8 head scales.
        let items_at = 5 * rows.len();
        let merges_at = items_at + 4 * p.items.len();
        let tables_at = merges_at + 2 * p.merges.len();
        let sinks_at = tables_at + tables.len().div_ceil(2);
        let alibi_at = sinks_at + opts.sinks.map_or(0, |s| s.len().div_ceil(2));
        let k_scales_at = alibi_at + opts.alibi_slopes.map_or(0, |s| s.len().div_ceil(2));
        let v_scales_at = k_scales_at + head_scales[0].len().div_ceil(2);
        let fp8 = self.dtype().fp8().is_some();
        let fill = |w: &mut Vec<u64>| {
            w.extend(rows.iter().flatten().map(|&x| x as u64));
            w.extend(p.items.iter().flatten().map(|&x| x as u64));
            pack(w, p.merges.iter().flatten().map(|&x| x as u32));
            pack(w, tables.iter().copied());
            for v in [opts.sinks, opts.alibi_slopes].into_iter().flatten() {
                pack(w, v.iter().map(|x| x.to_bits()));
            }
            if fp8 {
                for v in head_scales {
                    pack(w, v.iter().map(|x| x.to_bits()));
                }
            }
        };
        let vector_scales = self
            .scales
            .as_ref()
            .map(|sc| sc.device_addr(sh.block_offset(t.index, 0) / sh.scale_unit()));
        let cache = self.device_addr(sh.block_offset(t.index, 0));
        let o_bytes = p.partial_rows * q_heads * sh.v_head_dim * 4;
        self.with_upload_and_scratch(fill, p.workspace(&shape), |base, partial| {
            let at = |words: usize| base + 8 * words as u64;
            let sinks = opts.sinks.map_or(0, |_| at(sinks_at));
            let (part_o, part_ml) = match p.partial_rows {
                0 => (0, 0),
                _ => (partial, partial + o_bytes as u64),
            };
            let (k_scales, v_scales) = match vector_scales {
                Some(s) => (s, s),
                None if fp8 => (at(k_scales_at), at(v_scales_at)),
                None => (0, 0),
            };
            let args = Args::new()
                .u64(q.as_ptr() as u64)
                .i64(qs[0] as i64)
                .i64(qs[1] as i64)
                .u64(out.as_mut_ptr() as u64)
                .u64(cache)
                .u64(at(tables_at))
                .u64(at(0))
                .u64(at(items_at))
                .i32(q_heads as i32)
                .i32((q_heads / sh.num_kv_heads) as i32)
                .f32(scale)
                .f32(opts.softcap.unwrap_or(0.0))
                .u64(sinks)
                .u64(opts.alibi_slopes.map_or(0, |_| at(alibi_at)))
                .u64(part_o)
                .u64(part_ml)
                .i32(sh.block_size as i32)
                .i32(sh.num_kv_heads as i32)
                .i32(sh.head_dim as i32)
                .i32(sh.v_head_dim as i32)
                .i32(i32::from(sh.layout == KvLayout::Hnd))
                .u64(k_scales)
                .u64(v_scales)
                .i32(p.tile_rows as i32)
                .i32(p.hsb as i32)
                .i32(p.wpr as i32);
            // SAFETY: the rows' positions are held by their tables (the pool built them),
            // q and out are device tensors of the checked shape and dtype, the items and
            // merges come from the plan of these rows, and the workspace holds its
            // partial rows.
            unsafe {
                self.gpu().launch(
                    name,
                    p.grid(sh.num_kv_heads),
                    [32 * p.warps as u32, 1, 1],
                    &args,
                    self.stream(),
                )?;
            }
            if p.merges.is_empty() {
                return Ok(());
            }
            let merge = Args::new()
                .u64(part_o)
                .u64(part_ml)
                .u64(at(merges_at))
                .u64(at(0))
                .u64(out.as_mut_ptr() as u64)
                .i32(q_heads as i32)
                .u64(sinks)
                .i32(sh.v_head_dim as i32);
            let heads_per_block = (MERGE_THREADS / 32) as usize;
            // SAFETY: the first launch wrote every split's results (stream order); out
            // holds the rows' tokens x q_heads x v_head_dim.
            unsafe {
                self.gpu().launch(
                    attention_merge_kernel(q.dtype()),
                    [
                        p.merges.len() as u32,
                        q_heads.div_ceil(heads_per_block) as u32,
                        1,
                    ],
                    [MERGE_THREADS, 1, 1],
                    &merge,
                    self.stream(),
                )
            }
        })
    }
}
