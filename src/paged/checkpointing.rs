//! Prefix caching for hybrid models: when a pool with state layers takes, publishes,
//! restores and drops state checkpoints ([`super::checkpoints`]).
//!
//! **The hit rule.** A new sequence's hit is the longest prefix of its prompt for which
//! the cache holds both the K/V (whole blocks, and a partial block's beginning) and a
//! checkpoint at exactly that length; its state slot is filled from the checkpoint (a
//! copy: the checkpoint stays as it was) and its length is that position, token by
//! token.
//!
//! **When checkpoints are taken** (at a commit, when the state the model wrote in place
//! is the state after the committed tokens):
//! - at the end of every prefill chunk: a commit that ends inside the sequence's prompt
//!   or at its end;
//! - at the branch point: where the prompt leaves the K/V the cache held when it
//!   started, past its state hit (callers end a prefill chunk there:
//!   `SeqState::branch`), so the next prompt sharing that prefix hits all of it;
//! - during decode, at every multiple of the pool's checkpoint interval;
//! - when asked ([`PoolCore::checkpoint`]).
//!
//! A checkpoint is keyed at its position by the chain of token ids before it, so only a
//! position whose token ids are known (and whose blocks may be cached) can have one. It
//! is published (found by later hits) once the K/V of every position before it are
//! cached; until then its sequence holds it. A sequence keeps holding the last
//! checkpoint it published (for rollbacks) and lets older ones go to the checkpoints'
//! own LRU order. When a cached block leaves the cache, the checkpoints anchored at it
//! (whose positions lie in the block after it) can no longer be hit and are freed.
//!
//! **Rollbacks.** `truncate`, `set_seq_len` and `remove` to position `n` of a sequence
//! with state restore the state from a checkpoint at `n` (held by the sequence, or
//! cached for its prefix; at 0, zeros) instead of refusing.

use smallvec::SmallVec;

use super::caching::group_key;
use super::checkpoints::{CheckpointEntry, CheckpointSlot};
use super::pool::{PoolCore, SeqId};
use super::seq::SeqState;
use crate::error::{KvError, Result};
use crate::prefix::BlockHash;

/// A state to restore when a sequence is cut to a position: zeros (position 0) or a
/// checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Restore {
    Zeros,
    Checkpoint(CheckpointSlot),
}

/// The key of a checkpoint: anchor, extra-key digest, run.
type Key = (BlockHash, u128, SmallVec<[u32; 16]>);

impl PoolCore {
    /// The digest of extra key `extra` in checkpoint keys (0 for none).
    pub(crate) fn extra_digest(&self, extra: &[u8]) -> u128 {
        match (self.prefix(), extra.is_empty()) {
            (Some(p), false) => p.kind.block(0x6b76_7273_2d63_6b70, &[], extra),
            _ => 0,
        }
    }

    /// The key of a checkpoint of `s` at position `p`, when its tokens and blocks there
    /// are known: `p` within its known token ids, blocks before it hashed.
    fn checkpoint_key(&self, s: &SeqState, p: usize) -> Option<Key> {
        let bs = self.shape.block_size;
        let k = p / bs;
        if p == 0 || s.tokens.len() < p || p > s.cache_limit || s.hashes.len() < k {
            return None;
        }
        let anchor = if k == 0 { s.root } else { s.hashes[k - 1] };
        Some((
            anchor,
            self.extra_digest(&s.extra),
            s.tokens[k * bs..p].into(),
        ))
    }

    /// Takes a checkpoint of sequence `id`'s state at its committed length (in a pool
    /// with state layers that caches prefixes); returns whether the sequence now holds
    /// one there. False when its token ids there are unknown (or its blocks are not
    /// cacheable), or when every checkpoint slot is held.
    pub fn checkpoint(&mut self, id: SeqId) -> Result<bool> {
        let s = self.seq(id)?;
        let p = s.seq_len;
        if s.checkpoints.iter().any(|&(q, _)| q == p) {
            return Ok(true);
        }
        let (Some(key), Some(slot)) = (self.checkpoint_key(s, p), s.state_slot) else {
            return Ok(false);
        };
        let root = s.root;
        let Some(index) = self.checkpoints.as_mut() else {
            return Ok(false);
        };
        let (anchor, extra, run) = key;
        let c = match index.find(anchor, extra, &run) {
            Some(c) => {
                // The same prefix is cached: its state is this one.
                index.hold(c);
                c
            }
            None => {
                let entry = CheckpointEntry {
                    anchor,
                    extra,
                    run,
                    position: p,
                    root,
                    refs: 0,
                    published: false,
                };
                let Some((c, evicted)) = index.take(entry) else {
                    return Ok(false);
                };
                if let Some(e) = evicted {
                    // The checkpoint that leaves goes to the tiers before its slot is
                    // overwritten.
                    self.write_back_checkpoint(c, &e);
                }
                self.states
                    .as_mut()
                    .expect("checkpoints live in the state arena")
                    .checkpoint_copy(slot, c, true);
                c
            }
        };
        self.seq_mut(id).checkpoints.push((p, c));
        self.publish_checkpoints(id);
        Ok(true)
    }

    /// The policy, after a commit of sequence `id` from `from` positions (see the
    /// module): a checkpoint at the end of a prefill chunk, at the branch point, at an
    /// interval; then whatever became publishable is published.
    pub(crate) fn checkpoint_commit(&mut self, id: SeqId, from: usize) {
        if self.checkpoints.is_none() {
            return;
        }
        let Ok(s) = self.seq(id) else { return };
        let p = s.seq_len;
        let every = self.checkpoint_interval;
        let due = p > from
            && (p <= s.prompt_len
                || s.branch == Some(p)
                || (every > 0 && p / every > from / every));
        if s.branch.is_some_and(|b| b <= p) {
            self.seq_mut(id).branch = None;
        }
        if due {
            let _ = self.checkpoint(id);
        } else {
            self.publish_checkpoints(id);
        }
    }

    /// Whether the K/V of positions `0..p` of `s` are cached: the whole blocks before
    /// `p`, and the beginning of the block `p` lies in (that block, or a cached sibling
    /// that starts with the same token ids).
    fn kv_cached_before(&self, s: &SeqState, p: usize) -> bool {
        let Some(index) = self.prefix() else {
            return false;
        };
        let bs = self.shape.block_size;
        let (k, n) = (p / bs, p % bs);
        let whole = s.hashes.len() >= k
            && s.hashes[..k]
                .iter()
                .all(|&h| index.lookup(group_key(h, 0)).is_some());
        if !whole || n == 0 {
            return whole;
        }
        if s.hashes.len() > k && index.lookup(group_key(s.hashes[k], 0)).is_some() {
            return true;
        }
        let parent = if k == 0 { s.root } else { s.hashes[k - 1] };
        index
            .partial_match(parent, &s.extra, &s.tokens[k * bs..p])
            .is_some_and(|(_, m)| m >= n)
    }

    /// Publishes the checkpoints sequence `id` holds whose K/V are cached now, and lets
    /// go of the published ones older than its newest published one.
    pub(crate) fn publish_checkpoints(&mut self, id: SeqId) {
        let Ok(s) = self.seq(id) else { return };
        let Some(index) = self.checkpoints.as_ref() else {
            return;
        };
        let ready: Vec<(usize, CheckpointSlot)> = s
            .checkpoints
            .iter()
            .copied()
            .filter(|&(p, c)| {
                index.entry(c).is_some_and(|e| !e.published) && self.kv_cached_before(s, p)
            })
            .collect();
        for (p, c) in ready {
            let index = self.checkpoints.as_mut().expect("checked");
            if !index.publish(c) {
                // Another sequence published this prefix's state first: hold that one.
                let e = index.entry(c).expect("held");
                let other = index
                    .find(e.anchor, e.extra, &e.run.clone())
                    .expect("published");
                index.hold(other);
                index.release(c);
                let held = &mut self.seq_mut(id).checkpoints;
                if let Some(x) = held.iter_mut().find(|x| **x == (p, c)) {
                    x.1 = other;
                }
            }
        }
        // Keep the newest published checkpoint (and every unpublished one).
        let index = self.checkpoints.as_ref().expect("checked");
        let published = |c: CheckpointSlot| index.entry(c).is_some_and(|e| e.published);
        let s = self.seq(id).expect("live");
        let newest = s
            .checkpoints
            .iter()
            .filter(|&&(_, c)| published(c))
            .map(|&(p, _)| p)
            .max();
        let old: Vec<(usize, CheckpointSlot)> = s
            .checkpoints
            .iter()
            .copied()
            .filter(|&(p, c)| published(c) && Some(p) != newest)
            .collect();
        if !old.is_empty() {
            let index = self.checkpoints.as_mut().expect("checked");
            for &(_, c) in &old {
                index.release(c);
            }
            self.seq_mut(id).checkpoints.retain(|x| !old.contains(x));
        }
    }

    /// Releases every checkpoint `s` holds (a sequence freed or replaced).
    pub(crate) fn release_checkpoints(&mut self, held: &[(usize, CheckpointSlot)]) {
        if let Some(index) = self.checkpoints.as_mut() {
            for &(_, c) in held {
                index.release(c);
            }
        }
    }

    /// Adds a reference to each of `held` (a fork or a copy holds them too).
    pub(crate) fn hold_checkpoints(&mut self, held: &[(usize, CheckpointSlot)]) {
        if let Some(index) = self.checkpoints.as_mut() {
            for &(_, c) in held {
                index.hold(c);
            }
        }
    }

    /// Frees the cached checkpoints anchored at the block of chain hash `hash`, which
    /// just left the cache (to the tiers, with those of them at its end): no hit can
    /// reach them.
    pub(crate) fn drop_checkpoints_at(&mut self, hash: BlockHash) {
        if let Some(index) = self.checkpoints.as_mut() {
            for (c, e) in index.drop_anchor(hash) {
                // Freed, but not reused before this returns: its state is still there.
                self.write_back_checkpoint(c, &e);
            }
        }
    }

    /// Frees every cached checkpoint no sequence holds (to the tiers, those at block
    /// ends); returns how many.
    pub(crate) fn evict_all_checkpoints(&mut self) -> usize {
        let Some(index) = self.checkpoints.as_mut() else {
            return 0;
        };
        let gone = index.evict_all();
        for (c, e) in &gone {
            self.write_back_checkpoint(*c, e);
        }
        gone.len()
    }

    /// The longest position `p <= kv_len` of `tokens` (from `root`, with `extra`, whose
    /// whole blocks' chain hashes are `hashes`) with a cached checkpoint: `(p, slot)`,
    /// or `(0, None)`. Runs inside a block count only with `partial` (hits may copy a
    /// block's beginning).
    pub(crate) fn checkpoint_hit(
        &self,
        root: BlockHash,
        hashes: &[BlockHash],
        tokens: &[u32],
        extra: &[u8],
        kv_len: usize,
        partial: bool,
    ) -> (usize, Option<CheckpointSlot>) {
        let Some(index) = self.checkpoints.as_ref() else {
            return (0, None);
        };
        let bs = self.shape.block_size;
        let digest = self.extra_digest(extra);
        for k in (0..=(kv_len / bs).min(hashes.len())).rev() {
            let anchor = if k == 0 { root } else { hashes[k - 1] };
            let max = if partial {
                (kv_len - k * bs).min(bs - 1)
            } else {
                0
            };
            if let Some((c, n)) = index.best(anchor, digest, &tokens[k * bs..], max) {
                if k * bs + n > 0 {
                    return (k * bs + n, Some(c));
                }
            }
        }
        (0, None)
    }

    /// The state a cut of sequence `id` to `n` positions restores (`None`: no state to
    /// restore, `n` keeps every committed position or the pool has no state layers);
    /// refused when `n` has no checkpoint. Changes nothing.
    pub(crate) fn restore_for(&self, id: SeqId, n: usize, what: &str) -> Result<Option<Restore>> {
        let s = self.seq(id)?;
        if self.states.is_none() || n >= s.seq_len {
            return Ok(None);
        }
        if n == 0 {
            return Ok(Some(Restore::Zeros));
        }
        if let Some(&(_, c)) = s.checkpoints.iter().find(|&&(p, _)| p == n) {
            return Ok(Some(Restore::Checkpoint(c)));
        }
        let cached = self
            .checkpoint_key(s, n)
            .and_then(|(anchor, extra, run)| self.checkpoints.as_ref()?.find(anchor, extra, &run));
        if let Some(c) = cached {
            return Ok(Some(Restore::Checkpoint(c)));
        }
        let mut at: Vec<usize> = s.checkpoints.iter().map(|&(p, _)| p).collect();
        at.push(0);
        at.sort_unstable();
        Err(KvError::NotSupported(format!(
            "{what}: sequence {id} has recurrent state, which holds all its {} committed \
             positions; it can be rolled back only to a position with a state checkpoint \
             (this sequence holds {at:?}; the prefix cache may hold others), not to {n}. \
             Take one with checkpoint() at the position you may return to, or fork the \
             sequence before tokens you may reject",
            s.seq_len
        )))
    }

    /// Restores the state of sequence `id` as `restore` says (after its cut), and lets
    /// go of the checkpoints it holds past its new length.
    pub(crate) fn apply_restore(&mut self, id: SeqId, restore: Option<Restore>) {
        let Some(restore) = restore else { return };
        let s = self.seq(id).expect("live");
        let (slot, len) = (s.state_slot, s.seq_len);
        let past: Vec<(usize, CheckpointSlot)> = s
            .checkpoints
            .iter()
            .copied()
            .filter(|&(p, _)| p > len)
            .collect();
        if let Some(slot) = slot {
            let arena = self.states.as_mut().expect("a pool with state layers");
            match restore {
                Restore::Zeros => arena.zero(slot),
                Restore::Checkpoint(c) => arena.checkpoint_copy(slot, c, false),
            }
        }
        self.release_checkpoints(&past);
        self.seq_mut(id).checkpoints.retain(|x| !past.contains(x));
    }

    /// Fills new sequence `id`'s state slot from checkpoint `c`, its prefix hit's.
    pub(crate) fn restore_hit(&mut self, id: SeqId, c: CheckpointSlot) {
        let slot = self.seq(id).ok().and_then(|s| s.state_slot);
        if let (Some(slot), Some(arena)) = (slot, self.states.as_mut()) {
            arena.checkpoint_copy(slot, c, false);
            let index = self.checkpoints.as_mut().expect("a hit had a checkpoint");
            index.touch(c);
            index.counters.hits += 1;
        }
    }

    /// Every reference the pool's sequences hold to each checkpoint slot.
    pub(crate) fn checkpoint_holders(&self) -> Vec<u32> {
        let n = self.checkpoints.as_ref().map_or(0, |i| i.capacity());
        let mut held = vec![0u32; n];
        for s in self.seqs.values() {
            for &(_, c) in &s.checkpoints {
                held[c as usize] += 1;
            }
        }
        held
    }
}
