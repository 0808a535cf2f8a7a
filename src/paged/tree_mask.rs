//! Custom masks of a placed batch (tree attention for speculative decoding), in
//! FlashInfer's conventions: sequence `k` of the batch (in order of first appearance)
//! has `q_len[k]` query tokens (its tokens in batch order) and a KV length `kv_len[k]`
//! (its positions through its last batch token, `start + count`); its mask is the
//! row-major `[q_len[k], kv_len[k]]` boolean matrix, True = may attend, and the batch's
//! mask is these matrices flattened and concatenated. The packed form packs each
//! sequence's matrix alone in little bit order, padded to whole bytes
//! ([`crate::attention::segment_packbits`]). Either way the mask is combined with the
//! layer's causal and window rule: a token never sees a position past its own.

use super::forward::ForwardPlan;
use crate::attention::{segment_packbits, CustomMask};
use crate::error::{KvError, Result};

/// A custom mask as the caller gives it.
#[derive(Clone, Copy, Debug)]
pub enum MaskInput<'a> {
    /// FlashInfer's `custom_mask`: one bool per (query token, key position).
    Flat(&'a [bool]),
    /// FlashInfer's `packed_custom_mask`: each sequence's bits packed alone.
    Packed(&'a [u8]),
}

/// A batch's custom mask, packed, with each batch token's row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanMask {
    bits: Vec<u8>,
    row_bit: Vec<usize>,
}

impl PlanMask {
    /// The mask as the attention kernels read it.
    pub fn as_custom(&self) -> CustomMask<'_> {
        CustomMask {
            bits: &self.bits,
            row_bit: &self.row_bit,
        }
    }
}

impl ForwardPlan {
    /// Each sequence's `(q_len, kv_len)`, in `seqs` order.
    pub fn mask_dims(&self) -> Vec<(usize, usize)> {
        self.seqs
            .iter()
            .map(|&(_, start, count)| (count, start + count))
            .collect()
    }

    /// Checks `input` against the batch's sizes and packs it; a mask of the wrong
    /// length is an error naming the expected one.
    pub fn custom_mask(&self, input: MaskInput<'_>) -> Result<PlanMask> {
        let dims = self.mask_dims();
        let mut indptr = Vec::with_capacity(dims.len() + 1);
        indptr.push(0);
        for &(q, kv) in &dims {
            indptr.push(indptr.last().copied().unwrap_or(0) + q * kv);
        }
        let terms = || {
            let parts: Vec<String> = dims.iter().map(|(q, kv)| format!("{q}*{kv}")).collect();
            parts.join(" + ")
        };
        let (bits, byte_start) = match input {
            MaskInput::Flat(flat) => {
                let want = indptr[dims.len()];
                if flat.len() != want {
                    return Err(KvError::Shape {
                        name: "custom_mask",
                        got: vec![flat.len()],
                        expected: format!(
                            "[{want}] booleans: each sequence's query tokens x KV length \
                             (q_len * kv_len per sequence, in batch order: {})",
                            terms()
                        ),
                    });
                }
                segment_packbits(flat, &indptr)
            }
            MaskInput::Packed(bytes) => {
                let mut starts = Vec::with_capacity(dims.len() + 1);
                starts.push(0);
                for &(q, kv) in &dims {
                    starts.push(starts.last().copied().unwrap_or(0) + (q * kv).div_ceil(8));
                }
                let want = starts[dims.len()];
                if bytes.len() != want {
                    return Err(KvError::Shape {
                        name: "packed_custom_mask",
                        got: vec![bytes.len()],
                        expected: format!(
                            "[{want}] uint8: each sequence's q_len * kv_len bits packed alone, \
                             little bit order, padded to whole bytes (FlashInfer's \
                             segment_packbits(mask, indptr, bitorder='little'); ceil(({}) / 8) \
                             per sequence)",
                            terms().replace(" + ", ")/8 + ceil((")
                        ),
                    });
                }
                (bytes.to_vec(), starts)
            }
        };
        // Each token's row: its index among its sequence's tokens, in batch order.
        let mut seen = vec![0usize; dims.len()];
        let row_bit = self
            .token_seq
            .iter()
            .map(|&k| {
                let i = seen[k];
                seen[k] += 1;
                byte_start[k] * 8 + i * dims[k].1
            })
            .collect();
        self.mark_draft();
        Ok(PlanMask { bits, row_bit })
    }
}
