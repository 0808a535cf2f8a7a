//! How an attention call is cut into items for this process's threads, and how the
//! pieces of a split history are merged again (flash-decoding's log-sum-exp reduction).
//!
//! Items are (sequence, query tile, KV heads) — every KV head for a streamed (decode)
//! item, one for a tiled one — so that a long prompt gives a thread per (head, tile) on
//! a machine of many cores. When that still gives fewer than [`ITEMS_PER_THREAD`] items
//! per thread, long histories are split into pieces merged afterwards. The threads then
//! take items longest first from one shared counter.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use super::kernel::{rescale, run_item, write_row, Dest};
use super::tiled::TILE_ROWS;
use super::{AttnOptions, KvHeads, QueryRow, SeqQueries};
use crate::tensor::{SharedTensorMut, TensorRef};

/// Query tokens of one sequence per streamed item: each K/V run is converted once for
/// them all.
const TILE_TOKENS: usize = 16;

/// Query rows per KV head (a sequence's tokens times the group's heads) from which a
/// sequence's items are tiled ([`super::tiled`]): below, its rows are few enough (decode
/// of a narrow group) that streaming the K/V past them ([`super::kernel`]) wins.
const TILED_ROWS: usize = 8;

/// Items per thread below which long histories are split.
const ITEMS_PER_THREAD: usize = 4;

/// The shortest piece of history a split hands to one item.
const MIN_SPLIT: usize = 512;

/// One validated attention call.
pub(super) struct Problem<'a> {
    pub q: &'a TensorRef<'a>,
    /// The output, C-contiguous: each `(token, head)` row is written by the one item
    /// that holds it (or the merge of its split item).
    pub out: SharedTensorMut<'a>,
    pub num_q_heads: usize,
    pub heads: KvHeads,
    pub rows: &'a [QueryRow],
    pub seqs: &'a [SeqQueries<'a>],
    pub scale: f32,
    pub opts: &'a AttnOptions<'a>,
    /// Partial results of split items ([`SharedF32::NONE`] until [`run`] splits).
    pub partial: SharedF32,
}

impl<'a> Problem<'a> {
    /// `d + 2` floats of the partial buffer at `at`.
    ///
    /// # Safety
    /// Each range is handed to one item only.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn partial_row(&self, at: usize, d: usize) -> &mut [f32] {
        debug_assert!(at + d + 2 <= self.partial.len);
        std::slice::from_raw_parts_mut(self.partial.ptr.add(at), d + 2)
    }
}

/// A raw view of the partial buffer that items write disjoint parts of.
#[derive(Clone, Copy)]
pub(super) struct SharedF32 {
    ptr: *mut f32,
    len: usize,
}

impl SharedF32 {
    /// No buffer.
    pub const NONE: SharedF32 = SharedF32 {
        ptr: std::ptr::null_mut(),
        len: 0,
    };
}

// SAFETY: items write disjoint ranges of the buffer, which outlives the parallel loop.
unsafe impl Send for SharedF32 {}
unsafe impl Sync for SharedF32 {}

/// A tile of one sequence's rows, its KV heads, one span `lo..hi` of its history. A
/// streamed item takes every KV head (consecutive heads lie side by side in NHD blocks,
/// so it reads whole positions); a tiled one takes one.
#[derive(Clone, Debug)]
pub(super) struct Item {
    pub seq: usize,
    pub rows: Range<usize>,
    pub heads: Range<usize>,
    pub lo: usize,
    pub hi: usize,
    /// Run by [`super::tiled`].
    pub tiled: bool,
}

/// A tile whose history is split in `splits` items, their partial results at float
/// offset `partial` (each `rows * heads * (v_head_dim + 2)` floats, rows per KV head).
struct Split {
    item: Item,
    splits: usize,
    partial: usize,
}

/// Runs every item of `p` on this process's threads ([`crate::parallel`]).
pub(super) fn run(p: &mut Problem<'_>) {
    let g = p.num_q_heads / p.heads.num_kv_heads;
    // Partial results hold output rows.
    let d = p.heads.v_head_dim;
    let mut tiles: Vec<Item> = Vec::new();
    for (si, s) in p.seqs.iter().enumerate() {
        let tiled = s.rows.len() * g >= TILED_ROWS;
        let (tokens, heads) = if tiled {
            ((TILE_ROWS / g).max(1), 1)
        } else {
            (TILE_TOKENS, p.heads.num_kv_heads)
        };
        let mut t = s.rows.start;
        while t < s.rows.end {
            let rows = t..(t + tokens).min(s.rows.end);
            let span = &p.rows[rows.clone()];
            let lo = span.iter().map(|r| r.lo).min().unwrap_or(0);
            let hi = span.iter().map(|r| r.hi).max().unwrap_or(0);
            for h in (0..p.heads.num_kv_heads).step_by(heads) {
                tiles.push(Item {
                    seq: si,
                    rows: rows.clone(),
                    heads: h..h + heads,
                    lo,
                    hi: hi.max(lo),
                    tiled,
                });
            }
            t = rows.end;
        }
    }
    let target = ITEMS_PER_THREAD * crate::parallel::threads();
    let want = if tiles.len() >= target {
        1
    } else {
        target.div_ceil(tiles.len().max(1))
    };
    let mut whole = Vec::with_capacity(tiles.len());
    let mut split = Vec::new();
    let mut floats = 0;
    for it in tiles {
        let n = want.min((it.hi - it.lo) / MIN_SPLIT).max(1);
        if n == 1 {
            whole.push(it);
        } else {
            let rows = it.rows.len() * g * it.heads.len();
            split.push(Split {
                item: it,
                splits: n,
                partial: floats,
            });
            floats += n * rows * (d + 2);
        }
    }
    let mut partial = vec![0f32; floats];
    p.partial = SharedF32 {
        ptr: partial.as_mut_ptr(),
        len: partial.len(),
    };
    let p = &*p;
    let pieces = split.iter().flat_map(|sp| {
        let step = (sp.item.hi - sp.item.lo).div_ceil(sp.splits);
        let per = sp.item.rows.len() * g * sp.item.heads.len() * (d + 2);
        (0..sp.splits).map(move |k| {
            let lo = sp.item.lo + k * step;
            let it = Item {
                lo,
                hi: (lo + step).min(sp.item.hi),
                ..sp.item.clone()
            };
            (it, Dest::Partial(sp.partial + k * per))
        })
    });
    let mut work: Vec<(Item, Dest)> = whole
        .into_iter()
        .map(|it| (it, Dest::Out))
        .chain(pieces)
        .collect();
    // Longest first, each thread taking the next item when it is free: the last items
    // to start are the shortest, so threads finish together (causal prefill tiles grow
    // with their position; a batch mixes prompts and decode tokens).
    work.sort_by_key(|(it, _)| std::cmp::Reverse(it.rows.len() * it.heads.len() * (it.hi - it.lo)));
    let next = AtomicUsize::new(0);
    crate::parallel::install(|| {
        let workers = rayon::current_num_threads().min(work.len());
        (0..workers).into_par_iter().for_each(|_| {
            while let Some((it, dest)) = work.get(next.fetch_add(1, Ordering::Relaxed)) {
                run_item(p, it, *dest);
            }
        });
        split.par_iter().for_each(|sp| merge(p, sp, d, g));
    });
    drop(partial);
}

/// Merges the partial `(m, l, o)` of each row of a split item and writes the rows.
fn merge(p: &Problem<'_>, sp: &Split, d: usize, g: usize) {
    let rows = &p.rows[sp.item.rows.clone()];
    let per = rows.len() * g * sp.item.heads.len() * (d + 2);
    let mut o = vec![0f32; d];
    for (hi, head) in sp.item.heads.clone().enumerate() {
        for (i, row) in rows.iter().enumerate() {
            for j in 0..g {
                let r = (hi * rows.len() + i) * g + j;
                // SAFETY: the items that wrote these rows have finished; rows are read only here.
                let part =
                    |k: usize| unsafe { p.partial_row(sp.partial + k * per + r * (d + 2), d) };
                let m = (0..sp.splits)
                    .map(|k| part(k)[0])
                    .fold(f32::NEG_INFINITY, f32::max);
                o.fill(0.0);
                let mut l = 0.0;
                for k in 0..sp.splits {
                    let pk = part(k);
                    let f = rescale(pk[0], m);
                    l += pk[1] * f;
                    for (x, y) in o.iter_mut().zip(&pk[2..]) {
                        *x += f * y;
                    }
                }
                write_row(p, row.token, head * g + j, m, l, &mut o);
            }
        }
    }
}
