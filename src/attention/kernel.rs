//! One work item of attention with few query rows per KV head (decode): a tile of one
//! sequence's query rows, the query heads of every KV head, one span of history, streamed
//! run by run with an online softmax. Items with many rows per KV head go to
//! [`super::tiled`]; this module also holds the loads and stores both kinds share.

use std::cell::RefCell;

use super::math::{axpy, dot, exp, load_row, scale};
use super::schedule::{Item, Problem};
use super::simd::{level, Level};
use crate::dtype::{convert_contiguous, read_f32, DType};

/// Positions converted to f32 at a time (at most a block).
pub(super) const RUN: usize = 32;

/// Per-thread buffers, grown to the largest item seen and then reused.
#[derive(Default)]
struct Scratch {
    /// Query rows, scaled: `[rows][head_dim]`.
    q: Vec<f32>,
    /// Unnormalised outputs: `[rows][v_head_dim]`.
    o: Vec<f32>,
    /// Running maximum and sum of each row.
    m: Vec<f32>,
    l: Vec<f32>,
    /// One run of keys in f32: `[RUN][head_dim]`.
    k: Vec<f32>,
    /// The run's values in f32: `[RUN][v_head_dim]`.
    v: Vec<f32>,
}

impl Scratch {
    fn fit(&mut self, rows: usize, d: usize, dv: usize) {
        for (buf, n) in [
            (&mut self.q, rows * d),
            (&mut self.o, rows * dv),
            (&mut self.m, rows),
            (&mut self.l, rows),
            (&mut self.k, RUN * d),
            (&mut self.v, RUN * dv),
        ] {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Where an item's result goes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Dest {
    /// Normalised into the output tensor.
    Out,
    /// As `(m, l, o)` per row (`v_head_dim + 2` floats) at this float offset of the
    /// partial buffer, for the merge of a split history.
    Partial(usize),
}

/// Whether the AVX2 + FMA + F16C kernel runs (every level from [`Level::Avx2`] up).
#[inline]
pub(super) fn has_avx2() -> bool {
    level() >= Level::Avx2
}

/// Runs one item on the calling thread: a tiled one ([`super::tiled`]) or a streamed one.
pub(super) fn run_item(p: &Problem<'_>, it: &Item, dest: Dest) {
    if it.tiled {
        return super::tiled::run_item(p, it, dest);
    }
    SCRATCH.with(|sc| {
        let sc = &mut sc.borrow_mut();
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { stream_item_avx2(p, it, dest, sc) };
        }
        // SAFETY: plain code for any CPU; the problem was validated by `attend`.
        unsafe { stream_item::<false>(p, it, dest, sc) }
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn stream_item_avx2(p: &Problem<'_>, it: &Item, dest: Dest, sc: &mut Scratch) {
    stream_item::<true>(p, it, dest, sc)
}

/// A streamed item's loop.
#[inline(always)]
unsafe fn stream_item<const SIMD: bool>(p: &Problem<'_>, it: &Item, dest: Dest, sc: &mut Scratch) {
    let (d, dv) = (p.heads.head_dim, p.heads.v_head_dim);
    let g = p.num_q_heads / p.heads.num_kv_heads;
    let rows = &p.rows[it.rows.clone()];
    // Rows per KV head (token i, query head j of the group: i * g + j); the item's rows
    // are those of each of its heads in turn.
    let per = rows.len() * g;
    let nrows = per * it.heads.len();
    sc.fit(nrows, d, dv);
    let Scratch { q, o, m, l, k, v } = sc;
    for (hi, head) in it.heads.clone().enumerate() {
        for (i, row) in rows.iter().enumerate() {
            for j in 0..g {
                let r = hi * per + i * g + j;
                load_query::<SIMD>(p, row.token, head * g + j, &mut q[r * d..(r + 1) * d]);
            }
        }
    }
    m[..nrows].fill(f32::NEG_INFINITY);
    l[..nrows].fill(0.0);
    o[..nrows * dv].fill(0.0);
    let kv = &p.seqs[it.seq].kv;
    // With AVX2, rows score and accumulate straight from the stored codes (keys and
    // values of one head size, a scale per vector).
    let latent = p.opts.latent;
    let fused = !latent && kv.uniform() && kv.scale_chunk(d) == d && fuses::<SIMD>(d);
    let mut pos = it.lo;
    while pos < it.hi {
        let n = (kv.block_size - pos % kv.block_size)
            .min(it.hi - pos)
            .min(RUN);
        for (hi, head) in it.heads.clone().enumerate() {
            let first = kv.key_offset(pos, head);
            for j in (0..n).filter(|_| !fused) {
                load_key::<SIMD>(kv, latent, pos + j, head, &mut k[j * d..(j + 1) * d], dv);
                load_value::<SIMD>(kv, latent, pos + j, head, &mut v[j * dv..(j + 1) * dv]);
            }
            if pos + n < it.hi {
                let next = pos + n;
                let m = (kv.block_size - next % kv.block_size)
                    .min(it.hi - next)
                    .min(RUN);
                let lens = super::KvPages::stored_lens([d, dv], latent);
                prefetch::<true>(kv, next..next + m, head, lens);
            }
            // Rows (token i, head j of the group) in blocks of BLOCK_ROWS: their scores over
            // the run are computed together, each key element loaded once for the block.
            let mut r0 = hi * per;
            while r0 < (hi + 1) * per {
                let nb = BLOCK_ROWS.min((hi + 1) * per - r0);
                let visible = |r: usize| {
                    let row = &rows[(r % per) / g];
                    (pos.max(row.lo), (pos + n).min(row.hi))
                };
                if (r0..r0 + nb).all(|r| visible(r).0 >= visible(r).1) {
                    r0 += nb;
                    continue;
                }
                let mut sb = [[0f32; RUN]; BLOCK_ROWS];
                // The block's softmax weights over the run, 0 where a row sees nothing
                // (the unfused path accumulates them together: `accumulate`).
                let mut wb = [[0f32; RUN]; BLOCK_ROWS];
                if fused {
                    #[cfg(target_arch = "x86_64")]
                    let run = super::fused::HeadRun { kv, head, first };
                    super::fused::scores(run, n, &q[r0 * d..], nb, d, &mut sb);
                } else {
                    for (rb, sr) in sb.iter_mut().enumerate().take(nb) {
                        let qr = &q[(r0 + rb) * d..(r0 + rb + 1) * d];
                        for (x, kr) in sr.iter_mut().zip(k.chunks_exact(d)).take(n) {
                            *x = dot::<SIMD>(qr, kr);
                        }
                    }
                }
                for (rb, sr) in sb.iter_mut().enumerate().take(nb) {
                    let r = r0 + rb;
                    let (a, b) = visible(r);
                    if a >= b {
                        continue;
                    }
                    let row = &rows[(r % per) / g];
                    let qh = head * g + r % g;
                    let sr = &mut sr[a - pos..b - pos];
                    if let Some(cap) = p.opts.softcap {
                        for x in sr.iter_mut() {
                            // cap * tanh(x / cap), with tanh(y) = 1 - 2 / (e^(2y) + 1).
                            *x = cap * (1.0 - 2.0 / (exp(2.0 * *x / cap) + 1.0));
                        }
                    }
                    if let Some(slopes) = p.opts.alibi_slopes {
                        let slope = slopes[qh];
                        for (x, kp) in sr.iter_mut().zip(a..b) {
                            *x += slope * (kp as f32 - row.pos as f32);
                        }
                    }
                    if let Some(mask) = p.opts.mask {
                        for (x, kp) in sr.iter_mut().zip(a..b) {
                            if !mask.allows(row.token, kp) {
                                *x = f32::NEG_INFINITY;
                            }
                        }
                    }
                    let mx = sr.iter().fold(f32::NEG_INFINITY, |acc, &x| acc.max(x));
                    if mx == f32::NEG_INFINITY {
                        // The custom mask hides the whole run from this row: no weight.
                        sr.fill(0.0);
                        continue;
                    }
                    let or = &mut o[r * dv..(r + 1) * dv];
                    if mx > m[r] {
                        let f = rescale(m[r], mx);
                        scale(or, f);
                        l[r] *= f;
                        m[r] = mx;
                    }
                    let mr = m[r];
                    for x in sr.iter_mut() {
                        // Masked scores weigh exactly 0 (`exp` clamps its argument).
                        *x = if *x == f32::NEG_INFINITY {
                            0.0
                        } else {
                            exp(*x - mr)
                        };
                    }
                    l[r] += sr.iter().sum::<f32>();
                    if !fused {
                        wb[rb][a - pos..b - pos].copy_from_slice(sr);
                    }
                }
                if !fused {
                    accumulate::<SIMD>(&wb, nb, n, v, dv, &mut o[r0 * dv..(r0 + nb) * dv]);
                }
                #[cfg(target_arch = "x86_64")]
                if fused {
                    // Rows that see the same positions (a decode token's group) share
                    // each value's conversion; others go one by one, so that no row
                    // reads a value it does not see.
                    let run = super::fused::HeadRun { kv, head, first };
                    let (a, b) = visible(r0);
                    if (r0..r0 + nb).all(|r| visible(r) == (a, b)) {
                        let o = &mut o[r0 * d..];
                        super::fused::accumulate(run, a - pos..b - pos, &mut sb[..nb], d, o);
                    } else {
                        for (rb, w) in sb.chunks_mut(1).enumerate().take(nb) {
                            let (a, b) = visible(r0 + rb);
                            if a < b {
                                let o = &mut o[(r0 + rb) * d..];
                                super::fused::accumulate(run, a - pos..b - pos, w, d, o);
                            }
                        }
                    }
                }
                r0 += nb;
            }
        }
        pos += n;
    }
    for (hi, head) in it.heads.clone().enumerate() {
        for (i, row) in rows.iter().enumerate() {
            for j in 0..g {
                let r = hi * per + i * g + j;
                let or = &mut o[r * dv..(r + 1) * dv];
                match dest {
                    Dest::Out => write_row(p, row.token, head * g + j, m[r], l[r], or),
                    Dest::Partial(at) => {
                        let dst = p.partial_row(at + r * (dv + 2), dv);
                        dst[0] = m[r];
                        dst[1] = l[r];
                        dst[2..].copy_from_slice(or);
                    }
                }
            }
        }
    }
}

/// `o[r] += sum_j w[r][j] * v[j]` for the `nb` rows of a block over the `n` values of a
/// run (`v[j * dv..]`): each value element is loaded once for the block, and each output
/// element loaded and stored once per run rather than once per position.
#[inline(always)]
fn accumulate<const SIMD: bool>(
    w: &[[f32; RUN]; BLOCK_ROWS],
    nb: usize,
    n: usize,
    v: &[f32],
    dv: usize,
    o: &mut [f32],
) {
    let full = dv / CHUNK * CHUNK;
    for c in (0..full).step_by(CHUNK) {
        let mut acc = [[0f32; CHUNK]; BLOCK_ROWS];
        for j in 0..n {
            let vr: &[f32; CHUNK] = v[j * dv + c..j * dv + c + CHUNK]
                .try_into()
                .expect("a value row holds dv elements");
            for r in 0..BLOCK_ROWS {
                axpy::<SIMD>(&mut acc[r], w[r][j], vr);
            }
        }
        for (r, acc) in acc.iter().enumerate().take(nb) {
            for (y, x) in o[r * dv + c..r * dv + c + CHUNK].iter_mut().zip(acc) {
                *y += x;
            }
        }
    }
    // The last dv % CHUNK elements, row by row.
    for (r, wr) in w.iter().enumerate().take(nb) {
        for (j, &x) in wr.iter().enumerate().take(n) {
            axpy::<SIMD>(
                &mut o[r * dv + full..(r + 1) * dv],
                x,
                &v[j * dv + full..(j + 1) * dv],
            );
        }
    }
}

/// Whether rows of `d` elements take the fused decode path ([`super::fused`]).
#[inline(always)]
fn fuses<const SIMD: bool>(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        SIMD && super::fused::applies(d)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = d;
        false
    }
}

/// Query rows scored together: 4 rows x 16 positions is 8 AVX2 accumulators, enough
/// independent FMA chains to keep the units busy.
pub(super) const BLOCK_ROWS: usize = 4;

/// Value elements accumulated per pass (two AVX2 registers of f32).
const CHUNK: usize = 16;

/// Asks the CPU to start loading the keys and values of positions `span` while the
/// current ones are computed: one head's rows are strided (in NHD, `heads * head_dim`
/// apart), which the hardware prefetcher does not follow. `lens`: the stored key and
/// value lengths; `L1`: into the first-level cache (a short run), else the second.
#[inline(always)]
pub(super) unsafe fn prefetch<const L1: bool>(
    kv: &super::KvPages<'_>,
    span: std::ops::Range<usize>,
    head: usize,
    lens: (usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let size = kv.dtype.size();
        let (k_len, v_len) = lens;
        for j in span {
            for (at, len) in [
                (kv.key_offset(j, head), k_len),
                (kv.value_offset(j, head), v_len),
            ] {
                for line in (0..len * size).step_by(64) {
                    let p = kv.data.add(at * size + line) as *const i8;
                    if L1 {
                        _mm_prefetch::<_MM_HINT_T0>(p)
                    } else {
                        _mm_prefetch::<_MM_HINT_T1>(p)
                    }
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kv, span, head, lens);
}

/// Reads the stored vector of `dst.len()` elements at element offset `at` (of KV head
/// `head`; a value when `value`) into `dst` as f32, times its scales: one for the whole
/// vector, or one per chunk of [`super::KvPages::scale_chunk`] elements (int8 storage of
/// keys and values of different head sizes).
#[inline(always)]
pub(super) unsafe fn load_vector<const SIMD: bool>(
    kv: &super::KvPages<'_>,
    at: usize,
    head: usize,
    value: bool,
    dst: &mut [f32],
) {
    let size = kv.dtype.size();
    let chunk = kv.scale_chunk(dst.len());
    for (i, part) in dst.chunks_mut(chunk).enumerate() {
        let at = at + i * chunk;
        load_row::<SIMD>(
            part,
            kv.data.add(at * size),
            kv.dtype,
            kv.scale(at, head, value),
        );
    }
}

/// Reads the key of position `pos`, KV head `head` (`dst`: `head_dim` elements; for
/// `latent` attention, the stored latent of `dv` elements followed by its rotary tail).
#[inline(always)]
pub(super) unsafe fn load_key<const SIMD: bool>(
    kv: &super::KvPages<'_>,
    latent: bool,
    pos: usize,
    head: usize,
    dst: &mut [f32],
    dv: usize,
) {
    let at = kv.key_offset(pos, head);
    if latent {
        let (c, r) = dst.split_at_mut(dv);
        load_vector::<SIMD>(kv, at, head, false, c);
        load_vector::<SIMD>(kv, kv.value_offset(pos, head), head, true, r);
    } else {
        load_vector::<SIMD>(kv, at, head, false, dst);
    }
}

/// Reads the value of position `pos`, KV head `head` (`dst`: `v_head_dim` elements; for
/// `latent` attention, the stored latent).
#[inline(always)]
pub(super) unsafe fn load_value<const SIMD: bool>(
    kv: &super::KvPages<'_>,
    latent: bool,
    pos: usize,
    head: usize,
    dst: &mut [f32],
) {
    if latent {
        load_vector::<SIMD>(kv, kv.key_offset(pos, head), head, false, dst);
    } else {
        load_vector::<SIMD>(kv, kv.value_offset(pos, head), head, true, dst);
    }
}

/// `e^(old - new)` for a running maximum that grew from `old` (possibly -inf) to `new`.
#[inline(always)]
pub(super) fn rescale(old: f32, new: f32) -> f32 {
    if old == f32::NEG_INFINITY {
        0.0
    } else {
        (old - new).exp()
    }
}

/// Reads query row `(token, head)` into `dst` as f32, times the scale.
#[inline(always)]
pub(super) unsafe fn load_query<const SIMD: bool>(
    p: &Problem<'_>,
    token: usize,
    head: usize,
    dst: &mut [f32],
) {
    load_query_unscaled::<SIMD>(p, token, head, dst);
    scale(dst, p.scale);
}

/// Reads query row `(token, head)` into `dst` as f32, as stored.
#[inline(always)]
pub(super) unsafe fn load_query_unscaled<const SIMD: bool>(
    p: &Problem<'_>,
    token: usize,
    head: usize,
    dst: &mut [f32],
) {
    let q = p.q;
    let st = q.strides3();
    let size = q.dtype().size();
    let at = token as isize * st[0] + head as isize * st[1];
    let base = q.as_ptr().offset(at * size as isize);
    if st[2] == 1 && (base as usize).is_multiple_of(size) {
        load_row::<SIMD>(dst, base, q.dtype(), 1.0);
    } else {
        for (i, x) in dst.iter_mut().enumerate() {
            *x = read_f32(base.offset(i as isize * st[2] * size as isize), q.dtype());
        }
    }
}

/// Finishes row `(token, head)` from its running `(m, l, o)`: adds the head's sink to
/// the denominator, normalises, and writes it to the output in the output's dtype.
pub(super) fn write_row(p: &Problem<'_>, token: usize, head: usize, m: f32, l: f32, o: &mut [f32]) {
    let mut l = l;
    if let Some(sinks) = p.opts.sinks {
        let sink = sinks[head];
        let mx = m.max(sink);
        let f = rescale(m, mx);
        scale(o, f);
        l = l * f + (sink - mx).exp();
    }
    scale(o, if l > 0.0 { 1.0 / l } else { 0.0 });
    let out = p.out;
    let d = o.len();
    let size = out.dtype().size();
    // SAFETY: `out` is C-contiguous [tokens, heads, d] (checked by `attend`) and each
    // (token, head) row is written by exactly one item (no token is in two rows:
    // `attend`'s contract), so no other thread touches these elements.
    unsafe {
        let dst = out
            .as_mut_ptr()
            .add((token * p.num_q_heads + head) * d * size);
        convert_contiguous(dst, out.dtype(), o.as_ptr() as *const u8, DType::F32, d);
    }
}
