//! Attention over cached keys and values, read in place.
//!
//! The caches describe where a sequence's K/V lie ([`KvPages`]: a page table over a
//! storage, or one contiguous run) and which positions each query token sees
//! ([`QueryRow`]: the half-open range `lo..hi`, so causal, sliding-window, chunked and
//! cross-attention masks are all ranges). [`attend`] then computes, for every query row
//! and query head, `softmax(q . K^T * scale) V` over that range in f32 with an online
//! softmax, and nothing of size `[tokens x history]` is ever built. Items with many rows
//! per KV head (prefill tiles, wide GQA groups) convert K/V from the storage dtype a run
//! of positions at a time; decode items (a few rows per KV head) score and accumulate
//! straight from the stored elements, converted in registers (`fused.rs`, with AVX2). Work is split across rayon's
//! threads by (sequence, query tile) and, when that gives too few tasks (a few long
//! decode sequences), along the history (flash-decoding), whose partial results are
//! merged by log-sum-exp. An item walks every KV head of each run of positions, so it
//! reads whole positions (contiguous in NHD blocks) rather than one head's strided rows.
//!
//! Grouped-query attention: query head `h` reads KV head `h / (num_q_heads /
//! num_kv_heads)`, and each K/V run is converted once for the whole group.

#[cfg(target_arch = "x86_64")]
// The AVX-512 intrinsics are stable from Rust 1.89 (`kvrs_avx512`, set by build.rs).
#[cfg(all(target_arch = "x86_64", kvrs_avx512))]
#[clippy::msrv = "1.89"]
mod avx512;
mod fused;
mod kernel;
mod mask;
mod math;
mod microkernel;
mod schedule;
mod simd;
mod tiled;

use std::ops::Range;

use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::layout::Device;
use crate::tensor::{TensorMut, TensorRef};

pub use mask::{segment_packbits, CustomMask};
pub use simd::{set_simd_level, simd_level, simd_levels};

/// Model-specific parts of the attention formula.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnOptions<'a> {
    /// Multiplies `q . k` (default `1 / sqrt(head_dim)`).
    pub scale: Option<f32>,
    /// Gemma 2's logit soft-capping: `s = cap * tanh(s / cap)` after scaling.
    pub softcap: Option<f32>,
    /// gpt-oss attention sinks: one logit per query head that joins the softmax
    /// denominator and contributes no value.
    pub sinks: Option<&'a [f32]>,
    /// ALiBi: one slope per query head; `slope * (key_pos - query_pos)` is added to
    /// each score.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Absorbed multi-head latent attention (DeepSeek's MLA) over a latent cache, whose
    /// keys are the compressed latents `c` (`kv_lora_rank` elements) and whose values are
    /// the rotary parts `r` (`qk_rope_head_dim`): each query (`[q_latent, q_rope]`,
    /// `head_dim + v_head_dim` elements) scores `q . [c, r]`, and the output is the
    /// softmax-weighted sum of the latents (`head_dim` elements), for the caller to
    /// project with `W_UV`.
    pub latent: bool,
    /// A custom mask (tree attention for speculative decoding), combined with each
    /// row's `lo..hi`: a row sees a position only when both allow it.
    pub mask: Option<CustomMask<'a>>,
}

/// Where one sequence's keys and values (one layer) lie in a storage: position `p` of
/// KV head `h` has its key at element
/// `base + table[p / block_size] * block_stride + (p % block_size) * pos_stride + h * head_stride`
/// and its value at
/// `base + v_offset + table[..] * block_stride + (p % block_size) * v_pos_stride + h * v_head_stride`;
/// each head vector is contiguous.
#[derive(Clone, Copy, Debug)]
pub struct KvPages<'a> {
    /// Element 0 of the storage (host memory).
    pub data: *const u8,
    /// Storage dtype.
    pub dtype: DType,
    /// Block of each run of `block_size` positions.
    pub table: &'a [u32],
    /// Positions per table entry.
    pub block_size: usize,
    /// Elements between consecutive block ids.
    pub block_stride: usize,
    /// Element offset of block 0's key at position 0, head 0.
    pub base: usize,
    /// Elements from block 0's key at position 0, head 0 to its value.
    pub v_offset: usize,
    /// Elements between consecutive keys of a block.
    pub pos_stride: usize,
    /// Elements between consecutive KV heads' keys.
    pub head_stride: usize,
    /// Elements between consecutive values of a block.
    pub v_pos_stride: usize,
    /// Elements between consecutive KV heads' values.
    pub v_head_stride: usize,
    /// The scales of 8-bit storage.
    pub scales: Scales<'a>,
}

/// What multiplies the stored K/V elements: nothing (float storage), one scale per KV
/// head for K and for V (fp8), or one scale per stored chunk of `row_len` elements
/// (int8: a head vector, or a `gcd(head_dim, v_head_dim)` part of one).
#[derive(Clone, Copy, Debug)]
pub enum Scales<'a> {
    /// Elements are their own values.
    None,
    /// `k[head]` multiplies every key of the head, `v[head]` every value.
    PerHead {
        /// Key scales, one per KV head.
        k: &'a [f32],
        /// Value scales, one per KV head.
        v: &'a [f32],
    },
    /// The element at offset `at` has its scale at `ptr[at / row_len]` (host memory laid
    /// out like the storage, valid for the whole call); `row_len` divides every stored
    /// vector's length and offset.
    PerRow {
        /// Scale 0.
        ptr: *const f32,
        /// Elements per scale.
        row_len: usize,
    },
}

// SAFETY: a KvPages is a read-only description of storage the caller keeps alive (and
// unwritten) for the whole attention call, on every thread it runs on.
unsafe impl Send for KvPages<'_> {}
unsafe impl Sync for KvPages<'_> {}

impl KvPages<'_> {
    /// The scale of the head vector at element offset `at` (of KV head `head`; a value
    /// when `value`).
    #[inline(always)]
    fn scale(&self, at: usize, head: usize, value: bool) -> f32 {
        match self.scales {
            Scales::None => 1.0,
            Scales::PerHead { k, v } => {
                if value {
                    v[head]
                } else {
                    k[head]
                }
            }
            // SAFETY: the caller's contract ([`attend`]) makes the scales valid.
            Scales::PerRow { ptr, row_len } => unsafe { *ptr.add(at / row_len) },
        }
    }

    /// Element offset of the key at position `pos` of KV head `head`.
    fn key_offset(&self, pos: usize, head: usize) -> usize {
        let block = self.table[pos / self.block_size] as usize;
        self.base
            + block * self.block_stride
            + (pos % self.block_size) * self.pos_stride
            + head * self.head_stride
    }

    /// Element offset of the value at position `pos` of KV head `head`.
    fn value_offset(&self, pos: usize, head: usize) -> usize {
        let block = self.table[pos / self.block_size] as usize;
        self.base
            + self.v_offset
            + block * self.block_stride
            + (pos % self.block_size) * self.v_pos_stride
            + head * self.v_head_stride
    }

    /// The stored lengths of a key and a value for attention of `dims` (query and
    /// output lengths): a latent cache stores the output-sized latent as its key and the
    /// rest of the query's length as its value.
    fn stored_lens(dims: [usize; 2], latent: bool) -> (usize, usize) {
        if latent {
            (dims[1], dims[0] - dims[1])
        } else {
            (dims[0], dims[1])
        }
    }

    /// Elements of a stored vector of `len` elements that share one scale: `len`, or
    /// fewer for int8 storage whose scales cover chunks of the vectors (keys and values
    /// of different head sizes, a scale per `gcd(head_dim, v_head_dim)` elements).
    #[inline(always)]
    fn scale_chunk(&self, len: usize) -> usize {
        match self.scales {
            Scales::PerRow { row_len, .. } if row_len < len => row_len,
            _ => len.max(1),
        }
    }

    /// Whether keys and values share their strides (one head size).
    fn uniform(&self) -> bool {
        self.v_pos_stride == self.pos_stride && self.v_head_stride == self.head_stride
    }
}

/// One query token: its row in the query tensor, its position (for ALiBi) and the
/// positions `lo..hi` of its sequence it attends to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryRow {
    /// Index along the query tensor's first dimension.
    pub token: usize,
    /// Position of the token in its sequence.
    pub pos: usize,
    /// First visible position.
    pub lo: usize,
    /// One past the last visible position.
    pub hi: usize,
}

/// The query tokens of one sequence: `rows[rows]` of [`attend`]'s rows, read against
/// `kv`. Rows in increasing position order give the best tiles.
#[derive(Clone, Debug)]
pub struct SeqQueries<'a> {
    /// Where the sequence's K/V lie.
    pub kv: KvPages<'a>,
    /// Its rows in [`attend`]'s `rows`.
    pub rows: Range<usize>,
}

/// Sizes of a cache's heads: query heads come from the query tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvHeads {
    /// KV heads of the cache.
    pub num_kv_heads: usize,
    /// Elements per query and key vector.
    pub head_dim: usize,
    /// Elements per value and output vector.
    pub v_head_dim: usize,
}

impl KvHeads {
    /// The sizes attention works in: the cache's own, or for latent attention
    /// ([`AttnOptions::latent`]) queries of latent plus rotary part and outputs of the
    /// latent.
    pub fn attended(self, latent: bool) -> KvHeads {
        if latent {
            KvHeads {
                num_kv_heads: self.num_kv_heads,
                head_dim: self.head_dim + self.v_head_dim,
                v_head_dim: self.head_dim,
            }
        } else {
            self
        }
    }
}

/// Computes attention for `q` (`[n_tokens, num_q_heads, head_dim]`, any dtype and
/// strides, host memory) into `out` (`[n_tokens, num_q_heads, v_head_dim]`, C-contiguous,
/// any dtype; both sizes as [`KvHeads::attended`] gives them): each token
/// of `rows` attends over its sequence's positions `lo..hi`. Tokens no row names are
/// left untouched; a row with nothing to see gets zeros.
///
/// # Safety
/// Every `KvPages` describes host memory that holds, for every position a row names
/// and every KV head, a key of `head_dim` and a value of `v_head_dim` elements where its
/// formula says;
/// that memory stays valid and unwritten for the whole call. No token is named by two
/// rows (rayon's threads write each token's output row from the one item holding it).
pub unsafe fn attend(
    q: &TensorRef,
    out: &mut TensorMut,
    heads: KvHeads,
    rows: &[QueryRow],
    seqs: &[SeqQueries<'_>],
    opts: &AttnOptions<'_>,
) -> Result<()> {
    for (name, device) in [("q", q.device()), ("out", out.device())] {
        if device != Device::Cpu {
            return Err(KvError::Device(format!(
                "{name} lives on {device}; attention over a host cache takes host tensors"
            )));
        }
    }
    let heads = heads.attended(opts.latent);
    let (num_q_heads, scale) = validate(q, out, heads, opts)?;
    // Checked, not assumed: a token past `q` would be written past `out`'s end.
    for s in seqs {
        let tokens = q.shape()[0];
        let ok = rows
            .get(s.rows.clone())
            .is_some_and(|rs| rs.iter().all(|r| r.token < tokens && r.lo <= r.hi));
        if !ok {
            return Err(KvError::InvalidArgument {
                name: "rows",
                value: format!("{:?} of {} rows", s.rows, rows.len()),
                reason: format!("each row must name a token below {tokens} and lo <= hi"),
            });
        }
    }
    let out = out
        .share()
        .expect("a C-contiguous output (checked above) addresses each element once");
    schedule::run(&mut schedule::Problem {
        q,
        out,
        num_q_heads,
        heads,
        rows,
        seqs,
        scale,
        opts,
        partial: schedule::SharedF32::NONE,
    });
    Ok(())
}

/// Checks the shapes of `q` and `out` (on any device) and `opts` against a cache of
/// `heads`; returns the number of query heads and the scale.
pub fn validate(
    q: &TensorRef,
    out: &TensorMut,
    heads: KvHeads,
    opts: &AttnOptions<'_>,
) -> Result<(usize, f32)> {
    let num_q_heads = check_queries(q, out, heads)?;
    Ok((
        num_q_heads,
        check_options(opts, num_q_heads, heads.head_dim)?,
    ))
}

/// Checks `q` and `out` and returns the number of query heads.
fn check_queries(q: &TensorRef, out: &TensorMut, heads: KvHeads) -> Result<usize> {
    let s = q.shape();
    let hkv = heads.num_kv_heads;
    if s.len() != 3 || s[2] != heads.head_dim || s[1] == 0 || !s[1].is_multiple_of(hkv) {
        return Err(KvError::Shape {
            name: "q",
            got: s.to_vec(),
            expected: format!(
                "[n_tokens, num_q_heads, {}] with num_q_heads a positive multiple of num_kv_heads={hkv}",
                heads.head_dim
            ),
        });
    }
    out.expect_shape("out", &[s[0], s[1], heads.v_head_dim])?;
    if q.device() == out.device() && q.span().overlaps(&out.span()) {
        return Err(KvError::InvalidArgument {
            name: "out",
            value: "an array sharing memory with q".into(),
            reason: "must not overlap q (attention reads every query while it writes)".into(),
        });
    }
    let [a, b, c] = out.shape3();
    if out.strides3() != [(b * c) as isize, c as isize, 1] && a * b * c > 0 {
        return Err(KvError::InvalidArgument {
            name: "out",
            value: format!("strides {:?}", out.strides3()),
            reason: "must be C-contiguous".into(),
        });
    }
    Ok(s[1])
}

/// Checks the options against the heads and returns the scale.
fn check_options(opts: &AttnOptions<'_>, num_q_heads: usize, head_dim: usize) -> Result<f32> {
    let scale = opts.scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
    if !scale.is_finite() {
        return Err(invalid("scale", scale, "must be finite"));
    }
    if let Some(c) = opts.softcap {
        if !(c.is_finite() && c > 0.0) {
            return Err(invalid("softcap", c, "must be finite and > 0"));
        }
    }
    for (name, v) in [("sinks", opts.sinks), ("alibi_slopes", opts.alibi_slopes)] {
        if let Some(v) = v {
            if v.len() != num_q_heads {
                return Err(KvError::Shape {
                    name,
                    got: vec![v.len()],
                    expected: format!("[{num_q_heads}] (one per query head)"),
                });
            }
            if v.iter().any(|x| x.is_nan()) {
                return Err(invalid(name, f32::NAN, "must not contain NaN"));
            }
        }
    }
    Ok(scale)
}

fn invalid(name: &'static str, v: f32, reason: &str) -> KvError {
    KvError::InvalidArgument {
        name,
        value: v.to_string(),
        reason: reason.into(),
    }
}
