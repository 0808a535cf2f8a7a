//! Attention over a pool's blocks, read in place through each sequence's block table:
//! for a placed batch (ragged: prefill chunks and decode tokens of many sequences in one
//! call) and for the newest tokens of one sequence. The window of each token follows
//! the layer's kind (Hugging Face semantics): full layers see `0..=p`, sliding layers
//! the `W` most recent positions, chunked layers the start of `p`'s chunk to `p`.

use std::ops::Range;

use super::forward::ForwardPlan;
use super::pool::{PoolCore, SeqId};
use super::seq::{SeqState, Table};
use crate::attention::{self, AttnOptions, KvHeads, KvPages, QueryRow, SeqQueries};
use crate::error::{check_index, KvError, Result};
use crate::layout::Kv;
use crate::scales::attention_scales;
use crate::storage::cuda::attention::DeviceRow;
use crate::storage::PagedTensor;
use crate::tensor::{TensorMut, TensorRef};

impl PoolCore {
    /// Attention of a placed batch's tokens over `layer`, after `layer`'s K/V were
    /// written for the batch: `q` is `[n_tokens, num_q_heads, head_dim]` in batch
    /// order, `out` the same shape (C-contiguous). Each token attends only to its own
    /// sequence, up to its own position, within the layer's window.
    pub fn forward_attention(
        &self,
        plan: &ForwardPlan,
        layer: i64,
        q: &TensorRef,
        out: &mut TensorMut,
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        self.check_plan(plan)?;
        let layer = check_index("layer", layer, self.shape.num_layers)?;
        let n = plan.num_tokens();
        if q.shape().first() != Some(&n) {
            return Err(KvError::Shape {
                name: "q",
                got: q.shape().to_vec(),
                expected: format!(
                    "[{n}, num_q_heads, {}] (one row per batch token)",
                    self.shape.head_dim
                ),
            });
        }
        let g = self.groups.group_of[layer];
        // Rows grouped by sequence, each group in batch order (increasing positions).
        let mut first = Vec::with_capacity(plan.seqs.len() + 1);
        let mut acc = 0;
        for &(_, _, count) in &plan.seqs {
            first.push(acc);
            acc += count;
        }
        let mut states: Vec<&SeqState> = Vec::with_capacity(plan.seqs.len());
        for &(id, start, count) in &plan.seqs {
            let s = self.seq(id)?;
            if s.layer_len[layer] < start + count {
                return Err(KvError::InvalidArgument {
                    name: "layer",
                    value: layer.to_string(),
                    reason: format!(
                        "sequence {id} holds {} positions of this layer but the batch reaches {}: \
                         it was cut since start_forward",
                        s.layer_len[layer],
                        start + count
                    ),
                });
            }
            states.push(s);
        }
        let mut rows = vec![
            QueryRow {
                token: 0,
                pos: 0,
                lo: 0,
                hi: 0
            };
            n
        ];
        let mut next = first.clone();
        for (token, (&k, &pos)) in plan.token_seq.iter().zip(&plan.positions).enumerate() {
            rows[next[k]] = self.row(layer, &states[k].tables[g], token, pos);
            next[k] += 1;
        }
        let spans: Vec<(&Table, Range<usize>)> = states
            .iter()
            .enumerate()
            .map(|(k, s)| (&s.tables[g], first[k]..first[k] + plan.seqs[k].2))
            .collect();
        self.attend_spans(layer, q, out, &rows, &spans, opts)
    }

    /// Attention of sequence `id`'s last `n` positions in `layer` (`q`: `[n,
    /// num_q_heads, head_dim]`, the queries of the tokens just appended) over what the
    /// layer holds, within the layer's window; writes `out`.
    pub fn seq_attention(
        &self,
        id: SeqId,
        layer: i64,
        q: &TensorRef,
        out: &mut TensorMut,
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        let layer = check_index("layer", layer, self.shape.num_layers)?;
        let s = self.seq(id)?;
        let table = &s.tables[self.groups.group_of[layer]];
        let end = s.layer_len[layer];
        let n = q.shape().first().copied().unwrap_or(0);
        if q.shape().len() == 3 && n > end - table.start.min(end) {
            return Err(KvError::Shape {
                name: "q",
                got: q.shape().to_vec(),
                expected: format!(
                    "at most {} query tokens: layer {layer} of sequence {id} holds positions {}..{end}",
                    end - table.start.min(end),
                    table.start
                ),
            });
        }
        let rows: Vec<QueryRow> = (end - n.min(end)..end)
            .enumerate()
            .map(|(token, pos)| self.row(layer, table, token, pos))
            .collect();
        self.attend_spans(layer, q, out, &rows, &[(table, 0..rows.len())], opts)
    }

    /// Attention of `rows`, each span of them read through its table, on the host
    /// (the attention core) or on the pool's CUDA device (one kernel launch).
    fn attend_spans(
        &self,
        layer: usize,
        q: &TensorRef,
        out: &mut TensorMut,
        rows: &[QueryRow],
        spans: &[(&Table, Range<usize>)],
        opts: &AttnOptions<'_>,
    ) -> Result<()> {
        let Some(cuda) = self.storage.as_cuda() else {
            let seqs: Vec<SeqQueries<'_>> = spans
                .iter()
                .map(|(table, rows)| SeqQueries {
                    kv: self.kv_pages(table, layer),
                    rows: rows.clone(),
                })
                .collect();
            // SAFETY: the pages are this pool's host storage, borrowed for the call; each
            // row sees only positions its sequence's table holds (`row` starts at the
            // table's first held position and ends at the token itself).
            return unsafe { attention::attend(q, out, self.kv_heads(), rows, &seqs, opts) };
        };
        if opts.mask.is_some() {
            return Err(KvError::NotSupported(
                "custom_mask / packed_custom_mask (tree attention) on a CUDA pool: the CUDA \
                 attention kernels apply causal and window ranges only; run tree \
                 verification on a host pool (device='cpu'), or read the K/V and the dense \
                 mask with ForwardBatch.get(layer, custom_mask=...) for your own kernel"
                    .into(),
            ));
        }
        let heads = self.kv_heads().attended(opts.latent);
        let (_, scale) = attention::validate(q, out, heads, opts)?;
        let mut tables: Vec<u32> = Vec::new();
        let mut device_rows: Vec<DeviceRow> = Vec::with_capacity(rows.len());
        for (table, span) in spans {
            let at = tables.len() as i64;
            tables.extend_from_slice(&table.blocks);
            device_rows.extend(
                rows[span.clone()]
                    .iter()
                    .map(|r| [r.token as i64, at, r.pos as i64, r.lo as i64, r.hi as i64]),
            );
        }
        let t = PagedTensor {
            shape: self.shape,
            index: self.tensor_of(layer),
        };
        let head_scales = [
            self.scales.heads(layer, Kv::Key),
            self.scales.heads(layer, Kv::Value),
        ];
        cuda.paged_attention(t, q, out, &tables, &device_rows, scale, opts, head_scales)
    }

    /// The row of a token at `pos` of `layer`: from its window's first position (or the
    /// first the table holds) through itself.
    fn row(&self, layer: usize, table: &Table, token: usize, pos: usize) -> QueryRow {
        let kind = self.groups.kind(layer);
        let lo = self
            .groups
            .attention
            .first_visible(kind, pos)
            .max(table.start);
        QueryRow {
            token,
            pos,
            lo,
            hi: pos + 1,
        }
    }

    /// Where `layer`'s K/V lie for one of its group's tables.
    fn kv_pages<'a>(&'a self, table: &'a Table, layer: usize) -> KvPages<'a> {
        let sh = self.shape;
        let (k, v) = (
            sh.positions(0, Kv::Key, 0, 0, 1),
            sh.positions(0, Kv::Value, 0, 0, 1),
        );
        KvPages {
            data: self.storage.data_ptr(),
            dtype: self.dtype(),
            table: &table.blocks,
            block_size: sh.block_size,
            block_stride: sh.block_elems(),
            base: self.tensor_of(layer) * sh.layer_elems(),
            v_offset: v.offset - k.offset,
            pos_stride: k.strides[0],
            head_stride: k.strides[1],
            v_pos_stride: v.strides[0],
            v_head_stride: v.strides[1],
            scales: attention_scales(self.storage.as_ref(), &self.scales, layer),
        }
    }

    fn kv_heads(&self) -> KvHeads {
        KvHeads {
            num_kv_heads: self.shape.num_kv_heads,
            head_dim: self.shape.head_dim,
            v_head_dim: self.shape.v_head_dim,
        }
    }
}
