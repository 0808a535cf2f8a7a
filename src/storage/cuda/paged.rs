//! The paged pool's bulk operations on the device, one launch each: the scatter of a
//! step's tokens by slot into one or every layer (`kvrs_scatter_*`; int8 computes each
//! vector's scale), the gather of a block table's positions (`kvrs_gather_*`) and
//! whole-block copies (`kvrs_copy_blocks`, codes and int8 scales alike). Their small
//! arrays are launch words ([`CudaStorage::launch_words`]); the host splits each slot
//! into block and offset and picks the widest vector access every address allows.

use rustc_hash::FxHashSet;

use super::gpu::{Args, DevicePtr, THREADS};
use super::kernels::{gather_kernel, scatter_kernel, COPY_BLOCKS};
use super::storage::CudaStorage;
use crate::error::Result;
use crate::layout::{BlockId, KvLayout, PagedShape};
use crate::storage::{PagedTensor, Storage};
use crate::tensor::{TensorMut, TensorRef};

/// Most thread blocks per layer of the row kernels: past that, threads stride over
/// tokens (several in flight each).
const MAX_ROW_BLOCKS: usize = 1024;

/// Bytes one thread block of the block copies moves: 256 threads x 16 bytes x 4 in flight.
const COPY_CHUNK: usize = 16 << 10;

/// The launch word of a slot: block << 32 | offset, or all ones for -1 (skip).
fn split_slot(slot: i64, block_size: usize) -> u64 {
    if slot < 0 {
        return u64::MAX;
    }
    let (b, off) = (
        slot as u64 / block_size as u64,
        slot as u64 % block_size as u64,
    );
    b << 32 | off
}

/// The widest vector (in elements, a power of two) of `bytes`-byte elements, at most 16
/// bytes, that divides `head_dim` and every stride and aligns every address.
fn vector_width(bytes: usize, head_dim: usize, strides: &[isize], addrs: &[(u64, usize)]) -> u32 {
    let mut e = 16 / bytes.max(1);
    while e > 1 {
        let fits = head_dim.is_multiple_of(e)
            && strides.iter().all(|&s| s.unsigned_abs().is_multiple_of(e))
            && addrs
                .iter()
                .all(|&(a, size)| a.is_multiple_of((e * size) as u64));
        if fits {
            break;
        }
        e /= 2;
    }
    e as u32
}

/// Threads (x: vectors of a row, y: rows) and blocks (at most [`MAX_ROW_BLOCKS`] per
/// layer) for `n` rows of `row` vectors, over `layers` layers.
fn row_launch(row: usize, n: usize, layers: usize) -> ([u32; 3], [u32; 3]) {
    let x = row.clamp(1, THREADS as usize);
    let y = (THREADS as usize / x).max(1);
    let blocks = n.div_ceil(y).clamp(1, MAX_ROW_BLOCKS);
    ([blocks as u32, layers as u32, 1], [x as u32, y as u32, 1])
}

/// The pool geometry arguments that end every row kernel's parameters before `vec`.
fn geometry(args: Args, sh: &PagedShape) -> Args {
    args.i32(sh.block_size as i32)
        .i32(sh.num_kv_heads as i32)
        .i32(sh.head_dim as i32)
        .i32(i32::from(sh.layout == KvLayout::Hnd))
}

/// One layer of a multi-layer scatter: its cache tensor and its slots.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScatterLayer<'a> {
    /// The layer's cache tensor.
    pub tensor: usize,
    /// Its slots, one per token (-1 skips).
    pub slots: &'a [i64],
}

impl CudaStorage {
    /// Whether the scatter kernel can write `k`, `v` into blocks of `shape`: both on this
    /// device, of one dtype, with `head_dim` contiguous, K and V of one head size
    /// (otherwise the region copies do it).
    pub(super) fn scatters(
        &self,
        shape: &PagedShape,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<bool> {
        let local = self.is_local("k", k.device())? && self.is_local("v", v.device())?;
        Ok(local
            && super::storage::one_head_size(shape)
            && k.strides3()[2] == 1
            && v.strides3()[2] == 1
            && k.dtype() == v.dtype()
            && !k.dtype().is_quantized())
    }

    /// Launches the scatter of `n` token rows into `layers` in one launch: layer `l`'s
    /// rows are `k`, `v` (`[n, H, D]`, the first layer's) advanced by `layer_strides`
    /// elements per layer. The caller checked the slots (`check_slots`) and the inputs.
    pub(super) fn scatter(
        &self,
        sh: PagedShape,
        layers: &[ScatterLayer<'_>],
        k: &TensorRef,
        v: &TensorRef,
        layer_strides: [isize; 2],
    ) -> Result<()> {
        let n = k.shape3()[0];
        if n == 0 || layers.is_empty() {
            return Ok(());
        }
        let q8 = self.scales.is_some();
        let rec = if q8 { 3 } else { 2 };
        // Per layer: cache base, where its slots start, (int8: its scales); then each
        // distinct slot row once.
        let mut words = vec![0u64; rec * layers.len()];
        let mut rows: Vec<(*const i64, usize)> = Vec::new();
        for (l, layer) in layers.iter().enumerate() {
            let key = (layer.slots.as_ptr(), layer.slots.len());
            let row = match rows.iter().position(|&r| r == key) {
                Some(r) => r,
                None => {
                    rows.push(key);
                    words.extend(layer.slots.iter().map(|&s| split_slot(s, sh.block_size)));
                    rows.len() - 1
                }
            };
            let base = sh.block_offset(layer.tensor, 0);
            words[rec * l] = self.device_addr(base);
            words[rec * l + 1] = (rec * layers.len() + row * n) as u64;
            if let Some(sc) = &self.scales {
                words[rec * l + 2] = sc.device_addr(base / self.head_dim);
            }
        }
        let (ks, vs) = (k.strides3(), v.strides3());
        let (input, store) = (k.dtype().size(), self.dtype().size());
        let wide = input.max(store);
        let mut addrs: Vec<(u64, usize)> =
            vec![(k.as_ptr() as u64, input), (v.as_ptr() as u64, input)];
        addrs.extend((0..layers.len()).map(|l| (words[rec * l], store)));
        let strides = [
            ks[0],
            ks[1],
            vs[0],
            vs[1],
            layer_strides[0],
            layer_strides[1],
        ];
        let vec = if q8 {
            1
        } else {
            vector_width(wide, sh.head_dim, &strides, &addrs)
        };
        let args = Args::new()
            .u64(k.as_ptr() as DevicePtr)
            .u64(v.as_ptr() as DevicePtr)
            .i64(layer_strides[0] as i64)
            .i64(layer_strides[1] as i64)
            .i64(ks[0] as i64)
            .i64(ks[1] as i64)
            .i64(vs[0] as i64)
            .i64(vs[1] as i64)
            .i32(n as i32);
        let args = geometry(args, &sh).i32(vec as i32);
        let row = if q8 {
            sh.num_kv_heads
        } else {
            sh.num_kv_heads * sh.head_dim / vec as usize
        };
        let (grid, block) = row_launch(row, n, layers.len());
        // The slots lie in this storage (`check_slots`) and every layer's rows are
        // [n, H, D] device tensors (`check_rows`), both checked by the callers.
        self.launch_words(
            scatter_kernel(k.dtype(), self.dtype())?,
            words,
            args,
            grid,
            block,
        )
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
        let bs = sh.block_size;
        let cache = self.device_addr(sh.block_offset(t.index, 0));
        let (ks, vs) = (k_out.strides3(), v_out.strides3());
        let (ko, vo) = (k_out.as_mut_ptr() as u64, v_out.as_mut_ptr() as u64);
        // The int32 table from the block of `start` on, two entries per word.
        let first = start / bs;
        let table = &blocks[first..=(start + n - 1) / bs];
        let words = table
            .chunks(2)
            .map(|c| c[0] as u64 | (c.get(1).copied().unwrap_or(0) as u64) << 32)
            .collect();
        let size = self.dtype().size();
        let vec = vector_width(
            size,
            sh.head_dim,
            &[ks[0], ks[1], vs[0], vs[1]],
            &[(cache, size), (ko, size), (vo, size)],
        );
        let args = Args::new()
            .u64(cache)
            .i32((start - first * bs) as i32)
            .i32(n as i32)
            .u64(ko)
            .u64(vo)
            .i64(ks[0] as i64)
            .i64(ks[1] as i64)
            .i64(vs[0] as i64)
            .i64(vs[1] as i64);
        let args = geometry(args, &sh).i32(vec as i32);
        let (grid, block) = row_launch(sh.num_kv_heads * sh.head_dim / vec as usize, n, 1);
        // The table holds the positions, in this storage (`check_positions`), and the
        // outputs are [H, >= n, D] device tensors (`check_outputs`), both checked by the
        // caller.
        self.launch_words(gather_kernel(self.dtype()), words, args, grid, block)
    }

    /// Launches the copy of whole blocks `pairs` (src, dst) of `block_bytes` bytes in
    /// each tensor starting at `bases`: one launch per run of pairs in which no block is
    /// both a source and a destination (pairs apply in order, as on the host).
    pub(super) fn launch_copy_blocks(
        &self,
        bases: &[DevicePtr],
        pairs: &[(BlockId, BlockId)],
        block_bytes: usize,
    ) -> Result<()> {
        let vec = [16usize, 8, 4]
            .into_iter()
            .find(|&b| {
                block_bytes.is_multiple_of(b) && bases.iter().all(|&a| a.is_multiple_of(b as u64))
            })
            .expect("blocks of whole 32-bit words at 4-byte aligned tensors");
        let chunk = COPY_CHUNK.min(block_bytes.next_multiple_of(vec));
        let chunks = block_bytes.div_ceil(chunk) as u32;
        let launch = |run: &[(BlockId, BlockId)]| {
            let mut words = bases.to_vec();
            words.extend(run.iter().map(|&(s, d)| s as u64 | (d as u64) << 32));
            let args = Args::new()
                .i64(block_bytes as i64)
                .i64(chunk as i64)
                .i32(vec as i32);
            let grid = [run.len() as u32, bases.len() as u32, chunks];
            // The blocks lie inside every tensor (`check_blocks`, by the callers).
            self.launch_words(COPY_BLOCKS, words, args, grid, [THREADS, 1, 1])
        };
        let (mut sources, mut targets) = (FxHashSet::default(), FxHashSet::default());
        let mut from = 0;
        for (i, &(s, d)) in pairs.iter().enumerate() {
            if targets.contains(&s) || sources.contains(&d) || targets.contains(&d) {
                launch(&pairs[from..i])?;
                from = i;
                sources.clear();
                targets.clear();
            }
            sources.insert(s);
            targets.insert(d);
        }
        launch(&pairs[from..])
    }
}
