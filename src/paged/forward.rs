//! ollama's batched forward over many sequences: place a batch of tokens (each with its
//! sequence and position), write K/V per layer, read every sequence's history with a
//! mask that lets each token see exactly its own sequence up to its own position, commit.

use std::sync::atomic::{AtomicBool, Ordering};

use rustc_hash::{FxHashMap, FxHashSet};

use super::pool::{PoolCore, SeqId};
use crate::attention::CustomMask;
use crate::error::{check_tokens, KvError, Result};
use crate::layout::BlockId;
use crate::tensor::{check_disjoint, TensorMut, TensorRef};

/// A placed batch: which sequences it extends, where each token goes, and the blocks
/// its slots lie in with the generation each had when the batch was placed.
///
/// Every use of the plan ([`PoolCore::forward_write`], [`PoolCore::forward_get`],
/// [`PoolCore::forward_attention`], [`PoolCore::finish_forward`]) first checks that
/// those blocks still have those generations: a block changes generation whenever its
/// holders change (its sequence was freed, truncated past it or forked, the block was
/// reused or cached), and a stale plan then fails instead of writing or reading another
/// sequence's blocks. A plan also records each sequence's edit count
/// ([`super::SeqState::edits`]): one cut, shortened or replaced since is stale too.
///
/// The plan records which layers [`PoolCore::forward_write`] wrote: a batch is
/// committed with every layer written through it, or none (its K/V written by other
/// kernels through its slots), never with some layers left unwritten.
#[derive(Debug)]
pub struct ForwardPlan {
    /// `(sequence, first new position, new tokens)` in order of first appearance.
    pub seqs: Vec<(SeqId, usize, usize)>,
    /// For each token, its index in `seqs`.
    pub token_seq: Vec<usize>,
    /// For each token, its position in its sequence.
    pub positions: Vec<usize>,
    /// Each token's slot in the pool: one run of `n_tokens` slots per layer group.
    pub slots: Vec<i64>,
    /// For each token, its token id, when the caller gave them.
    pub tokens: Option<Vec<u32>>,
    /// For each token, the id the pool records for it: the one given, else the one its
    /// sequence already knows at that position (its prompt), else `None`.
    pub token_ids: Vec<Option<u32>>,
    /// The blocks the slots lie in, each once, with their generations at placement.
    blocks: Vec<(BlockId, u64)>,
    /// Each sequence's edit count at placement, in `seqs` order.
    edits: Vec<u64>,
    /// Which layers `forward_write` wrote.
    layers_put: Vec<AtomicBool>,
    /// Its positions are drafts ([`ForwardPlan::mark_draft`]).
    draft: AtomicBool,
}

impl PartialEq for ForwardPlan {
    /// Plans are equal when they place the same tokens in the same slots over the same
    /// blocks and have written the same layers.
    fn eq(&self, other: &Self) -> bool {
        self.seqs == other.seqs
            && self.token_seq == other.token_seq
            && self.positions == other.positions
            && self.slots == other.slots
            && self.tokens == other.tokens
            && self.token_ids == other.token_ids
            && self.blocks == other.blocks
            && self.edits == other.edits
            && self.layers_put().eq(other.layers_put())
            && self.is_draft() == other.is_draft()
    }
}

impl ForwardPlan {
    /// Tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.token_seq.len()
    }

    /// Layer groups (runs of slots).
    pub fn num_groups(&self) -> usize {
        self.slots.len().checked_div(self.num_tokens()).unwrap_or(0)
    }

    /// The tokens' slots in layer group `g`.
    pub fn group_slots(&self, g: usize) -> &[i64] {
        let n = self.num_tokens();
        &self.slots[g * n..(g + 1) * n]
    }

    /// FlashInfer's `qo_indptr`: where each sequence's tokens start in the batch (in
    /// `seqs` order), then the number of tokens; `None` unless each sequence's tokens are
    /// one contiguous run of the batch.
    pub fn qo_indptr(&self) -> Option<Vec<usize>> {
        let mut indptr = Vec::with_capacity(self.seqs.len() + 1);
        for (i, &s) in self.token_seq.iter().enumerate() {
            if s == indptr.len() {
                indptr.push(i);
            } else if s + 1 != indptr.len() {
                return None;
            }
        }
        indptr.push(self.num_tokens());
        Some(indptr)
    }

    /// The batch index of each sequence's last token (in `seqs` order): the rows a
    /// sampler reads.
    pub fn last_token_indices(&self) -> Vec<usize> {
        let mut last = vec![0; self.seqs.len()];
        for (i, &s) in self.token_seq.iter().enumerate() {
            last[s] = i;
        }
        last
    }

    /// Marks the batch's positions as drafts (speculative tokens, tree nodes):
    /// [`PoolCore::finish_forward`] commits them, but the prefix cache takes no block
    /// that holds one until `accept` keeps it ([`PoolCore::accept`]) . A batch that
    /// attends or reads with a custom mask is marked by that.
    pub fn mark_draft(&self) {
        self.draft.store(true, Ordering::Relaxed);
    }

    /// Whether the batch's positions are drafts ([`Self::mark_draft`]).
    pub fn is_draft(&self) -> bool {
        self.draft.load(Ordering::Relaxed)
    }

    /// The layers written through [`PoolCore::forward_write`] so far.
    pub fn layers_put(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.layers_put.len()).filter(|&l| self.layers_put[l].load(Ordering::Relaxed))
    }
}

impl PoolCore {
    /// Places a batch: token `i` belongs to sequence `token_seqs[i]` at `positions[i]`
    /// (`None`: each sequence continues where it ends, its tokens in batch order). The
    /// tokens of one sequence must continue it in order (its next position, then the one
    /// after...). `tokens` (one id per token) are recorded when the batch finishes, so
    /// the blocks it completes join the prefix cache. Reserves every slot, all or nothing.
    pub fn start_forward(
        &mut self,
        token_seqs: &[SeqId],
        positions: Option<&[i64]>,
        tokens: Option<&[u32]>,
    ) -> Result<ForwardPlan> {
        if let Some(p) = positions.filter(|p| p.len() != token_seqs.len()) {
            return Err(KvError::InvalidArgument {
                name: "positions",
                value: format!("{} entries", p.len()),
                reason: format!("needs one position per token ({})", token_seqs.len()),
            });
        }
        let mut seqs: Vec<(SeqId, usize, usize)> = Vec::new();
        let mut index: FxHashMap<SeqId, usize> = FxHashMap::default();
        let mut token_seq = Vec::with_capacity(token_seqs.len());
        let mut placed = Vec::with_capacity(token_seqs.len());
        for (i, &id) in token_seqs.iter().enumerate() {
            let k = match index.get(&id) {
                Some(&k) => k,
                None => {
                    seqs.push((id, self.seq(id)?.held(), 0));
                    index.insert(id, seqs.len() - 1);
                    seqs.len() - 1
                }
            };
            let expected = seqs[k].1 + seqs[k].2;
            let pos = positions.map_or(expected as i64, |p| p[i]);
            if pos != expected as i64 {
                return Err(KvError::InvalidArgument {
                    name: "positions",
                    value: pos.to_string(),
                    reason: format!("token {i} of sequence {id} must be at position {expected}, the next one in order"),
                });
            }
            seqs[k].2 += 1;
            token_seq.push(k);
            placed.push(expected);
        }
        if let Some(t) = tokens {
            if t.len() != token_seqs.len() {
                return Err(KvError::InvalidArgument {
                    name: "tokens",
                    value: format!("{} ids", t.len()),
                    reason: format!("needs one id per token ({})", token_seqs.len()),
                });
            }
            for (k, &(id, start, _)) in seqs.iter().enumerate() {
                Self::check_tokens(self.seq(id)?, id, start, &tokens_of(t, &token_seq, k))?;
            }
        }
        for &(id, start, _) in &seqs {
            let s = self.seq(id)?;
            for (g, t) in self.groups.groups.iter().zip(&s.tables) {
                if !self.window_held(g.kind, t, start) {
                    return Err(KvError::InvalidArgument {
                        name: "seqs",
                        value: format!("sequence {id}"),
                        reason: format!(
                            "cannot continue at position {start}: its {} layers hold positions from {} only, \
                             but a token there sees from {} (check can_resume(); recompute from an earlier position)",
                            g.kind,
                            t.start,
                            self.groups.attention.first_visible(g.kind, start)
                        ),
                    });
                }
            }
        }
        let ids: Vec<SeqId> = seqs.iter().map(|s| s.0).collect();
        let counts: Vec<i64> = seqs.iter().map(|s| s.2 as i64).collect();
        let by_seq = self.reserve(&ids, &counts)?;
        // `by_seq` lists, per group, each sequence's slots in turn; hand them out in token order.
        let n = token_seq.len();
        let mut first: Vec<usize> = Vec::with_capacity(seqs.len());
        let mut acc = 0;
        for s in &seqs {
            first.push(acc);
            acc += s.2;
        }
        let mut slots = Vec::with_capacity(by_seq.len());
        for row in by_seq.chunks_exact(n.max(1)) {
            let mut next = first.clone();
            slots.extend(token_seq.iter().map(|&k| {
                next[k] += 1;
                row[next[k] - 1]
            }));
        }
        let bs = self.shape.block_size;
        let mut seen = FxHashSet::default();
        let blocks = slots
            .iter()
            .map(|&slot| (slot as usize / bs) as BlockId)
            .filter(|&b| seen.insert(b))
            .map(|b| (b, self.blocks.generation(b)))
            .collect();
        let token_ids = (0..n)
            .map(|i| match tokens {
                Some(t) => Some(t[i]),
                None => {
                    let id = seqs[token_seq[i]].0;
                    self.seq(id).ok()?.tokens.get(placed[i]).copied()
                }
            })
            .collect();
        let edits = seqs
            .iter()
            .map(|&(id, _, _)| Ok(self.seq(id)?.edits))
            .collect::<Result<_>>()?;
        let layers_put = (0..self.shape.num_layers)
            .map(|_| AtomicBool::new(false))
            .collect();
        Ok(ForwardPlan {
            seqs,
            token_seq,
            positions: placed,
            slots,
            tokens: tokens.map(<[u32]>::to_vec),
            token_ids,
            blocks,
            edits,
            layers_put,
            draft: AtomicBool::new(false),
        })
    }

    /// Fails unless every block `plan` writes still has the generation it had when the
    /// plan was placed (see [`ForwardPlan`]).
    pub fn check_plan(&self, plan: &ForwardPlan) -> Result<()> {
        let stale = |what: String| KvError::InvalidArgument {
            name: "batch",
            value: format!("a batch of {} tokens", plan.num_tokens()),
            reason: format!("is stale: {what} since start_forward; start a new batch"),
        };
        for &(id, _, _) in &plan.seqs {
            // A plan of another pool names sequences this pool never had.
            self.check_owner(id)?;
        }
        if let Some(&(id, _, _)) = plan.seqs.iter().find(|&&(id, _, _)| !self.is_live(id)) {
            return Err(stale(format!("its sequence {id} was freed")));
        }
        if let Some((&(id, _, _), _)) = plan
            .seqs
            .iter()
            .zip(&plan.edits)
            .find(|&(&(id, _, _), &e)| self.seq(id).map_or(true, |s| s.edits != e))
        {
            return Err(stale(format!(
                "its sequence {id} was cut or replaced (truncate, remove, set_seq_len, copy_prefix)"
            )));
        }
        if let Some(&(b, _)) = plan
            .blocks
            .iter()
            .find(|&&(b, g)| self.blocks.generation(b) != g)
        {
            return Err(stale(format!(
                "block {b} it writes changed holder (a sequence of the batch was truncated, \
                 forked or committed)"
            )));
        }
        Ok(())
    }

    /// Writes `layer`'s K and V (`[n_tokens, heads, head_dim]`) for a placed batch's
    /// tokens, into the slots it reserved.
    pub fn forward_write(
        &mut self,
        plan: &ForwardPlan,
        layer: i64,
        k: &TensorRef,
        v: &TensorRef,
    ) -> Result<()> {
        self.check_plan(plan)?;
        let g = self.group_for(Some(layer))?;
        let sh = self.shape;
        for (name, t, dim) in [("k", k, sh.head_dim), ("v", v, sh.v_head_dim)] {
            let n = check_tokens(name, t.shape(), sh.num_kv_heads, dim)?;
            check_batch_tokens(name, n, plan, [sh.num_kv_heads, dim])?;
        }
        self.write(layer, k, v, plan.group_slots(g))?;
        plan.layers_put[layer as usize].store(true, Ordering::Relaxed);
        Ok(())
    }

    /// [`Self::forward_write`] of every layer at once (`k[l]`, `v[l]`: layer `l`'s rows,
    /// one entry per layer): one launch on a CUDA pool.
    pub fn forward_write_layers(
        &mut self,
        plan: &ForwardPlan,
        k: &[TensorRef],
        v: &[TensorRef],
    ) -> Result<()> {
        self.check_plan(plan)?;
        let sh = self.shape;
        for (name, x, dim) in [("k", k, sh.head_dim), ("v", v, sh.v_head_dim)] {
            for t in x {
                let n = check_tokens(name, t.shape(), sh.num_kv_heads, dim)?;
                check_batch_tokens(name, n, plan, [sh.num_kv_heads, dim])?;
            }
        }
        self.write_layers(k, v, &plan.slots)?;
        for put in &plan.layers_put {
            put.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Positions of `layer`'s history that [`Self::forward_get`] returns: what each
    /// sequence of the batch holds in that layer, old and new tokens, concatenated in
    /// `seqs` order.
    pub fn forward_history_len(&self, plan: &ForwardPlan, layer: i64) -> Result<usize> {
        self.check_plan(plan)?;
        let layer = crate::error::check_index("layer", layer, self.shape().num_layers)?;
        let g = self.groups.group_of[layer];
        plan.seqs
            .iter()
            .map(|&(id, start, count)| {
                Ok((start + count).saturating_sub(self.seq(id)?.tables[g].start))
            })
            .sum()
    }

    /// Reads `layer`'s history for a placed batch into `k_out`, `v_out`
    /// (`[heads, history_len, head_dim]`) and `mask` (`[n_tokens, history_len]`, 0 where
    /// a token may attend under the layer's rule (causal, window or chunk), `-inf`
    /// elsewhere).
    pub fn forward_get(
        &self,
        plan: &ForwardPlan,
        layer: i64,
        k_out: &mut TensorMut,
        v_out: &mut TensorMut,
        mask: &mut [f32],
    ) -> Result<()> {
        self.forward_get_masked(plan, layer, k_out, v_out, mask, None)
    }

    /// [`Self::forward_get`] with a custom mask ([`ForwardPlan::custom_mask`]) combined
    /// into `mask`: a position is 0 only where the layer's rule and `custom` both allow it.
    pub fn forward_get_masked(
        &self,
        plan: &ForwardPlan,
        layer: i64,
        k_out: &mut TensorMut,
        v_out: &mut TensorMut,
        mask: &mut [f32],
        custom: Option<&CustomMask<'_>>,
    ) -> Result<()> {
        let sh = self.shape();
        let history = self.forward_history_len(plan, layer)?;
        check_disjoint(("k_out", k_out), ("v_out", v_out))?;
        let layer = layer as usize;
        let (g, kind) = (self.groups.group_of[layer], self.groups.kind(layer));
        for (name, out, d) in [
            ("k_out", &*k_out, sh.head_dim),
            ("v_out", &*v_out, sh.v_head_dim),
        ] {
            out.expect_shape(name, &[sh.num_kv_heads, history, d])?;
        }
        if mask.len() != plan.num_tokens() * history {
            return Err(KvError::Shape {
                name: "mask",
                got: vec![mask.len()],
                expected: format!("[{} * {history}]", plan.num_tokens()),
            });
        }
        let mut offsets = Vec::with_capacity(plan.seqs.len());
        let mut off = 0;
        for &(id, start, count) in &plan.seqs {
            let s = self.seq(id)?;
            if s.layer_len[layer] < start + count {
                return Err(KvError::InvalidArgument {
                    name: "seq",
                    value: format!("sequence {id}"),
                    reason: format!(
                        "was cut to {} positions during the forward",
                        s.layer_len[layer]
                    ),
                });
            }
            let t = &s.tables[g];
            let len = start + count - t.start;
            self.read_positions(
                &t.blocks,
                layer,
                t.start,
                len,
                &mut k_out.slice(1, off, len),
                &mut v_out.slice(1, off, len),
            )?;
            offsets.push((off, t.start));
            off += len;
        }
        mask.fill(f32::NEG_INFINITY);
        for (t, (&k, &pos)) in plan.token_seq.iter().zip(&plan.positions).enumerate() {
            let (off, held_from) = offsets[k];
            let lo = self
                .groups
                .attention
                .first_visible(kind, pos)
                .max(held_from);
            let row = &mut mask[t * history..(t + 1) * history];
            for (p, x) in (lo..=pos).zip(&mut row[off + lo - held_from..off + pos - held_from + 1])
            {
                if custom.is_none_or(|c| c.allows(t, p)) {
                    *x = 0.0;
                }
            }
        }
        Ok(())
    }

    /// Commits a placed batch: each sequence's committed length moves to the end of its
    /// new tokens (committing any earlier uncommitted positions the batch built on).
    /// Refused when [`Self::forward_write`] wrote some layers but not all: the blocks
    /// the batch completes would be cached with K/V nobody wrote.
    pub fn finish_forward(&mut self, plan: &ForwardPlan) -> Result<()> {
        self.check_plan(plan)?;
        let put = plan.layers_put().count();
        if put > 0 && put < plan.layers_put.len() {
            let missing: Vec<usize> = (0..plan.layers_put.len())
                .filter(|&l| !plan.layers_put[l].load(Ordering::Relaxed))
                .collect();
            return Err(KvError::InvalidArgument {
                name: "batch",
                value: format!("a batch of {} tokens", plan.num_tokens()),
                reason: format!(
                    "put {put} of {} layers; layers {missing:?} were never put: put them, or cancel",
                    plan.layers_put.len()
                ),
            });
        }
        for &(id, start, count) in &plan.seqs {
            let s = self.seq(id)?;
            if s.seq_len > start || s.layer_len.iter().any(|&l| l < start + count) {
                return Err(KvError::InvalidArgument {
                    name: "seq",
                    value: format!("sequence {id}"),
                    reason: "changed since start_forward (truncated or committed); cannot commit the batch".into(),
                });
            }
        }
        for (k, &(id, start, count)) in plan.seqs.iter().enumerate() {
            if plan.is_draft() {
                // Drafts stay out of the prefix cache until accepted.
                let s = self.seq_mut(id);
                s.cache_limit = s.cache_limit.min(start);
            }
            if let Some(t) = &plan.tokens {
                self.record_tokens(id, start, &tokens_of(t, &plan.token_seq, k));
            }
            let s = self.seq(id)?;
            self.advance(id, (start + count - s.seq_len) as i64, None)?;
        }
        Ok(())
    }

    /// Abandons a placed batch: each sequence drops the positions the batch reserved
    /// (and any appended after them), unless it was freed, edited or committed past
    /// them since: a stale plan never cuts what others wrote.
    pub fn cancel_forward(&mut self, plan: &ForwardPlan) {
        for (&(id, start, _), &edits) in plan.seqs.iter().zip(&plan.edits) {
            let untouched = self
                .seq(id)
                .is_ok_and(|s| s.edits == edits && s.seq_len <= start);
            if untouched {
                self.cut_to(id, start, false);
            }
        }
    }
}

/// The ids of the batch tokens that belong to the `k`-th sequence, in batch order.
fn tokens_of(tokens: &[u32], token_seq: &[usize], k: usize) -> Vec<u32> {
    tokens
        .iter()
        .zip(token_seq)
        .filter(|(_, &j)| j == k)
        .map(|(&t, _)| t)
        .collect()
}

/// Fails unless `name` (`[n, heads, dim]`) holds one row per token of the batch of `plan`:
/// the error names the argument and both counts (not the slot mapping they are written at).
fn check_batch_tokens(
    name: &'static str,
    n: usize,
    plan: &ForwardPlan,
    dims: [usize; 2],
) -> Result<()> {
    let want = plan.num_tokens();
    if n == want {
        return Ok(());
    }
    Err(KvError::Shape {
        name,
        got: vec![n, dims[0], dims[1]],
        expected: format!(
            "[{want}, {}, {}]: the batch has {want} tokens (start_forward placed them) and {name} holds {n}",
            dims[0], dims[1]
        ),
    })
}
