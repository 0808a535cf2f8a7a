//! Committing the accepted path of speculative decoding: `accept(start, keep)` keeps
//! the draft positions `start + keep[i]`, moved down to `start + i` in every layer, and
//! cuts the rest (SGLang's EAGLE verify for trees; a plain cut for chains).
//!
//! Semantics, for a sequence whose positions from `start` on are drafts written by a
//! forward (committed by its batch's `finish`, or not yet committed):
//! - positions before `start` must be committed, and every layer must hold the largest
//!   kept position;
//! - afterwards every layer holds `start + keep.len()` positions; what was committed
//!   stays committed (the committed length becomes `min(seq_len, start + keep.len())`)
//!   and what was not stays uncommitted, for the caller to commit with the accepted
//!   token ids (`advance`);
//! - the token ids the sequence knows move with their positions, and the blocks of the
//!   accepted positions join the prefix cache when full (a draft batch kept them out);
//! - the moved K/V are rewritten through the storage (8-bit pools re-quantize them with
//!   fresh scales), into private blocks (shared or cached blocks are copied first), with
//!   their writes recorded in the block ledger; cut positions are released as a
//!   truncate releases them, so a later holder of a block reads zeros or its own K/V;
//! - a pool with state layers (hybrid models) restores the state checkpoint at the new
//!   length when positions are cut, as a truncate does, and refuses a length with no
//!   checkpoint (the caller truncates to a checkpoint before the drafts and runs the
//!   accepted tokens again).
//!
//! All or nothing: a refusal (bad arguments, no room for copies, no checkpoint)
//! changes nothing.

use super::checkpointing::Chain;
use super::pool::{PoolCore, SeqId};
use crate::error::{check_count, KvError, Result};
use crate::tensor::{TensorMut, TensorRef};

impl PoolCore {
    /// Keeps positions `start + keep[i]` of sequence `id` at `start + i` (in every
    /// layer) and cuts the rest; see the module documentation for the exact rules.
    pub fn accept(&mut self, id: SeqId, start: i64, keep: &[i64]) -> Result<()> {
        let start = check_count("start", start)?;
        let keep = self.check_accept(id, start, keep)?;
        let n = keep.len();
        let new_len = start + n;
        let bs = self.shape.block_size;
        // Positions below `from` stay where they are.
        let first = (0..n).find(|&i| keep[i] != i).unwrap_or(n);
        let from = start + first;
        let s = self.seq(id)?;
        // The token ids and hash chain the sequence is left with: a state checkpoint is
        // restored for those ids, not for the ones the drafts had there.
        let tokens = accepted_tokens(&s.tokens, start, &keep, first);
        let cache_limit = if s.cache_limit >= start {
            // The kept positions are what the model computes for their tokens.
            usize::MAX
        } else {
            s.cache_limit
        };
        let chain = Chain {
            root: s.root,
            extra: &s.extra,
            tokens: &tokens,
            hashes: &s.hashes[..s.hashes.len().min(from / bs)],
            cache_limit,
        };
        let restore = self.restore_to(id, &chain, new_len, "accept")?;
        self.ensure_room(self.blocks_needed(s, from, new_len), || {
            format!("accepting {n} draft positions of sequence {id} (copies of shared blocks)")
        })?;
        if from < new_len {
            self.prepare_write(id, from, new_len);
            self.move_kept(id, start, &keep[first..], from)?;
        }
        let s = self.seq_mut(id);
        s.tokens = tokens;
        s.hashes.truncate(from / bs);
        s.cache_limit = cache_limit;
        self.cut_to(id, new_len, false);
        self.apply_restore(id, restore);
        self.drop_stale_checkpoints(id);
        self.register_blocks(id);
        Ok(())
    }

    /// Checks `accept`'s arguments against sequence `id`; returns `keep` as offsets.
    fn check_accept(&self, id: SeqId, start: usize, keep: &[i64]) -> Result<Vec<usize>> {
        let s = self.seq(id)?;
        if start > s.seq_len {
            return Err(KvError::InvalidArgument {
                name: "start",
                value: start.to_string(),
                reason: format!(
                    "sequence {id} commits {} positions; the drafts must start at or before its \
                     committed length (commit the tokens before them first)",
                    s.seq_len
                ),
            });
        }
        let held = s.layer_len.iter().copied().min().unwrap_or(0);
        let mut out = Vec::with_capacity(keep.len());
        for (i, &k) in keep.iter().enumerate() {
            let bad = |reason: String| KvError::InvalidArgument {
                name: "keep",
                value: format!("keep[{i}] = {k}"),
                reason,
            };
            if k < 0 || out.last().is_some_and(|&p: &usize| k as usize <= p) {
                return Err(bad(
                    "keep must be strictly increasing offsets from start, each >= 0".into(),
                ));
            }
            if start + k as usize >= held {
                return Err(bad(format!(
                    "position {} is past what every layer of sequence {id} holds ({held}): keep \
                     offsets must be below {}",
                    start + k as usize,
                    held.saturating_sub(start)
                )));
            }
            if start + i < s.seq_len && start + k as usize >= s.seq_len {
                return Err(bad(format!(
                    "position {} of sequence {id} is not committed, and would move to \
                     committed position {}: a committed position must hold committed K/V \
                     (commit the drafts first, or accept from the committed length {})",
                    start + k as usize,
                    start + i,
                    s.seq_len
                )));
            }
            out.push(k as usize);
        }
        if let Some(t) = s.tables.iter().find(|t| t.start > start) {
            return Err(KvError::InvalidArgument {
                name: "start",
                value: start.to_string(),
                reason: format!(
                    "sequence {id}'s sliding-window layers hold positions from {} only; accept \
                     drafts at or after it",
                    t.start
                ),
            });
        }
        Ok(out)
    }

    /// Rewrites, in every layer, positions `start + keep[j]` at `from + j` (the
    /// destination blocks are private), through float32 one layer at a time.
    fn move_kept(&mut self, id: SeqId, start: usize, keep: &[usize], from: usize) -> Result<()> {
        let sh = self.shape;
        let (h, d, dv, m) = (sh.num_kv_heads, sh.head_dim, sh.v_head_dim, keep.len());
        let (mut k, mut v) = (vec![0f32; h * m * d], vec![0f32; h * m * dv]);
        for layer in 0..sh.num_layers {
            let g = self.groups.group_of[layer];
            let blocks = self.seq(id)?.tables[g].blocks.clone();
            {
                let mut kt = TensorMut::from_f32_mut(&mut k, &[h, m, d])?;
                let mut vt = TensorMut::from_f32_mut(&mut v, &[h, m, dv])?;
                // Runs of consecutive kept positions, one read each.
                let mut j = 0;
                while j < m {
                    let mut run = 1;
                    while j + run < m && keep[j + run] == keep[j] + run {
                        run += 1;
                    }
                    self.read_positions(
                        &blocks,
                        layer,
                        start + keep[j],
                        run,
                        &mut kt.slice(1, j, run),
                        &mut vt.slice(1, j, run),
                    )?;
                    j += run;
                }
            }
            self.write_positions(
                &blocks,
                layer,
                from,
                &TensorRef::from_f32(&k, &[h, m, d])?.transposed(0, 1),
                &TensorRef::from_f32(&v, &[h, m, dv])?.transposed(0, 1),
            )?;
        }
        Ok(())
    }
}

/// The token ids a sequence knows after `accept(start, keep)` (offsets from `first` on
/// move): ids follow their positions, and an unknown one ends what is known.
fn accepted_tokens(tokens: &[u32], start: usize, keep: &[usize], first: usize) -> Vec<u32> {
    let n = keep.len();
    let mut out = tokens.to_vec();
    if first == n {
        out.truncate((start + n).min(tokens.len()));
        return out;
    }
    let mut known = start + first;
    for (i, &k) in keep.iter().enumerate().skip(first) {
        match tokens.get(start + k) {
            Some(&t) => {
                out[start + i] = t;
                known = start + i + 1;
            }
            None => break,
        }
    }
    out.truncate(known);
    out
}
