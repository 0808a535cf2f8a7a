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
//!   or at its end; callers end chunks where [`PoolCore::checkpoint_due`] says: every
//!   checkpoint interval, the prompt's last block boundary and its branch point;
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
//! **Identity.** A checkpoint is the state after exactly the token ids of its key, and
//! it is found only by them: a restore, held or cached alike, looks up the key of the
//! token ids the sequence has (or, during an edit that moves ids such as `accept`, will
//! have) before the position, never a position alone; a held checkpoint whose ids an
//! edit changed is let go.
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

/// The token ids of a sequence as checkpoint keys read them: its own, or those an edit
/// in progress will leave it with.
pub(crate) struct Chain<'a> {
    /// The root of its hash chain (its namespace).
    pub root: BlockHash,
    /// Its extra key.
    pub extra: &'a [u8],
    /// Its known token ids, from position 0.
    pub tokens: &'a [u32],
    /// Chain hashes of its first whole blocks (the rest are chained from `tokens`).
    pub hashes: &'a [BlockHash],
    /// Positions from here on are never cached (`SeqState::cache_limit`).
    pub cache_limit: usize,
}

impl<'a> Chain<'a> {
    /// The token ids sequence `s` has now.
    pub fn of(s: &'a SeqState) -> Self {
        Chain {
            root: s.root,
            extra: &s.extra,
            tokens: &s.tokens,
            hashes: &s.hashes,
            cache_limit: s.cache_limit,
        }
    }
}

impl PoolCore {
    /// The digest of extra key `extra` in checkpoint keys (0 for none).
    pub(crate) fn extra_digest(&self, extra: &[u8]) -> u128 {
        match (self.prefix(), extra.is_empty()) {
            (Some(p), false) => p.kind.block(0x6b76_7273_2d63_6b70, &[], extra),
            _ => 0,
        }
    }

    /// The key of a checkpoint of `s` at position `p`, when its token ids there are
    /// known (and its blocks there cacheable).
    fn checkpoint_key(&self, s: &SeqState, p: usize) -> Option<Key> {
        self.key_at(&Chain::of(s), p)
    }

    /// The key of a checkpoint at position `p` of the token ids `c` names: `None` when
    /// they stop before `p` (or their blocks there are not cacheable). Block hashes `c`
    /// does not have yet are chained from its token ids, as the prefix cache chains them.
    fn key_at(&self, c: &Chain<'_>, p: usize) -> Option<Key> {
        let bs = self.shape.block_size;
        let k = p / bs;
        if p == 0 || c.tokens.len() < p || p > c.cache_limit {
            return None;
        }
        let kind = self.prefix()?.kind;
        let known = c.hashes.len().min(k);
        let mut anchor = if known == 0 {
            c.root
        } else {
            c.hashes[known - 1]
        };
        for i in known..k {
            anchor = kind.block(anchor, &c.tokens[i * bs..(i + 1) * bs], c.extra);
        }
        Some((
            anchor,
            self.extra_digest(c.extra),
            c.tokens[k * bs..p].into(),
        ))
    }

    /// Whether checkpoint slot `slot` holds the state after exactly the token ids of
    /// `key` (a checkpoint is identified by its tokens, never by its position alone).
    fn is_checkpoint_of(&self, slot: CheckpointSlot, key: &Key) -> bool {
        self.checkpoints
            .as_ref()
            .and_then(|i| i.entry(slot))
            .is_some_and(|e| (e.anchor, e.extra) == (key.0, key.1) && *e.run == *key.2)
    }

    /// The checkpoint sequence `s` holds at `p` for the token ids of `key`.
    fn held_checkpoint(&self, s: &SeqState, p: usize, key: &Key) -> Option<CheckpointSlot> {
        s.checkpoints
            .iter()
            .find(|&&(q, c)| q == p && self.is_checkpoint_of(c, key))
            .map(|&(_, c)| c)
    }

    /// Takes a checkpoint of sequence `id`'s state at its committed length (in a pool
    /// with state layers that caches prefixes); returns whether the sequence now holds
    /// one there. False when its token ids there are unknown (or its blocks are not
    /// cacheable), or when every checkpoint slot is held.
    pub fn checkpoint(&mut self, id: SeqId) -> Result<bool> {
        let s = self.seq(id)?;
        let p = s.seq_len;
        let (Some(key), Some(slot)) = (self.checkpoint_key(s, p), s.state_slot) else {
            return Ok(false);
        };
        if self.held_checkpoint(s, p, &key).is_some() {
            return Ok(true);
        }
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

    /// Where sequence `id`'s next prefill chunk should end for the state there to be
    /// checkpointed (a commit inside the prompt takes one): the first of its branch
    /// point, the next multiple of the checkpoint interval and the last block boundary of
    /// its prompt that lies past its committed length and before its prompt's end (the
    /// end is checkpointed as every chunk end is). So the next request sharing a prefix
    /// hits its last whole block at least, and recomputes less than one interval of it.
    /// `None` when no such position remains, or the pool takes no checkpoints.
    pub fn checkpoint_due(&self, id: SeqId) -> Result<Option<usize>> {
        let s = self.seq(id)?;
        if self.checkpoints.is_none() || s.state_slot.is_none() {
            return Ok(None);
        }
        let (p, end, bs) = (s.seq_len, s.prompt_len, self.shape.block_size);
        let every = self.checkpoint_interval;
        let interval = (every > 0).then(|| (p / every + 1) * every);
        let last_block = Some(end / bs * bs);
        Ok([s.branch, interval, last_block]
            .into_iter()
            .flatten()
            .filter(|&q| q > p && q < end)
            .min())
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
        let through = self.tier_write_mode() == Some(crate::tier::writer::WriteMode::Through);
        for (p, c) in ready {
            let index = self.checkpoints.as_mut().expect("checked");
            if index.publish(c) {
                if through {
                    // A checkpoint at a block end travels with its blocks.
                    let index = self.checkpoints.as_ref().expect("checked");
                    self.write_back_checkpoint(c, index.entry(c).expect("published"));
                }
            } else {
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
        self.restore_to(id, &Chain::of(s), n, what)
    }

    /// The state sequence `id` restores when it is cut to `n` positions and its token
    /// ids are then those of `chain` (an edit that moves token ids, as `accept` does,
    /// names the ids it will leave): the checkpoint of exactly the token ids before `n`,
    /// held by the sequence or cached; zeros at 0. Refused when none exists. Changes
    /// nothing.
    pub(crate) fn restore_to(
        &self,
        id: SeqId,
        chain: &Chain<'_>,
        n: usize,
        what: &str,
    ) -> Result<Option<Restore>> {
        let s = self.seq(id)?;
        if self.states.is_none() || n >= s.seq_len {
            return Ok(None);
        }
        if n == 0 {
            return Ok(Some(Restore::Zeros));
        }
        if let Some(key) = self.key_at(chain, n) {
            let held = self.held_checkpoint(s, n, &key);
            let cached = || {
                let (anchor, extra, run) = &key;
                self.checkpoints.as_ref()?.find(*anchor, *extra, run)
            };
            if let Some(c) = held.or_else(cached) {
                return Ok(Some(Restore::Checkpoint(c)));
            }
        }
        let mut at: Vec<usize> = s.checkpoints.iter().map(|&(p, _)| p).collect();
        at.push(0);
        at.sort_unstable();
        Err(KvError::NotSupported(format!(
            "{what}: sequence {id} has recurrent state, which holds all its {} committed \
             positions; it can be rolled back only to a position with a state checkpoint of \
             exactly the token ids it keeps there (this sequence holds checkpoints at \
             {at:?}; the prefix cache may hold others), not to {n}. Take one with \
             checkpoint() at the position you may return to, or fork the sequence before \
             tokens you may reject",
            s.seq_len
        )))
    }

    /// Lets go of the checkpoints sequence `id` holds that are no longer the state after
    /// its token ids (an edit moved the ids before them), so none can be restored.
    pub(crate) fn drop_stale_checkpoints(&mut self, id: SeqId) {
        let Ok(s) = self.seq(id) else { return };
        let chain = Chain::of(s);
        let stale: Vec<(usize, CheckpointSlot)> = s
            .checkpoints
            .iter()
            .copied()
            .filter(|&(p, c)| {
                p > s.seq_len
                    || !self
                        .key_at(&chain, p)
                        .is_some_and(|key| self.is_checkpoint_of(c, &key))
            })
            .collect();
        if !stale.is_empty() {
            self.release_checkpoints(&stale);
            self.seq_mut(id).checkpoints.retain(|x| !stale.contains(x));
        }
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
