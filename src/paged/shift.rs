//! Position edits on a pool's sequences: llama.cpp's `seq_rm` (tail or middle removal)
//! and `seq_add` (a position shift), re-rotating moved keys with the pool's RoPE.

use super::pool::{PoolCore, SeqId};
use crate::error::{check_count, KvError, Result};
use crate::rope::Rope;
use crate::tensor::{TensorMut, TensorRef};

impl PoolCore {
    /// llama.cpp's `seq_rm`: removes positions `[begin, end)` (`end = None`: to the end).
    /// Removing a tail cuts the sequence; removing a span in the middle moves later
    /// positions down and re-rotates their keys, which needs the pool's RoPE
    /// (else `NotSupported`, and nothing changes).
    pub fn remove(&mut self, id: SeqId, begin: i64, end: Option<i64>) -> Result<()> {
        let begin = check_count("begin", begin)?;
        let end = match end {
            None => usize::MAX,
            Some(e) => check_count("end", e)?,
        };
        let held = self.seq(id)?.held();
        if begin >= end || begin >= held {
            return Ok(());
        }
        if end < held {
            self.check_state_kept(id, begin, "remove")?;
            let rope = self.rope_for(|| {
                format!(
                    "removing positions [{begin}, {end}) from the middle of a sequence of {held}"
                )
            })?;
            return self.remove_span(id, begin, end, rope);
        }
        let restore = self.restore_for(id, begin, "remove")?;
        self.cut_to(id, begin, true);
        self.apply_restore(id, restore);
        Ok(())
    }

    /// llama.cpp's `seq_add`: positions `[p0, p1)` move by `delta` (`p1 = None`: to the
    /// end) and their keys are re-rotated. kvrs keeps a sequence's positions dense, so only
    /// a tail moves, and only down: the positions it lands on are replaced and positions
    /// that would fall below 0 are removed. That is `remove(max(0, p0 + delta),
    /// max(p0, -delta))`. A shift up, or of a span that is not the tail, would leave a gap
    /// or an overlap: `NotSupported`.
    pub fn shift(&mut self, id: SeqId, p0: i64, p1: Option<i64>, delta: i64) -> Result<()> {
        let p0 = check_count("p0", p0)?;
        let p1 = match p1 {
            None => usize::MAX,
            Some(e) => check_count("p1", e)?,
        };
        let held = self.seq(id)?.held();
        if delta == 0 || p0 >= p1 || p0 >= held {
            return Ok(());
        }
        if p1 < held {
            return Err(KvError::NotSupported(format!(
                "shifting positions [{p0}, {p1}) of a sequence of {held} would overlap or leave a gap: \
                 kvrs keeps positions dense, so only a tail moves (p1=None)"
            )));
        }
        if delta > 0 {
            return Err(KvError::NotSupported(format!(
                "shifting positions from {p0} up by {delta} would leave a gap: kvrs keeps positions dense, \
                 so a tail only moves down (delta < 0)"
            )));
        }
        let down = delta.unsigned_abs() as usize;
        let (begin, end) = (p0.saturating_sub(down), p0.max(down));
        self.check_state_kept(id, begin, "shift")?;
        if end >= held {
            self.cut_to(id, begin, true);
            return Ok(());
        }
        let rope = self.rope_for(|| format!("shifting positions from {p0} by {delta}"))?;
        self.remove_span(id, begin, end, rope)
    }

    fn rope_for(&self, what: impl FnOnce() -> String) -> Result<Rope> {
        self.rope.ok_or_else(|| {
            KvError::NotSupported(format!(
                "{} needs later keys re-rotated: give the pool its rotary embedding \
                 (BlockPool(..., rope=kvrs.RoPE(...))) or remove a tail (end=None)",
                what()
            ))
        })
    }

    /// Removes positions `[begin, end)` from the middle of sequence `id`: later positions
    /// move down by `end - begin` and their keys are re-rotated by that much (values are
    /// unchanged). Each group moves what it holds; shared or cached blocks are copied
    /// before they change. All or nothing: `CacheFull` when the copies do not fit.
    fn remove_span(&mut self, id: SeqId, begin: usize, end: usize, rope: Rope) -> Result<()> {
        let sh = self.shape;
        let (bs, h, d, dv) = (sh.block_size, sh.num_kv_heads, sh.head_dim, sh.v_head_dim);
        let shift = end - begin;
        let moved = |l: usize| if l > end { l - shift } else { l.min(begin) };
        // Per group: where moved data lands, and the new first held position.
        let s = self.seq(id)?;
        let plans: Vec<(usize, usize)> = (0..self.groups.groups.len())
            .map(|g| {
                let start = s.tables[g].start;
                let src = start.max(end);
                let new_start = if start < begin { start } else { src - shift };
                (src, new_start)
            })
            .collect();
        let needed: usize = (0..self.groups.groups.len())
            .map(|g| {
                let held = moved(s.held_by(&self.groups.groups[g].layers));
                self.group_blocks_needed(s, g, plans[g].0 - shift, held)
            })
            .sum();
        self.ensure_room(needed, || {
            format!("removing positions [{begin}, {end}) of sequence {id}")
        })?;
        for (g, &(src, _)) in plans.iter().enumerate() {
            let held = moved(self.seq(id)?.held_by(&self.groups.groups[g].layers));
            self.prepare_group(id, g, src - shift, held);
        }
        for layer in 0..sh.num_layers {
            let g = self.groups.group_of[layer];
            let src = plans[g].0;
            let len = self.seq(id)?.layer_len[layer];
            if len <= src {
                continue;
            }
            // One layer's moved tail at a time, through float32.
            let n = len - src;
            let (mut k, mut v) = (vec![0f32; h * n * d], vec![0f32; h * n * dv]);
            let blocks = self.seq(id)?.tables[g].blocks.clone();
            self.read_positions(
                &blocks,
                layer,
                src,
                n,
                &mut TensorMut::from_f32_mut(&mut k, &[h, n, d])?,
                &mut TensorMut::from_f32_mut(&mut v, &[h, n, dv])?,
            )?;
            rope.rotate(d, &mut k, -(shift as f64))?;
            self.write_positions(
                &blocks,
                layer,
                src - shift,
                &TensorRef::from_f32(&k, &[h, n, d])?.transposed(0, 1),
                &TensorRef::from_f32(&v, &[h, n, dv])?.transposed(0, 1),
            )?;
        }
        let s = self.seq_mut(id);
        s.edited();
        s.layer_len.iter_mut().for_each(|l| *l = moved(*l));
        s.seq_len = moved(s.seq_len);
        if s.tokens.len() > begin {
            let stop = end.min(s.tokens.len());
            s.tokens.drain(begin..stop);
        }
        s.hashes.truncate(begin / bs);
        s.cache_limit = s.cache_limit.min(begin);
        for (g, &(_, new_start)) in plans.iter().enumerate() {
            self.seq_mut(id).tables[g].start = new_start;
            self.normalize_table(id, g);
        }
        Ok(())
    }
}
