//! The launch plan of the paged attention kernels (`kvrs_paged_attention_*`,
//! `kvrs_attention_merge_*` in `kernels/kvrs.cu`), made on the host from the query rows:
//! rows grouped into tiles (consecutive rows of one sequence share every K/V load), long
//! tiles split into chunks (split-K) so that the device's SMs are all busy, and the
//! splits' rows listed for the merge. Spans of many query rows per sequence (extend,
//! prefill) may be planned for the tensor-core kernel (`kvrs_paged_attention_mma_*`) and
//! the rest for the CUDA-core one, in two plans whose partial rows do not overlap.

use std::ops::Range;

use super::attention::DeviceRow;
use super::kernels::{ATTENTION_HEAD_DIMS, MLA_THREADS, MMA_BLOCK_ROWS, MMA_THREADS};

/// Blocks per SM the split aims at: as many 128-thread blocks as fit at once (the
/// fixed-head-size kernels are held to 128 registers), so that loads of one block overlap
/// another's arithmetic in a single wave.
const BLOCKS_PER_SM: usize = 4;

/// Blocks per SM the tensor-core kernel's split aims at (128 threads, 40-96 KB of
/// shared memory each: two fit on an H100 SM at every head size).
const MMA_BLOCKS_PER_SM: usize = 2;

/// Blocks per SM the latent (MLA) kernel's split aims at (256 threads, about 150 KB of
/// shared memory: one per SM).
const MLA_BLOCKS_PER_SM: usize = 1;

/// Fewest positions of a split (shorter chunks cost more in partial results and merge
/// than they gain in parallelism).
const MIN_CHUNK: usize = 256;

/// Chunks are multiples of this many positions (every kernel's tile divides it).
const CHUNK_ALIGN: usize = 128;

/// Most splits of one row (`KVRS_MAX_SPLITS` in `kernels/kvrs.cu`: the merge keeps four
/// per lane).
const MAX_SPLITS: usize = 128;

/// Most bytes of split results (the workspace the merge reads).
const MAX_WORKSPACE: usize = 256 << 20;

/// Most row slots (warps of distinct work) per block (`7 * ...` merge scratch in the
/// kernel: at most 8 warps).
const MAX_SLOTS: usize = 8;

/// Warps per block at least: the kernel reads a tile's page offsets with one thread per
/// position (tiles have at most 128 positions).
const MIN_WARPS: usize = 4;

/// What the plan depends on besides the rows.
#[derive(Clone, Copy, Debug)]
pub struct PlanShape {
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (the query heads' groups).
    pub kv_heads: usize,
    /// Elements per key head vector.
    pub head_dim: usize,
    /// Elements per value head vector (and per output row).
    pub v_head_dim: usize,
    /// Bytes per stored element.
    pub elem_size: usize,
    /// The device's streaming multiprocessors.
    pub sm_count: usize,
}

/// One launch of the attention kernel and, with splits, of the merge.
#[derive(Debug, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Work items: `(first row | rows << 32, first position, end position, first partial
    /// row or -1)`; one block per item and KV head (and head chunk).
    pub items: Vec<[i64; 4]>,
    /// Rows the merge combines: `(row, first partial row, splits, stride)`.
    pub merges: Vec<[i32; 4]>,
    /// Partial rows (each `q_heads` states of `v_head_dim + 2` floats).
    pub partial_rows: usize,
    /// Query rows per item at most (the block's row slots are `tile_rows * hsb`).
    pub tile_rows: usize,
    /// Head slots per block (each `heads_per_thread` query heads of a group); in a
    /// tensor-core plan, the query heads of a block (`hpb`: its packed rows are
    /// `tile_rows` tokens times these heads).
    pub hsb: usize,
    /// Blocks per KV head (head slots beyond `hsb` go to further blocks).
    pub head_chunks: usize,
    /// Warps per row slot (each a share of every tile's positions).
    pub wpr: usize,
    /// Warps per block.
    pub warps: usize,
}

impl AttentionPlan {
    /// The attention kernel's grid.
    pub fn grid(&self, kv_heads: usize) -> [u32; 3] {
        [
            self.items.len() as u32,
            (kv_heads * self.head_chunks) as u32,
            1,
        ]
    }
}

/// Query heads one thread holds (`AttnShape::HPT` in `kernels/kvrs.cu`) in the kernel for
/// keys of `head_dim` and values of `v_head_dim` elements: 32 floats of q and as many of
/// accumulator per thread.
pub fn heads_per_thread(head_dim: usize, v_head_dim: usize, elem_size: usize) -> usize {
    let per_lane = if head_dim == v_head_dim && ATTENTION_HEAD_DIMS.contains(&head_dim) {
        let pieces = head_dim * elem_size / 16;
        head_dim / pieces.min(32)
    } else {
        8
    };
    if per_lane >= 8 {
        32 / per_lane
    } else {
        4
    }
}

/// The spans of `rows`: runs of consecutive rows of one sequence (one table offset).
pub fn spans(rows: &[DeviceRow]) -> Vec<Range<usize>> {
    let mut spans: Vec<Range<usize>> = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        match spans.last_mut() {
            Some(s) if rows[s.start][1] == row[1] => s.end = r + 1,
            _ => spans.push(r..r + 1),
        }
    }
    spans
}

/// The CUDA-core kernel's plan for the rows of `spans` (of `rows`; their indices stay
/// those of `rows`), its partial rows numbered from `partial_base`.
pub fn plan_spans(
    rows: &[DeviceRow],
    spans: &[Range<usize>],
    shape: &PlanShape,
    partial_base: usize,
) -> AttentionPlan {
    let group = shape.q_heads / shape.kv_heads.max(1);
    let head_slots = group.div_ceil(heads_per_thread(
        shape.head_dim,
        shape.v_head_dim,
        shape.elem_size,
    ));
    let hsb = head_slots.clamp(1, MAX_SLOTS);
    let head_chunks = head_slots.div_ceil(hsb).max(1);
    let extend = spans.iter().any(|s| s.len() > 1);
    let tile_rows = if extend { (MAX_SLOTS / hsb).max(1) } else { 1 };
    let slots = tile_rows * hsb;
    let wpr = if tile_rows == 1 {
        (MIN_WARPS / slots).max(1)
    } else {
        1
    };
    let blocks = BLOCKS_PER_SM * shape.sm_count.max(1);
    let split = tile(
        rows,
        spans,
        tile_rows,
        shape.kv_heads * head_chunks,
        blocks,
        shape,
        partial_base,
    );
    AttentionPlan {
        items: split.items,
        merges: split.merges,
        partial_rows: split.partial_rows,
        tile_rows,
        hsb,
        head_chunks,
        wpr,
        warps: (slots * wpr).max(MIN_WARPS),
    }
}

/// The tensor-core kernel's plan (`kvrs_paged_attention_mma_*`) for the rows of `spans`
/// (of `rows`), its partial rows numbered from `partial_base`: a block takes
/// [`MMA_BLOCK_ROWS`] packed rows, the `hsb` query heads of a KV head (all of its group, or
/// a chunk of a larger one) of `tile_rows` query tokens.
pub fn plan_mma(
    rows: &[DeviceRow],
    spans: &[Range<usize>],
    shape: &PlanShape,
    partial_base: usize,
) -> AttentionPlan {
    plan_tensor(rows, spans, shape, partial_base, MMA_BLOCKS_PER_SM)
}

/// A plan of [`MMA_BLOCK_ROWS`] packed rows per block, aiming at `blocks_per_sm` blocks
/// per SM.
fn plan_tensor(
    rows: &[DeviceRow],
    spans: &[Range<usize>],
    shape: &PlanShape,
    partial_base: usize,
    blocks_per_sm: usize,
) -> AttentionPlan {
    let group = (shape.q_heads / shape.kv_heads.max(1)).max(1);
    let hpb = group.min(MMA_BLOCK_ROWS);
    let head_chunks = group.div_ceil(hpb);
    let tile_rows = MMA_BLOCK_ROWS / hpb;
    let blocks = blocks_per_sm * shape.sm_count.max(1);
    let mut split = tile(
        rows,
        spans,
        tile_rows,
        shape.kv_heads * head_chunks,
        blocks,
        shape,
        partial_base,
    );
    // The last tiles of a causal prefill see the most positions: they start first, so
    // that the short ones fill the end of the launch.
    split.items.reverse();
    AttentionPlan {
        items: split.items,
        merges: split.merges,
        partial_rows: split.partial_rows,
        tile_rows,
        hsb: hpb,
        head_chunks,
        wpr: 1,
        warps: MMA_THREADS as usize / 32,
    }
}

/// The latent (MLA) kernel's plan (`kvrs_paged_attention_mla_*`): as
/// [`plan_mma`]'s, with one 256-thread block per SM (about 150 KB of shared memory each).
pub fn plan_mla(
    rows: &[DeviceRow],
    spans: &[Range<usize>],
    shape: &PlanShape,
    partial_base: usize,
) -> AttentionPlan {
    let mut p = plan_tensor(rows, spans, shape, partial_base, MLA_BLOCKS_PER_SM);
    p.warps = MLA_THREADS as usize / 32;
    p
}

/// Whether the rows of a span of `len` query tokens go to the tensor-core kernel: more
/// than one token (decode rows stay on the CUDA-core kernel, which reads K/V at copy
/// speed), and at least one 16-row tile of packed (token, head) rows.
pub fn wants_tensor_cores(len: usize, group: usize) -> bool {
    len > 1 && len * group >= 16
}

/// A plan's work items and the merge of its splits.
struct Split {
    items: Vec<[i64; 4]>,
    merges: Vec<[i32; 4]>,
    partial_rows: usize,
}

/// Tiles of up to `tile_rows` consecutive rows of each span (their windows' union), each
/// split into chunks of positions so that the items, times `blocks_per_item`, fill about
/// `blocks` blocks; the partial rows of split tiles are numbered from `partial_base`.
fn tile(
    rows: &[DeviceRow],
    spans: &[Range<usize>],
    tile_rows: usize,
    blocks_per_item: usize,
    blocks: usize,
    shape: &PlanShape,
    partial_base: usize,
) -> Split {
    // Tiles: (first row, rows, their windows' union).
    let mut tiles: Vec<(usize, usize, i64, i64)> = Vec::new();
    for s in spans {
        for first in s.clone().step_by(tile_rows.max(1)) {
            let n = tile_rows.min(s.end - first);
            let part = &rows[first..first + n];
            let lo = part.iter().map(|r| r[3]).min().unwrap_or(0);
            let hi = part.iter().map(|r| r[4]).max().unwrap_or(0);
            tiles.push((first, n, lo, hi));
        }
    }
    let len = |t: &(usize, usize, i64, i64)| (t.3 - t.2).max(0) as usize;
    let total: usize = tiles.iter().map(len).sum();
    let longest = tiles.iter().map(len).max().unwrap_or(0);
    let target_items = blocks.div_ceil(blocks_per_item.max(1));
    let mut chunk = total
        .div_ceil(target_items.max(1))
        .max(MIN_CHUNK)
        .max(longest.div_ceil(MAX_SPLITS))
        .next_multiple_of(CHUNK_ALIGN);
    let splits = |t: &(usize, usize, i64, i64), chunk: usize| len(t).div_ceil(chunk).max(1);
    let partial_rows = |chunk: usize| -> usize {
        tiles
            .iter()
            .map(|t| match splits(t, chunk) {
                1 => 0,
                s => s * t.1,
            })
            .sum()
    };
    while partial_rows(chunk) * shape.q_heads * (shape.v_head_dim + 2) * 4 > MAX_WORKSPACE {
        chunk *= 2;
    }
    let mut items = Vec::with_capacity(tiles.len());
    let mut merges = Vec::new();
    let mut partial = partial_base;
    for t in &tiles {
        let head = t.0 as i64 | (t.1 as i64) << 32;
        let s = splits(t, chunk);
        if s == 1 {
            items.push([head, t.2, t.3.max(t.2), -1]);
            continue;
        }
        for k in 0..s {
            let lo = t.2 + (k * chunk) as i64;
            let hi = (lo + chunk as i64).min(t.3);
            items.push([head, lo, hi, (partial + k * t.1) as i64]);
        }
        for i in 0..t.1 {
            merges.push([(t.0 + i) as i32, (partial + i) as i32, s as i32, t.1 as i32]);
        }
        partial += s * t.1;
    }
    Split {
        items,
        merges,
        partial_rows: partial - partial_base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: PlanShape = PlanShape {
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        v_head_dim: 128,
        elem_size: 2,
        sm_count: 132,
    };

    /// The CUDA-core kernel's plan for all of `rows`.
    fn plan(rows: &[DeviceRow], shape: &PlanShape) -> AttentionPlan {
        plan_spans(rows, &spans(rows), shape, 0)
    }

    fn decode(seqs: usize, len: i64) -> Vec<DeviceRow> {
        (0..seqs as i64)
            .map(|s| [s, s * 1000, len - 1, 0, len])
            .collect()
    }

    #[test]
    fn heads_per_thread_mirrors_the_kernel() {
        assert_eq!(heads_per_thread(128, 128, 2), 4);
        assert_eq!(heads_per_thread(128, 128, 4), 4);
        assert_eq!(heads_per_thread(256, 256, 4), 4);
        assert_eq!(heads_per_thread(128, 128, 1), 2);
        assert_eq!(heads_per_thread(64, 64, 1), 2);
        assert_eq!(heads_per_thread(80, 80, 2), 4);
        // Two head sizes take the generic kernel.
        assert_eq!(heads_per_thread(128, 64, 1), 4);
    }

    #[test]
    fn one_long_sequence_is_split_across_the_device() {
        let p = plan(&decode(1, 32768), &H100);
        let blocks = p.items.len() * 8;
        assert!((132..=4 * 132).contains(&blocks), "{blocks}");
        assert_eq!(p.merges.len(), 1);
        assert_eq!(p.merges[0][2] as usize, p.items.len());
        // Chunks tile the history exactly, in order.
        assert_eq!(p.items[0][1], 0);
        assert_eq!(p.items.last().unwrap()[2], 32768);
        for w in p.items.windows(2) {
            assert_eq!(w[0][2], w[1][1]);
        }
        assert_eq!((p.tile_rows, p.hsb, p.wpr, p.warps), (1, 1, 4, 4));
    }

    #[test]
    fn a_large_batch_is_not_split() {
        let p = plan(&decode(256, 2048), &H100);
        assert_eq!(p.items.len(), 256);
        assert!(p.merges.is_empty() && p.partial_rows == 0);
        assert!(p.items.iter().all(|i| i[3] == -1));
    }

    #[test]
    fn extend_rows_share_tiles_and_splits_cover_every_row() {
        // 20 query tokens of one sequence at positions 1000..1020 (causal), then a
        // decode row of another.
        let mut rows: Vec<DeviceRow> = (0..20).map(|i| [i, 0, 1000 + i, 0, 1001 + i]).collect();
        rows.push([20, 64, 5, 0, 6]);
        let shape = PlanShape {
            sm_count: 1000,
            ..H100
        };
        let p = plan(&rows, &shape);
        assert_eq!((p.tile_rows, p.hsb, p.wpr, p.warps), (8, 1, 1, 8));
        // Tiles of 8, 8, 4 rows, then the decode row.
        let heads: Vec<(i64, i64)> = p
            .items
            .iter()
            .map(|i| (i[0] & 0xffff_ffff, i[0] >> 32))
            .collect();
        assert!(heads.contains(&(16, 4)) && heads.contains(&(20, 1)));
        // Every split row appears once in the merges, with all its tile's splits.
        let mut merged: Vec<i32> = p.merges.iter().map(|m| m[0]).collect();
        merged.sort_unstable();
        merged.dedup();
        assert_eq!(merged.len(), p.merges.len());
        for m in &p.merges {
            // Split s of row m[0] is partial row m[1] + s * m[3] of the item holding it.
            for s in 0..m[2] as i64 {
                let prow = m[1] as i64 + s * m[3] as i64;
                let holders = p
                    .items
                    .iter()
                    .filter(|i| {
                        let (row0, n) = (i[0] & 0xffff_ffff, i[0] >> 32);
                        i[3] >= 0
                            && prow - i[3] == m[0] as i64 - row0
                            && (0..n).contains(&(prow - i[3]))
                    })
                    .count();
                assert_eq!(holders, 1, "{m:?} split {s}");
            }
        }
        let used: usize = p
            .items
            .iter()
            .filter(|i| i[3] >= 0)
            .map(|i| (i[0] >> 32) as usize)
            .sum();
        assert_eq!(used, p.partial_rows);
    }

    #[test]
    fn large_groups_take_more_warps_or_blocks() {
        let mqa = PlanShape {
            q_heads: 64,
            kv_heads: 1,
            elem_size: 1,
            ..H100
        };
        let p = plan(&decode(2, 100), &mqa);
        // 64 heads, 2 per thread: 32 slots, 8 per block, 4 blocks per KV head.
        assert_eq!((p.hsb, p.head_chunks, p.warps), (8, 4, 8));
        assert_eq!(p.grid(1), [2, 4, 1]);
    }

    /// `seqs` sequences each extending `n` query tokens after `history` positions
    /// (causal), tables 1000 apart.
    fn extend(seqs: usize, history: i64, n: i64) -> Vec<DeviceRow> {
        (0..seqs as i64)
            .flat_map(|s| {
                (0..n).map(move |i| [s * n + i, s * 1000, history + i, 0, history + i + 1])
            })
            .collect()
    }

    #[test]
    fn prefill_on_the_tensor_cores_is_not_split() {
        // 16 x (2k + 512) and one 32k prefill: many blocks of 16 tokens x 4 heads.
        for (seqs, history, n) in [(16, 2048, 512), (1, 0, 32768)] {
            let rows = extend(seqs, history, n);
            let all = spans(&rows);
            assert_eq!(all.len(), seqs);
            let p = plan_mma(&rows, &all, &H100, 0);
            assert_eq!((p.tile_rows, p.hsb, p.head_chunks, p.warps), (16, 4, 1, 4));
            assert_eq!(p.items.len(), seqs * (n as usize).div_ceil(16));
            assert!(p.merges.is_empty() && p.partial_rows == 0);
            // Each block sees its rows' causal windows' union, no more; the longest
            // first.
            assert_eq!(p.items[0][2], history + n);
            assert_eq!(p.items.last().unwrap()[2], history + 16);
        }
    }

    #[test]
    fn verification_rows_split_beside_decode_rows() {
        // Four draft tokens of one sequence over 32k positions, decode rows of two
        // others: the decode rows stay on the CUDA cores, and the two plans' partial
        // rows follow one another.
        let mut rows = decode(2, 500);
        rows.extend(
            extend(1, 32768, 4)
                .iter()
                .map(|r| [r[0] + 2, 7000, r[2], r[3], r[4]]),
        );
        let all = spans(&rows);
        let (tc, cc): (Vec<_>, Vec<_>) = all
            .into_iter()
            .partition(|s| wants_tensor_cores(s.len(), 4));
        assert_eq!((tc.len(), cc.len()), (1, 2));
        let core = plan_spans(&rows, &cc, &H100, 0);
        let mma = plan_mma(&rows, &tc, &H100, core.partial_rows);
        assert_eq!(
            mma.items
                .iter()
                .map(|i| i[0])
                .collect::<std::collections::HashSet<_>>()
                .len(),
            1
        );
        assert_eq!(mma.items[0][0], 2 | 4 << 32);
        assert!(mma.items.len() >= 8, "{}", mma.items.len());
        assert_eq!(mma.merges.len(), 4);
        assert_eq!(mma.merges[0][1] as usize, core.partial_rows);
        assert_eq!(mma.partial_rows, 4 * mma.items.len());
        // MQA (64 query heads on one KV head): one token per block, all heads.
        let mqa = PlanShape {
            q_heads: 64,
            kv_heads: 1,
            ..H100
        };
        let p = plan_mma(&rows, &tc, &mqa, 0);
        assert_eq!((p.tile_rows, p.hsb, p.head_chunks), (1, 64, 1));
        let wide = PlanShape {
            q_heads: 96,
            kv_heads: 1,
            ..H100
        };
        let p = plan_mma(&rows, &tc, &wide, 0);
        assert_eq!((p.tile_rows, p.hsb, p.head_chunks), (1, 64, 2));
        assert!(
            !wants_tensor_cores(1, 64) && wants_tensor_cores(2, 8) && !wants_tensor_cores(3, 4)
        );
    }
}
