//! Prefix caching on a pool: matching a prompt against cached blocks (left to right for
//! full-attention groups, then right to left for sliding and chunked ones, which need
//! only the blocks their window sees), attaching a hit, caching committed blocks,
//! pinning, eviction and events.

use std::sync::Arc;

use smallvec::SmallVec;

use super::checkpoints::CheckpointSlot;
use super::groups::LayerKind;
use super::pool::{PoolCore, SeqId};
use super::seq::{Table, NO_BLOCK};
use super::tier_lookup::{TierFetched, TierLookup};
use super::tiering::TierTokens;
use crate::error::{KvError, Result};
use crate::layout::BlockId;
use crate::prefix::{BlockHash, CachedBlock, PrefixEvent, PrefixIndex};

/// The key of block hash `h` in group `g`'s part of the index: group 0 uses the chain
/// hash itself, other groups a fixed per-group mask of it (a collision between groups
/// is as unlikely as one between hashes).
pub(crate) fn group_key(h: BlockHash, g: usize) -> BlockHash {
    const MASK: BlockHash = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;
    h ^ MASK.wrapping_mul(g as BlockHash)
}

/// What a prompt finds cached: the chain hashes of its first `hashes.len()` whole
/// blocks, the table each group attaches over them, and (pools whose layers are all
/// full) the best partial match of the next block (source block, matching tokens).
pub(crate) struct Hit {
    pub hashes: Vec<BlockHash>,
    pub tables: smallvec::SmallVec<[Table; 2]>,
    pub partial: Option<(BlockId, usize)>,
}

impl Hit {
    /// Positions the hit covers.
    pub fn tokens(&self, block_size: usize) -> usize {
        self.hashes.len() * block_size + self.partial.map_or(0, |(_, n)| n)
    }

    fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.tables.iter().flat_map(Table::held_blocks)
    }
}

/// The most prompt tokens a sequence's prefix match covers: all but the last, which
/// is always left to compute.
pub fn prompt_limit(tokens: &[u32]) -> usize {
    tokens.len().saturating_sub(1)
}

impl PoolCore {
    /// Starts a sequence whose token ids begin with `tokens` (the prompt). With prefix
    /// caching on, the longest cached prefix is attached (no copy for whole blocks; a
    /// fresh copy of the matching beginning of a block for a partial hit) and reported
    /// as `num_cached_tokens`; at least one prompt token is always left to compute. In a
    /// pool with state layers, call [`Self::check_state_room`] first (see
    /// [`Self::new_sequence`]).
    pub fn new_sequence_with(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> SeqId {
        self.new_sequence_owning(tokens.to_vec(), namespace, extra)
    }

    /// [`Self::new_sequence_with`] keeping `tokens` as the sequence's ids, without a copy
    /// (the bindings copy a caller's array once, fallibly, and hand it over).
    pub fn new_sequence_owning(
        &mut self,
        tokens: Vec<u32>,
        namespace: &[u8],
        extra: &[u8],
    ) -> SeqId {
        let lookup = self.plan_tier_lookup(&tokens, namespace, extra, prompt_limit(&tokens));
        self.new_sequence_fetched(tokens, namespace, extra, lookup.map(TierLookup::fetch))
    }

    /// [`Self::new_sequence_owning`] whose tier lookup ([`PoolCore::plan_tier_lookup`]
    /// with the limit [`prompt_limit`]) was fetched without the pool's lock: `fetched`
    /// is committed first ([`PoolCore::commit_tier_lookup`]). No tier I/O.
    pub fn new_sequence_fetched(
        &mut self,
        tokens: Vec<u32>,
        namespace: &[u8],
        extra: &[u8],
        fetched: Option<TierFetched>,
    ) -> SeqId {
        let root = self.prefix().map_or(0, |p| p.root(namespace));
        let mut s = self.empty_state(root, Arc::from(extra));
        s.tokens = tokens;
        let tokens = &s.tokens;
        let limit = prompt_limit(tokens);
        // What the pool lacked of the prompt's prefix, the tiers may have held.
        let tier_tokens = fetched.map_or_else(TierTokens::new, |f| self.commit_tier_lookup(f));
        let (hit, checkpoint, kv_len) = self.prompt_hit(root, tokens, extra, limit);
        let hit_blocks: Vec<BlockId> = hit.blocks().collect();
        for &b in &hit_blocks {
            self.hold_block(b);
        }
        self.on_hits(&hit_blocks);
        let hit_len = hit.tokens(self.shape.block_size);
        let mut cached = hit.hashes.len() * self.shape.block_size;
        s.tables = hit.tables;
        s.hashes = hit.hashes;
        if let Some((src, n)) = hit.partial {
            // Hold the source so allocating the copy cannot evict it (holding may take it
            // out of the eviction order, so room is counted afterwards).
            self.hold_block(src);
            if self.num_free_blocks() > 0 {
                let b = self.take_block();
                // Past its first n rows the copy holds the cached prompt's continuation,
                // K/V of another token prefix: the ledger has it zeroed before this
                // sequence claims them (the copy's written end is the source's).
                self.copy_block(src, b);
                s.tables[0].blocks.push(b);
                cached += n;
            }
            self.release_block(src);
        }
        let want = hit_len;
        if checkpoint.is_some() && cached != want {
            // No block was free for the partial copy: the state checkpoint's position is
            // not reached, so the hit goes (a state pool hits exactly a checkpoint).
            for t in &s.tables {
                self.release_all(t.blocks.iter().copied());
            }
            s.tables = smallvec::smallvec![Table::default(); s.tables.len()];
            s.hashes.clear();
            cached = 0;
        }
        let checkpoint = checkpoint.filter(|_| cached == want);
        s.layer_len.fill(cached);
        s.seq_len = cached;
        s.num_cached_tokens = cached;
        s.prompt_len = s.tokens.len();
        if self.checkpoints.is_some() && kv_len > cached {
            s.branch = Some(kv_len);
        }
        // Tiers' blocks are the hit's last ones: what the hit covers past the pool's own.
        let mut from_tiers = tier_tokens.iter().sum::<usize>().min(cached);
        s.tier_tokens = tier_tokens
            .iter()
            .map(|&n| {
                let n = n.min(from_tiers);
                from_tiers -= n;
                n
            })
            .collect();
        self.blocks.count_query(s.tokens.len(), cached);
        let id = self.insert(s);
        if let Some(c) = checkpoint {
            self.restore_hit(id, c);
        }
        self.trim(id);
        id
    }

    /// The hit of a prompt (at most `limit` tokens): what [`Self::match_blocks`] finds,
    /// and in a pool with state layers that caches prefixes, cut to the longest position
    /// with a cached state checkpoint, with that checkpoint. Also the length of the K/V
    /// the cache holds for the prompt (0 without checkpoints).
    pub(crate) fn prompt_hit(
        &self,
        root: BlockHash,
        tokens: &[u32],
        extra: &[u8],
        limit: usize,
    ) -> (Hit, Option<CheckpointSlot>, usize) {
        let hit = self.match_blocks(root, tokens, extra, limit);
        if self.checkpoints.is_none() {
            return (hit, None, 0);
        }
        let bs = self.shape.block_size;
        let kv_len = hit.tokens(bs);
        let partial = self.prefix().is_some_and(|p| p.partial_hits);
        let (p, c) = self.checkpoint_hit(root, &hit.hashes, tokens, extra, kv_len, partial);
        if p == kv_len {
            return (hit, c, kv_len);
        }
        let cut = self.match_blocks(root, tokens, extra, p);
        if cut.tokens(bs) == p {
            return (cut, c, kv_len);
        }
        (self.match_blocks(root, tokens, extra, 0), None, kv_len)
    }

    /// What `tokens` from `root` find cached, covering at most `limit` tokens. Full groups
    /// need every block of the prefix; sliding and chunked groups only the blocks a token
    /// right after it sees, so the hit is the longest prefix at which every group has what
    /// it needs (searched right to left, as vLLM does for sliding windows).
    pub(crate) fn match_blocks(
        &self,
        root: BlockHash,
        tokens: &[u32],
        extra: &[u8],
        limit: usize,
    ) -> Hit {
        let ng = self.groups.groups.len();
        let mut hit = Hit {
            hashes: Vec::new(),
            tables: smallvec::smallvec![Table::default(); ng],
            partial: None,
        };
        let Some(p) = self.prefix() else {
            return hit;
        };
        let bs = self.shape.block_size;
        let kinds: Vec<LayerKind> = self.groups.groups.iter().map(|g| g.kind).collect();
        let full: Vec<usize> = (0..ng).filter(|&g| kinds[g] == LayerKind::Full).collect();
        let mut parent = root;
        let mut buf = Vec::with_capacity(16 + 4 * bs + extra.len());
        while (hit.hashes.len() + 1) * bs <= limit {
            let start = hit.hashes.len() * bs;
            let h = p
                .kind
                .block_with(&mut buf, parent, &tokens[start..start + bs], extra);
            if full.iter().any(|&g| p.lookup(group_key(h, g)).is_none()) {
                break;
            }
            hit.hashes.push(h);
            parent = h;
        }
        // For each other group, the last block before k that is not cached.
        let windowed: Vec<usize> = (0..ng).filter(|&g| kinds[g] != LayerKind::Full).collect();
        let missing_before: Vec<Vec<Option<usize>>> = windowed
            .iter()
            .map(|&g| {
                let mut last = None;
                let mut out = vec![None; hit.hashes.len() + 1];
                for (i, &h) in hit.hashes.iter().enumerate() {
                    if p.lookup(group_key(h, g)).is_none() {
                        last = Some(i);
                    }
                    out[i + 1] = last;
                }
                out
            })
            .collect();
        let mut k = hit.hashes.len();
        let needs_from =
            |g: usize, k: usize| self.groups.attention.first_visible(kinds[g], k * bs) / bs;
        while k > 0
            && windowed
                .iter()
                .zip(&missing_before)
                .any(|(&g, miss)| miss[k].is_some_and(|m| m >= needs_from(g, k)))
        {
            k -= 1;
        }
        hit.hashes.truncate(k);
        for (g, t) in hit.tables.iter_mut().enumerate() {
            let from = if kinds[g] == LayerKind::Full {
                0
            } else {
                needs_from(g, k)
            };
            t.start = from * bs;
            t.blocks = (0..k)
                .map(|i| {
                    if i < from {
                        NO_BLOCK
                    } else {
                        p.lookup(group_key(hit.hashes[i], g))
                            .expect("checked cached")
                    }
                })
                .collect();
        }
        if p.partial_hits {
            // The cached child of the last whole block whose tokens share the longest
            // beginning with the next block's (pools whose layers are all full: one group).
            let start = k * bs;
            let want = &tokens[start..limit.min(start + bs).max(start)];
            let parent = hit.hashes.last().copied().unwrap_or(root);
            hit.partial = p.partial_match(parent, extra, want);
        }
        hit
    }

    /// Tokens of `tokens` (in `namespace`, with `extra`) that a new sequence would find
    /// cached, without attaching anything or counting a query.
    pub fn match_prefix(&self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> usize {
        let Some(p) = self.prefix() else {
            return 0;
        };
        self.prompt_hit(p.root(namespace), tokens, extra, prompt_limit(tokens))
            .0
            .tokens(self.shape.block_size)
    }

    /// Caches every full, committed block of `id` whose token ids are known, in every
    /// group that still holds it.
    pub(crate) fn register_blocks(&mut self, id: SeqId) {
        let bs = self.shape.block_size;
        let Some(kind) = self.prefix().map(|p| p.kind) else {
            return;
        };
        let s = self.seqs.get_mut(&id).expect("checked live");
        let mut cached: SmallVec<[BlockId; 4]> = SmallVec::new();
        while s.hashes.len() < s.seq_len.min(s.tokens.len()).min(s.cache_limit) / bs {
            let i = s.hashes.len();
            let parent = if i == 0 { s.root } else { s.hashes[i - 1] };
            let toks = &s.tokens[i * bs..(i + 1) * bs];
            let h = kind.block(parent, toks, &s.extra);
            s.hashes.push(h);
            for (g, t) in s.tables.iter().enumerate() {
                if let Some(&b) = t.blocks.get(i).filter(|&&b| b != NO_BLOCK) {
                    // A block already cached under another hash, or a hash already cached
                    // in another block, stays as it is: the first copy wins.
                    let meta = CachedBlock {
                        hash: group_key(h, g),
                        parent: group_key(parent, g),
                        first: i == 0,
                        root: s.root,
                    };
                    if self.blocks.register(b, meta, toks, &s.extra) {
                        cached.push(b);
                    }
                }
            }
        }
        if !cached.is_empty() {
            self.on_cached(&cached);
        }
    }

    fn prefix_or_err(&self) -> Result<&PrefixIndex> {
        self.prefix().ok_or_else(|| {
            KvError::NotSupported(
                "prefix caching is off for this pool (prefix_caching=False)".into(),
            )
        })
    }

    /// The cached blocks a sequence starting with all of `tokens` would attach, and the
    /// tokens they cover.
    fn cached_hit(
        &self,
        tokens: &[u32],
        namespace: &[u8],
        extra: &[u8],
    ) -> Result<(Vec<BlockId>, usize)> {
        let p = self.prefix_or_err()?;
        let mut hit = self.match_blocks(p.root(namespace), tokens, extra, tokens.len());
        hit.partial = None;
        Ok((hit.blocks().collect(), hit.tokens(self.shape.block_size)))
    }

    /// Keeps the cached blocks of `tokens`' prefix hit (whole blocks) from eviction until
    /// [`Self::unpin`]; returns the tokens pinned.
    pub fn pin(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        let (blocks, covered) = self.cached_hit(tokens, namespace, extra)?;
        for &b in &blocks {
            self.blocks.pin(b);
        }
        Ok(covered)
    }

    /// Undoes one [`Self::pin`] of the same prefix; returns the tokens unpinned.
    pub fn unpin(&mut self, tokens: &[u32], namespace: &[u8], extra: &[u8]) -> Result<usize> {
        let (blocks, covered) = self.cached_hit(tokens, namespace, extra)?;
        let pinned: Vec<BlockId> = blocks
            .into_iter()
            .filter(|&b| self.blocks.is_pinned(b))
            .collect();
        if pinned.is_empty() {
            return Ok(0);
        }
        for &b in pinned.iter().rev() {
            self.blocks.unpin(b);
        }
        Ok(covered)
    }

    /// Drops every cached block no sequence holds, and every cached state checkpoint no
    /// sequence holds; returns how many blocks.
    pub fn evict_all(&mut self) -> usize {
        let mut n = 0;
        while let Some(e) = self.blocks.evict_one(self.tiers.is_some()) {
            self.drop_checkpoints_at(e.meta.hash);
            if self.tiers.is_some() && !e.stored {
                // Freed, but not reused before this returns: its K/V are still there.
                self.write_back(e.block, &e.meta, &e.tokens);
            }
            n += 1;
        }
        self.evict_all_checkpoints();
        n
    }

    /// Blocks stored in and removed from the prefix index since the last call.
    pub fn drain_events(&mut self) -> Result<Vec<PrefixEvent>> {
        self.blocks.drain_events().ok_or_else(|| {
            KvError::NotSupported(
                "events are not recorded: create the pool with events=True".into(),
            )
        })
    }
}
