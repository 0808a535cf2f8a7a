//! Attention of many query rows per KV head (prefill, extend, chunked prefill, speculative
//! verification, wide GQA groups, MLA's heads over one latent) as FlashAttention-2 does
//! it: one item is a tile of one sequence's query tokens times the query heads of one KV
//! head, its rows along the lanes of [`super::microkernel`]'s products. The item walks its
//! history a key tile at a time, each tile read in place from the pages and converted to
//! f32 once (8-bit codes decoded with their scales), then
//!
//! - scores `S^T = K · Q^T` (the queries packed once, transposed and scaled),
//! - the online softmax, lane by lane, so every row keeps its running maximum and sum
//!   in vectors (no horizontal reduction): tiles past the item's last visible position
//!   are never read, tiles every row sees whole take no mask, the others (the causal
//!   diagonal, window edges) mask position by position; soft-capping and ALiBi apply to
//!   the scores, sinks join the denominator at the end,
//! - `O^T += V^T · P^T`, the outputs rescaled first where a maximum grew.
//!
//! For latent attention (MLA) the key tile is `[c, r]` (the latent and its rotary part)
//! and the value tile is its first `v_head_dim` columns, read in place from the key tile.
//!
//! With AVX-512 the products take 16-lane registers ([`super::avx512`]); with AVX512-BF16,
//! bfloat16 queries over a bfloat16 cache score with `vdpbf16ps` straight from the
//! stored key bits (the queries packed in pairs, unscaled, the scale applied to the
//! scores), the outputs summed in f32 as before.

use std::cell::RefCell;

use super::kernel::{
    has_avx2, load_query, load_query_unscaled, load_vector, prefetch, write_row, Dest,
};
use super::math::exp;
use super::microkernel::{product, Product, Strided, LANES};
use super::schedule::{Item, Problem};
use super::simd::{level, Level};
use super::KvPages;
use crate::dtype::DType;

/// Query rows an item holds (the tokens of a tile times the group's heads), where the
/// group allows: its transposed queries, outputs and scores stay in L2.
pub(super) const TILE_ROWS: usize = 128;

/// Positions of one key and value tile.
const KV_TILE: usize = 64;

/// Per-thread buffers, grown to the largest item seen and then reused.
#[derive(Default)]
struct Scratch {
    /// Queries, scaled and transposed: `[head_dim][lanes]`.
    qt: Vec<f32>,
    /// Bfloat16 queries, unscaled, transposed in pairs: `[head_dim / 2][lanes]`.
    qt2: Vec<u32>,
    /// The bfloat16 key tile as stored: `[KV_TILE][head_dim]`.
    kt2: Vec<u16>,
    /// Unnormalised outputs, transposed: `[v_head_dim][lanes]`.
    ot: Vec<f32>,
    /// Scores, then weights, of one tile: `[KV_TILE][lanes]`.
    st: Vec<f32>,
    /// The key tile in f32: `[KV_TILE][head_dim]`.
    kt: Vec<f32>,
    /// The value tile in f32: `[KV_TILE][v_head_dim]`.
    vt: Vec<f32>,
    /// Running maximum and sum of each lane.
    m: Vec<f32>,
    l: Vec<f32>,
    /// Each lane's row: first visible position, one past the last, its own position
    /// (for ALiBi) and its ALiBi slope.
    lo: Vec<u32>,
    hi: Vec<u32>,
    /// Each lane's query token (`u32::MAX` past the real lanes), for a custom mask.
    token: Vec<u32>,
    pos: Vec<f32>,
    slope: Vec<f32>,
    /// Each lane's maximum over a tile, and the factor of its old sum and outputs.
    mx: Vec<f32>,
    f: Vec<f32>,
    /// Eight query rows on their way in, or output rows on their way out.
    rows: Vec<f32>,
}

impl Scratch {
    fn fit(&mut self, lanes: usize, d: usize, dv: usize) {
        for (buf, n) in [
            (&mut self.qt, d * lanes),
            (&mut self.ot, dv * lanes),
            (&mut self.st, KV_TILE * lanes),
            (&mut self.kt, KV_TILE * d),
            (&mut self.vt, KV_TILE * dv),
            (&mut self.m, lanes),
            (&mut self.l, lanes),
            (&mut self.pos, lanes),
            (&mut self.slope, lanes),
            (&mut self.mx, lanes),
            (&mut self.f, lanes),
            (&mut self.rows, LANES * d.max(dv)),
        ] {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
        }
        for buf in [&mut self.lo, &mut self.hi, &mut self.token] {
            if buf.len() < lanes {
                buf.resize(lanes, 0);
            }
        }
        if self.qt2.len() < d.div_ceil(2) * lanes {
            self.qt2.resize(d.div_ceil(2) * lanes, 0);
        }
        if self.kt2.len() < KV_TILE * d {
            self.kt2.resize(KV_TILE * d, 0);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Runs one tiled item (one KV head) on the calling thread.
pub(super) fn run_item(p: &Problem<'_>, it: &Item, dest: Dest) {
    SCRATCH.with(|sc| {
        let sc = &mut sc.borrow_mut();
        #[cfg(all(target_arch = "x86_64", kvrs_avx512))]
        match level() {
            // SAFETY (both): the CPU has the features the function is compiled for.
            Level::Avx512Bf16 if bf16_scores(p) => {
                return unsafe { run_avx512_bf16(p, it, dest, sc) }
            }
            Level::Avx512 | Level::Avx512Bf16 => return unsafe { run_avx512(p, it, dest, sc) },
            _ => {}
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { run_avx2(p, it, dest, sc) };
        }
        // SAFETY: plain code for any CPU; the problem was validated by `attend`.
        unsafe { run_with::<false, false, false>(p, it, dest, sc) }
    })
}

/// Whether the scores of `p` take `vdpbf16ps`: bfloat16 queries (exact as packed) over
/// a bfloat16 cache, keys of an even size.
fn bf16_scores(p: &Problem<'_>) -> bool {
    p.q.dtype() == DType::BF16
        && p.seqs.iter().all(|s| s.kv.dtype == DType::BF16)
        && p.heads.head_dim.is_multiple_of(2)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2(p: &Problem<'_>, it: &Item, dest: Dest, sc: &mut Scratch) {
    run_with::<true, false, false>(p, it, dest, sc)
}

#[cfg(all(target_arch = "x86_64", kvrs_avx512))]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn run_avx512(p: &Problem<'_>, it: &Item, dest: Dest, sc: &mut Scratch) {
    run_with::<true, true, false>(p, it, dest, sc)
}

#[cfg(all(target_arch = "x86_64", kvrs_avx512))]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn run_avx512_bf16(p: &Problem<'_>, it: &Item, dest: Dest, sc: &mut Scratch) {
    run_with::<true, true, true>(p, it, dest, sc)
}

/// The item's loop; `SIMD`: compiled with AVX2, FMA and F16C; `WIDE`: with AVX-512 F,
/// BW, VL and DQ too; `BF16`: with AVX512-BF16, for a problem [`bf16_scores`] takes.
#[inline(always)]
unsafe fn run_with<const SIMD: bool, const WIDE: bool, const BF16: bool>(
    p: &Problem<'_>,
    it: &Item,
    dest: Dest,
    sc: &mut Scratch,
) {
    let (d, dv) = (p.heads.head_dim, p.heads.v_head_dim);
    let g = p.num_q_heads / p.heads.num_kv_heads;
    let head = it.heads.start;
    debug_assert_eq!(it.heads.len(), 1);
    let rows = &p.rows[it.rows.clone()];
    // Lane r is token r / g of the tile and query head head * g + r % g.
    let real = rows.len() * g;
    let lanes = real.next_multiple_of(LANES);
    sc.fit(lanes, d, dv);
    pack_queries::<SIMD, BF16>(p, rows, head * g, g, sc, lanes);
    sc.ot[..dv * lanes].fill(0.0);
    sc.m[..lanes].fill(f32::NEG_INFINITY);
    sc.l[..lanes].fill(0.0);
    let kv = &p.seqs[it.seq].kv;
    let latent = p.opts.latent;
    let mut pos = it.lo;
    while pos < it.hi {
        let n = KV_TILE.min(it.hi - pos);
        let (lo, hi) = (&sc.lo[..real], &sc.hi[..real]);
        let (p0, p1) = (pos as u32, (pos + n) as u32);
        if lo.iter().zip(hi).all(|(&a, &b)| b <= p0 || a >= p1) {
            pos += n;
            continue;
        }
        let whole = p.opts.mask.is_none() && lo.iter().zip(hi).all(|(&a, &b)| a <= p0 && p1 <= b);
        if BF16 {
            load_tile_bf16::<SIMD>(kv, latent, pos, n, head, [d, dv], sc);
        } else {
            load_tile::<SIMD>(kv, latent, pos, n, head, [d, dv], sc);
        }
        if pos + n < it.hi {
            let lens = KvPages::stored_lens([d, dv], latent);
            prefetch::<false>(kv, pos + n..(pos + 2 * n).min(it.hi), head, lens);
        }
        // The value tile: the latent's columns of the key tile, or the values.
        let (v, v_ks) = if latent {
            (sc.kt.as_ptr(), d)
        } else {
            (sc.vt.as_ptr(), dv)
        };
        if BF16 {
            #[cfg(all(target_arch = "x86_64", kvrs_avx512))]
            super::avx512::scores_bf16(&super::avx512::Bf16Product {
                a: sc.kt2.as_ptr(),
                a_rs: d,
                b: sc.qt2.as_ptr(),
                c: sc.st.as_mut_ptr(),
                rows: n,
                lanes,
                pairs: d / 2,
            });
            for s in &mut sc.st[..n * lanes] {
                *s *= p.scale;
            }
        } else {
            product::<SIMD, WIDE>(&Product {
                a: Strided {
                    ptr: sc.kt.as_ptr(),
                    rs: d,
                    ks: 1,
                },
                b: sc.qt.as_ptr(),
                b_ks: lanes,
                c: sc.st.as_mut_ptr(),
                c_rs: lanes,
                rows: n,
                lanes,
                k: d,
                accumulate: false,
            });
        }
        softmax(p, sc, pos, n, lanes, whole, dv);
        product::<SIMD, WIDE>(&Product {
            a: Strided {
                ptr: v,
                rs: 1,
                ks: v_ks,
            },
            b: sc.st.as_ptr(),
            b_ks: lanes,
            c: sc.ot.as_mut_ptr(),
            c_rs: lanes,
            rows: dv,
            lanes,
            k: n,
            accumulate: true,
        });
        pos += n;
    }
    let Scratch {
        ot,
        m,
        l,
        rows: buf,
        ..
    } = sc;
    for r0 in (0..real).step_by(LANES) {
        for c in 0..dv {
            for k in 0..LANES {
                buf[k * dv + c] = ot[c * lanes + r0 + k];
            }
        }
        for r in r0..(r0 + LANES).min(real) {
            let row = &mut buf[(r - r0) * dv..(r - r0 + 1) * dv];
            let (token, qh) = (rows[r / g].token, head * g + r % g);
            match dest {
                Dest::Out => write_row(p, token, qh, m[r], l[r], row),
                Dest::Partial(at) => {
                    let dst = p.partial_row(at + r * (dv + 2), dv);
                    dst[0] = m[r];
                    dst[1] = l[r];
                    dst[2..].copy_from_slice(row);
                }
            }
        }
    }
}

/// Packs the queries of `rows` (query heads `first_head..first_head + g` of each) into
/// `sc.qt` (`[head_dim][lanes]`, scaled, zero past the real lanes; with `BF16`, into
/// `sc.qt2` in bfloat16 pairs, unscaled) and records each lane's visible span, position
/// and ALiBi slope.
#[inline(always)]
unsafe fn pack_queries<const SIMD: bool, const BF16: bool>(
    p: &Problem<'_>,
    rows: &[super::QueryRow],
    first_head: usize,
    g: usize,
    sc: &mut Scratch,
    lanes: usize,
) {
    let d = p.heads.head_dim;
    let real = rows.len() * g;
    // Eight rows at a time through `sc.rows`, so that each line of `qt` is written once
    // per eight rows rather than once per row.
    for r0 in (0..lanes).step_by(LANES) {
        for k in 0..LANES {
            let (r, buf) = (r0 + k, &mut sc.rows[k * d..(k + 1) * d]);
            if r < real {
                let row = &rows[r / g];
                let qh = first_head + r % g;
                if BF16 {
                    load_query_unscaled::<SIMD>(p, row.token, qh, buf);
                } else {
                    load_query::<SIMD>(p, row.token, qh, buf);
                }
                (sc.lo[r], sc.hi[r]) = (row.lo as u32, row.hi as u32);
                sc.token[r] = row.token as u32;
                sc.pos[r] = row.pos as f32;
                sc.slope[r] = p.opts.alibi_slopes.map_or(0.0, |s| s[qh]);
            } else {
                buf.fill(0.0);
                (sc.lo[r], sc.hi[r], sc.token[r]) = (0, 0, u32::MAX);
                (sc.pos[r], sc.slope[r]) = (0.0, 0.0);
            }
        }
        if BF16 {
            #[cfg(all(target_arch = "x86_64", kvrs_avx512))]
            for i in 0..d / 2 {
                for k in 0..LANES {
                    let (x, y) = (sc.rows[k * d + 2 * i], sc.rows[k * d + 2 * i + 1]);
                    sc.qt2[i * lanes + r0 + k] = super::avx512::pack_pair(x, y);
                }
            }
            continue;
        }
        for i in 0..d {
            for k in 0..LANES {
                sc.qt[i * lanes + r0 + k] = sc.rows[k * d + i];
            }
        }
    }
}

/// Converts the keys (and values) of positions `pos..pos + n` of KV head `head` into
/// `sc.kt` (and `sc.vt`), `dims`: the attended head sizes. Offsets are found once per
/// block and stepped by the strides within it.
#[inline(always)]
unsafe fn load_tile<const SIMD: bool>(
    kv: &KvPages<'_>,
    latent: bool,
    pos: usize,
    n: usize,
    head: usize,
    dims: [usize; 2],
    sc: &mut Scratch,
) {
    let [d, dv] = dims;
    let mut j = 0;
    while j < n {
        let run = (kv.block_size - (pos + j) % kv.block_size).min(n - j);
        let (k0, v0) = (kv.key_offset(pos + j, head), kv.value_offset(pos + j, head));
        for t in 0..run {
            let (k_at, v_at) = (k0 + t * kv.pos_stride, v0 + t * kv.v_pos_stride);
            let key = &mut sc.kt[(j + t) * d..(j + t + 1) * d];
            if latent {
                // The latent, then its rotary part (stored as the value).
                let (c, r) = key.split_at_mut(dv);
                load_vector::<SIMD>(kv, k_at, head, false, c);
                load_vector::<SIMD>(kv, v_at, head, true, r);
            } else {
                load_vector::<SIMD>(kv, k_at, head, false, key);
                let value = &mut sc.vt[(j + t) * dv..(j + t + 1) * dv];
                load_vector::<SIMD>(kv, v_at, head, true, value);
            }
        }
        j += run;
    }
}

/// [`load_tile`] for the bfloat16 scores: the keys as stored into `sc.kt2`, the values
/// (or, for latent attention, the keys) in f32 as [`load_tile`] loads them.
#[inline(always)]
unsafe fn load_tile_bf16<const SIMD: bool>(
    kv: &KvPages<'_>,
    latent: bool,
    pos: usize,
    n: usize,
    head: usize,
    dims: [usize; 2],
    sc: &mut Scratch,
) {
    let [d, dv] = dims;
    let data = kv.data as *const u16;
    let mut j = 0;
    while j < n {
        let run = (kv.block_size - (pos + j) % kv.block_size).min(n - j);
        let (k0, v0) = (kv.key_offset(pos + j, head), kv.value_offset(pos + j, head));
        for t in 0..run {
            let (k_at, v_at) = (k0 + t * kv.pos_stride, v0 + t * kv.v_pos_stride);
            let key = &mut sc.kt2[(j + t) * d..(j + t + 1) * d];
            if latent {
                let (c, r) = key.split_at_mut(dv);
                c.copy_from_slice(std::slice::from_raw_parts(data.add(k_at), dv));
                r.copy_from_slice(std::slice::from_raw_parts(data.add(v_at), d - dv));
                let c = &mut sc.kt[(j + t) * d..(j + t) * d + dv];
                load_vector::<SIMD>(kv, k_at, head, false, c);
            } else {
                key.copy_from_slice(std::slice::from_raw_parts(data.add(k_at), d));
                let value = &mut sc.vt[(j + t) * dv..(j + t + 1) * dv];
                load_vector::<SIMD>(kv, v_at, head, true, value);
            }
        }
        j += run;
    }
}

/// Turns the scores of the tile at `pos` (`sc.st`, `n` rows of `lanes`) into softmax
/// weights against each lane's running maximum, which it updates with the lane's sum,
/// rescaling the lane's outputs (`dv` rows of `sc.ot`) where the maximum grew. `whole`:
/// every real lane sees every position of the tile (no mask). Every loop runs along
/// whole rows of lanes, which the compiler vectorises.
#[inline(always)]
fn softmax(
    p: &Problem<'_>,
    sc: &mut Scratch,
    pos: usize,
    n: usize,
    lanes: usize,
    whole: bool,
    dv: usize,
) {
    let Scratch {
        st,
        ot,
        m,
        l,
        lo,
        hi,
        token,
        pos: qpos,
        slope,
        mx,
        f,
        ..
    } = sc;
    let (m, l, mx, f) = (
        &mut m[..lanes],
        &mut l[..lanes],
        &mut mx[..lanes],
        &mut f[..lanes],
    );
    let (lo, hi, qpos, slope) = (&lo[..lanes], &hi[..lanes], &qpos[..lanes], &slope[..lanes]);
    let token = &token[..lanes];
    let rows = st[..n * lanes].chunks_exact_mut(lanes);
    mx.fill(f32::NEG_INFINITY);
    for (j, row) in rows.enumerate() {
        if let Some(cap) = p.opts.softcap {
            for v in row.iter_mut() {
                // cap * tanh(v / cap), with tanh(y) = 1 - 2 / (e^(2y) + 1).
                *v = cap * (1.0 - 2.0 / (exp(2.0 * *v / cap) + 1.0));
            }
        }
        if p.opts.alibi_slopes.is_some() {
            let kp = (pos + j) as f32;
            for (v, (&s, &q)) in row.iter_mut().zip(slope.iter().zip(qpos)) {
                *v += s * (kp - q);
            }
        }
        if !whole {
            let kp = (pos + j) as u32;
            for (v, (&a, &b)) in row.iter_mut().zip(lo.iter().zip(hi)) {
                *v = if kp < a || kp >= b {
                    f32::NEG_INFINITY
                } else {
                    *v
                };
            }
            if let Some(mask) = p.opts.mask {
                for (v, &t) in row.iter_mut().zip(token.iter()) {
                    if t == u32::MAX || !mask.allows(t as usize, pos + j) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
        for (x, &v) in mx.iter_mut().zip(row.iter()) {
            *x = x.max(v);
        }
    }
    // The new maximum into `mx`, the factor of the old sums and outputs into `f`.
    for ((x, f), &old) in mx.iter_mut().zip(f.iter_mut()).zip(m.iter()) {
        *x = x.max(old);
        *f = if old == f32::NEG_INFINITY {
            0.0
        } else {
            exp(old - *x)
        };
    }
    m.copy_from_slice(mx);
    for x in l.iter_mut().zip(f.iter()) {
        *x.0 *= x.1;
    }
    for row in st[..n * lanes].chunks_exact_mut(lanes) {
        for ((v, &x), s) in row.iter_mut().zip(mx.iter()).zip(l.iter_mut()) {
            let w = if *v == f32::NEG_INFINITY {
                0.0
            } else {
                exp(*v - x)
            };
            *v = w;
            *s += w;
        }
    }
    if f.iter().any(|&f| f != 1.0) {
        for o in ot[..dv * lanes].chunks_exact_mut(lanes) {
            for (o, &f) in o.iter_mut().zip(f.iter()) {
                *o *= f;
            }
        }
    }
}
