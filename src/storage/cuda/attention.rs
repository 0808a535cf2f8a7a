//! Paged attention on the device: `kvrs_paged_attention_*` for a batch of query rows
//! (decode tokens and extend/prefill chunks alike), with the semantics of
//! [`crate::attention`] (the CPU core), against which the simulated device checks it.
//! The launch follows an [`AttentionPlan`]: rows of one sequence share K/V tiles, long
//! histories are split across blocks (split-K) and the splits merged by
//! `kvrs_attention_merge_*`. Spans of many query rows per sequence (extend, chunked
//! prefill, verification) in float16 or bfloat16 with head sizes 64, 128 or 256 run on
//! the tensor cores (`kvrs_paged_attention_mma_*`, `kernels/attention_mma.cuh`), in a
//! launch of their own beside the CUDA-core kernel's for the other rows.

use super::attention_plan::{
    plan_mla, plan_mma, plan_spans, spans, wants_tensor_cores, AttentionPlan, PlanShape,
};
use super::gpu::Args;
use super::kernels::{
    attention_kernel, attention_merge_kernel, attention_mla_kernel, attention_mma_kernel,
    MLA_LATENT, MLA_ROPE, MLA_THREADS, MMA_THREADS,
};
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

/// A tensor-core attention kernel and what its launch takes.
struct TensorKernel {
    name: &'static str,
    /// Dynamic shared memory per block.
    shared: u32,
    threads: u32,
    /// The merge of its splits.
    merge: &'static str,
}

/// Appends `words` to `w`, two 32-bit words per 64-bit one.
fn pack(w: &mut Vec<u64>, words: impl IntoIterator<Item = u32>) {
    let mut words = words.into_iter();
    while let Some(a) = words.next() {
        w.push(a as u64 | (words.next().unwrap_or(0) as u64) << 32);
    }
}

impl CudaStorage {
    /// The latent (MLA) kernel for `q` over this storage of key and value sizes `dims`,
    /// or why it cannot serve them.
    fn latent_kernel(
        &self,
        q: &TensorRef,
        dims: [usize; 2],
        aligned: bool,
    ) -> Result<TensorKernel> {
        let Some((name, shared, merge)) = attention_mla_kernel(q.dtype(), self.dtype(), dims)
        else {
            return Err(KvError::NotSupported(format!(
                "latent (MLA) attention on {} over a {} pool of {}-element latents and \
                 {}-element rotary parts: the CUDA kernel takes float16 or bfloat16 pools of \
                 {MLA_LATENT}-element latents and {MLA_ROPE}-element rotary parts \
                 (DeepSeek-V2/V3, Kimi K2) with queries of the pool's dtype; attend on the host \
                 (device='cpu') for other shapes",
                self.device(),
                self.dtype(),
                dims[0],
                dims[1]
            )));
        };
        if !aligned {
            return Err(KvError::InvalidArgument {
                name: "q",
                value: format!("strides {:?}", q.strides3()),
                reason: "latent attention on a CUDA pool takes q and out with 16-byte aligned \
                         rows (strides multiples of 8 elements: q.contiguous())"
                    .into(),
            });
        }
        Ok(TensorKernel {
            name,
            shared,
            threads: MLA_THREADS,
            merge,
        })
    }

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
        let dims = [sh.head_dim, sh.v_head_dim];
        let latent = opts.latent;
        let qs = q.strides3();
        // q's rows and out's element pairs aligned for the tensor-core kernels' 16-byte
        // copies and 4-byte stores.
        let aligned = (q.as_ptr() as usize).is_multiple_of(16)
            && qs[0] % 8 == 0
            && qs[1] % 8 == 0
            && (out.as_mut_ptr() as usize).is_multiple_of(4);
        let out_ptr = out.as_mut_ptr() as u64;
        // The CUDA-core kernel (none for latent attention), and the tensor-core one the
        // spans of many query rows go to (all rows, for latent attention).
        let (core_name, tensor_kernel) = if latent {
            (None, Some(self.latent_kernel(q, dims, aligned)?))
        } else {
            let mma = attention_mma_kernel(q.dtype(), self.dtype(), dims)
                .filter(|_| aligned)
                .map(|(name, shared)| TensorKernel {
                    name,
                    shared,
                    threads: MMA_THREADS,
                    merge: attention_merge_kernel(q.dtype()),
                });
            (Some(attention_kernel(q.dtype(), self.dtype(), dims)?), mma)
        };
        if rows.is_empty() {
            return Ok(());
        }
        let q_heads = q.shape3()[1];
        let group = q_heads / sh.num_kv_heads;
        // Elements per output row: the values', or the latent's.
        let out_dim = out.shape3()[2];
        let shape = PlanShape {
            q_heads,
            kv_heads: sh.num_kv_heads,
            head_dim: sh.head_dim,
            v_head_dim: out_dim,
            elem_size: self.dtype().size(),
            sm_count: self.gpu().sm_count(),
        };
        let (tensor_spans, core_spans): (Vec<_>, Vec<_>) = spans(rows)
            .into_iter()
            .partition(|s| latent || tensor_kernel.is_some() && wants_tensor_cores(s.len(), group));
        let core = (!core_spans.is_empty()).then(|| plan_spans(rows, &core_spans, &shape, 0));
        let core_partial = core.as_ref().map_or(0, |p| p.partial_rows);
        let tensor = (!tensor_spans.is_empty()).then(|| {
            if latent {
                plan_mla(rows, &tensor_spans, &shape, core_partial)
            } else {
                plan_mma(rows, &tensor_spans, &shape, core_partial)
            }
        });
        let plans = [core.as_ref(), tensor.as_ref()];
        let items = |p: Option<&AttentionPlan>| p.map_or(0, |p| p.items.len());
        let merges: usize = plans.iter().flatten().map(|p| p.merges.len()).sum();
        let partial_rows: usize = plans.iter().flatten().map(|p| p.partial_rows).sum();
        // The upload, in 64-bit words: rows, items (CUDA cores, then tensor cores),
        // merges, tables, sinks, ALiBi slopes, fp8 head scales.
        let items_at = 5 * rows.len();
        let mma_items_at = items_at + 4 * items(core.as_ref());
        let merges_at = mma_items_at + 4 * items(tensor.as_ref());
        let tables_at = merges_at + 2 * merges;
        let sinks_at = tables_at + tables.len().div_ceil(2);
        let alibi_at = sinks_at + opts.sinks.map_or(0, |s| s.len().div_ceil(2));
        let k_scales_at = alibi_at + opts.alibi_slopes.map_or(0, |s| s.len().div_ceil(2));
        let v_scales_at = k_scales_at + head_scales[0].len().div_ceil(2);
        let fp8 = self.dtype().fp8().is_some();
        let fill = |w: &mut Vec<u64>| {
            w.extend(rows.iter().flatten().map(|&x| x as u64));
            for p in plans.iter().flatten() {
                w.extend(p.items.iter().flatten().map(|&x| x as u64));
            }
            pack(
                w,
                plans
                    .iter()
                    .flatten()
                    .flat_map(|p| p.merges.iter().flatten().map(|&x| x as u32)),
            );
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
        let o_bytes = partial_rows * q_heads * out_dim * 4;
        let workspace = partial_rows * q_heads * (out_dim + 2) * 4;
        self.with_upload_and_scratch(fill, workspace, |base, partial| {
            let at = |words: usize| base + 8 * words as u64;
            let sinks = opts.sinks.map_or(0, |_| at(sinks_at));
            let alibi = opts.alibi_slopes.map_or(0, |_| at(alibi_at));
            let (part_o, part_ml) = match partial_rows {
                0 => (0, 0),
                _ => (partial, partial + o_bytes as u64),
            };
            // The arguments both attention kernels begin with, for their items at word
            // `items` of the upload.
            let common = |items: usize| {
                Args::new()
                    .u64(q.as_ptr() as u64)
                    .i64(qs[0] as i64)
                    .i64(qs[1] as i64)
                    .u64(out_ptr)
                    .u64(cache)
                    .u64(at(tables_at))
                    .u64(at(0))
                    .u64(at(items))
                    .i32(q_heads as i32)
                    .i32(group as i32)
                    .f32(scale)
                    .f32(opts.softcap.unwrap_or(0.0))
                    .u64(sinks)
                    .u64(alibi)
                    .u64(part_o)
                    .u64(part_ml)
                    .i32(sh.block_size as i32)
                    .i32(sh.num_kv_heads as i32)
            };
            if let (Some(p), Some(k)) = (&tensor, &tensor_kernel) {
                let args = common(mma_items_at)
                    .i32(i32::from(sh.layout == KvLayout::Hnd))
                    .i32(p.hsb as i32);
                // SAFETY: as for the CUDA-core kernel below; q's rows are 16-byte
                // aligned and out's element pairs 4-byte aligned (checked above).
                unsafe {
                    self.gpu().launch_shared(
                        k.name,
                        p.grid(sh.num_kv_heads),
                        [k.threads, 1, 1],
                        k.shared,
                        &args,
                        self.stream(),
                    )?;
                }
            }
            let (k_scales, v_scales) = match vector_scales {
                Some(s) => (s, s),
                None if fp8 => (at(k_scales_at), at(v_scales_at)),
                None => (0, 0),
            };
            if let (Some(p), Some(name)) = (&core, core_name) {
                let args = common(items_at)
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
            }
            if merges == 0 {
                return Ok(());
            }
            let merge = Args::new()
                .u64(part_o)
                .u64(part_ml)
                .u64(at(merges_at))
                .u64(at(0))
                .u64(out_ptr)
                .i32(q_heads as i32)
                .u64(sinks)
                .i32(out_dim as i32);
            let heads_per_block = (MERGE_THREADS / 32) as usize;
            // SAFETY: the launches above wrote every split's results (stream order); out
            // holds the rows' tokens x q_heads x v_head_dim.
            unsafe {
                self.gpu().launch(
                    tensor_kernel
                        .as_ref()
                        .filter(|_| latent)
                        .map_or(attention_merge_kernel(q.dtype()), |k| k.merge),
                    [merges as u32, q_heads.div_ceil(heads_per_block) as u32, 1],
                    [MERGE_THREADS, 1, 1],
                    &merge,
                    self.stream(),
                )
            }
        })
    }
}
