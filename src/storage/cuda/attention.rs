//! Paged attention on the device: `kvrs_paged_attention_*` for a batch of query rows,
//! with the semantics of [`crate::attention`] (the CPU core), against which the
//! simulated device checks it. Long histories are split across threads (flash-decoding)
//! and the splits merged by `kvrs_attention_merge_*`.

use super::gpu::Args;
use super::kernels::{attention_merge_kernel, kernel, Kernel};
use super::storage::CudaStorage;
use crate::attention::AttnOptions;
use crate::error::{KvError, Result};
use crate::layout::KvLayout;
use crate::storage::{PagedTensor, Storage};
use crate::tensor::{TensorMut, TensorRef};

/// Largest head_dim the kernel takes (`KVRS_MAX_HEAD_DIM` in `kernels/kvrs.cu`).
pub const MAX_HEAD_DIM: usize = 256;

/// Fewest positions one thread of the attention kernel reads when a history is split.
const MIN_CHUNK: usize = 64;

/// Threads the split aims to keep busy: enough to fill an H100 a few times over.
const TARGET_THREADS: usize = 1 << 17;

/// Most bytes of split results (the workspace the merge reads).
const MAX_WORKSPACE: usize = 256 << 20;

/// How one launch splits its rows' histories across threads.
struct SplitPlan {
    /// Positions per split.
    chunk: usize,
    /// Splits per row (1: no split, no workspace, no merge).
    splits: usize,
    /// Bytes of split results the merge reads.
    workspace: usize,
}

/// The split for `rows` of `q_heads` heads: every history longer than a chunk is split,
/// and chunks grow until the splits' results fit in [`MAX_WORKSPACE`] and a grid
/// dimension (65,535).
fn split_plan(rows: &[DeviceRow], q_heads: usize, head_dim: usize) -> SplitPlan {
    let lens = rows.iter().map(|r| (r[4] - r[3]).max(0) as usize);
    let longest = lens.clone().max().unwrap_or(0);
    let work = lens.sum::<usize>() * q_heads;
    let bytes = |splits: usize| rows.len() * splits * q_heads * (2 + head_dim) * 4;
    let mut chunk = work
        .div_ceil(TARGET_THREADS)
        .next_multiple_of(MIN_CHUNK)
        .max(MIN_CHUNK);
    loop {
        let splits = longest.div_ceil(chunk);
        if splits <= 1 {
            return SplitPlan {
                chunk: longest.max(1),
                splits: 1,
                workspace: 0,
            };
        }
        if bytes(splits) <= MAX_WORKSPACE && splits <= 65_535 {
            return SplitPlan {
                chunk,
                splits,
                workspace: bytes(splits),
            };
        }
        chunk *= 2;
    }
}

/// One query row for the kernel: `[token, offset of its block table in the tables,
/// position, first visible position, one past the last]`.
pub type DeviceRow = [i64; 5];

impl CudaStorage {
    /// Attention of `q` (`[tokens, q_heads, head_dim]` on this device, head_dim
    /// contiguous; the storage's dtype, or any float dtype over 8-bit storage) into `out`
    /// (q's shape and dtype, C-contiguous, on this device) over cache tensor `t`: each of
    /// `rows` reads its sequence's block table at its offset in `tables`. An fp8 storage
    /// multiplies its codes by `head_scales` (K's and V's, one per KV head); int8 by
    /// its own per-vector scales. `scale` and `opts` were validated by the caller.
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
        if sh.head_dim > MAX_HEAD_DIM {
            return Err(KvError::NotSupported(format!(
                "attention on a CUDA pool with head_dim={} (at most {MAX_HEAD_DIM})",
                sh.head_dim
            )));
        }
        if rows.is_empty() {
            return Ok(());
        }
        let qs = q.strides3();
        let q_heads = q.shape3()[1];
        let pack = |w: &mut Vec<u64>, words: &mut dyn Iterator<Item = u32>| {
            while let Some(a) = words.next() {
                w.push(a as u64 | (words.next().unwrap_or(0) as u64) << 32);
            }
        };
        let tables_at = 5 * rows.len();
        let sinks_at = tables_at + tables.len().div_ceil(2);
        let alibi_at = sinks_at + opts.sinks.map_or(0, |s| s.len().div_ceil(2));
        let k_scales_at = alibi_at + opts.alibi_slopes.map_or(0, |s| s.len().div_ceil(2));
        let v_scales_at = k_scales_at + head_scales[0].len().div_ceil(2);
        // What multiplies the codes: 0 nothing, 1 a scale per KV head (fp8, uploaded
        // below), 2 a scale per head vector (int8, this storage's own).
        let scale_mode = match (&self.scales, self.dtype().fp8()) {
            (Some(_), _) => 2,
            (None, Some(_)) => 1,
            (None, None) => 0,
        };
        let fill = |w: &mut Vec<u64>| {
            w.extend(rows.iter().flatten().map(|&x| x as u64));
            pack(w, &mut tables.iter().copied());
            for v in [opts.sinks, opts.alibi_slopes].into_iter().flatten() {
                pack(w, &mut v.iter().map(|x| x.to_bits()));
            }
            if scale_mode == 1 {
                for v in head_scales {
                    pack(w, &mut v.iter().map(|x| x.to_bits()));
                }
            }
        };
        let vector_scales = self
            .scales
            .as_ref()
            .map(|sc| sc.device_addr(sh.block_offset(t.index, 0) / sh.head_dim));
        let cache = self.device_addr(sh.block_offset(t.index, 0));
        let SplitPlan {
            chunk,
            splits,
            workspace,
        } = split_plan(rows, q_heads, sh.head_dim);
        self.with_upload_and_scratch(fill, workspace, |base, partial| {
            let at = |words: usize| base + 8 * words as u64;
            let args = Args::new()
                .u64(q.as_ptr() as u64)
                .i64(qs[0] as i64)
                .i64(qs[1] as i64)
                .u64(out.as_mut_ptr() as u64)
                .u64(cache)
                .u64(at(tables_at))
                .u64(at(0))
                .i32(q_heads as i32)
                .f32(scale)
                .f32(opts.softcap.unwrap_or(0.0))
                .u64(opts.sinks.map_or(0, |_| at(sinks_at)))
                .u64(opts.alibi_slopes.map_or(0, |_| at(alibi_at)))
                .i64(chunk as i64)
                .u64(if splits > 1 { partial } else { 0 })
                .i32(sh.block_size as i32)
                .i32(sh.num_kv_heads as i32)
                .i32(sh.head_dim as i32)
                .i32(i32::from(sh.layout == KvLayout::Hnd));
            let args = match (scale_mode, vector_scales) {
                (2, Some(p)) => args.u64(p).u64(p),
                (1, _) => args.u64(at(k_scales_at)).u64(at(v_scales_at)),
                _ => args.u64(0).u64(0),
            }
            .i32(scale_mode);
            let threads = (q_heads as u32).clamp(1, 1024);
            // SAFETY: the rows' positions are held by their tables (the pool built them),
            // q and out are device tensors of the checked shape and dtype, and the
            // workspace holds rows x splits x q_heads x (2 + head_dim) f32.
            unsafe {
                self.gpu().launch(
                    kernel(Kernel::Attention, q.dtype(), self.dtype())?,
                    [rows.len() as u32, splits as u32, 1],
                    [threads, 1, 1],
                    &args,
                    self.stream(),
                )?;
            }
            if splits == 1 {
                return Ok(());
            }
            let merge = Args::new()
                .u64(partial)
                .i32(splits as i32)
                .u64(at(0))
                .u64(out.as_mut_ptr() as u64)
                .i32(q_heads as i32)
                .u64(opts.sinks.map_or(0, |_| at(sinks_at)))
                .i32(sh.head_dim as i32);
            let threads = ((q_heads * sh.head_dim) as u32).clamp(32, 256);
            // SAFETY: the first launch wrote every split's results (stream order); out
            // holds rows' tokens x q_heads x head_dim.
            unsafe {
                self.gpu().launch(
                    attention_merge_kernel(q.dtype()),
                    [rows.len() as u32, 1, 1],
                    [threads, 1, 1],
                    &merge,
                    self.stream(),
                )
            }
        })
    }
}
