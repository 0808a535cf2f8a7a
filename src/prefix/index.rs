//! The prefix index: which full blocks are cached under which chained hash, their
//! parents, tokens and extra keys, the children of each parent (for partial matches),
//! the LRU order of the evictable ones, the events an external router consumes, and hit
//! counters.

use rustc_hash::FxHashMap;

use super::extras::ExtraKeys;
use super::hash::{BlockHash, HashKind};
use super::lru::Lru;
use super::siblings::Siblings;
use crate::error::Result;
use crate::paged::BlockId;
use crate::sizes;

/// What the index knows of one cached block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedBlock {
    /// The block's chained hash.
    pub hash: BlockHash,
    /// Its parent's hash (a chain root for a first block).
    pub parent: BlockHash,
    /// Whether it is the first block of its chain (its parent is a root).
    pub first: bool,
    /// The root of its chain (its namespace's): where the offload tiers file it.
    pub root: BlockHash,
}

/// A block entering or leaving the index, as vLLM's KV events report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixEvent {
    /// True when stored, false when removed.
    pub stored: bool,
    /// The block's hash.
    pub hash: BlockHash,
    /// Its parent's hash.
    pub parent: BlockHash,
    /// Tokens the block holds (always `block_size`: only full blocks are cached).
    pub num_tokens: usize,
    /// The block's id in the pool.
    pub block: BlockId,
}

/// Counters of prefix queries (see the pool's `stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCounters {
    /// Prompts looked up when starting sequences.
    pub queries: u64,
    /// Tokens of those prompts.
    pub query_tokens: u64,
    /// Tokens served from the cache.
    pub hit_tokens: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
}

/// Cached full blocks by hash, with their LRU order.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Hash function.
    pub kind: HashKind,
    /// Seed of every chain root.
    pub seed: u128,
    /// Whether a prompt may match the beginning of a cached block (token-granular hits).
    pub partial_hits: bool,
    block_size: usize,
    by_hash: FxHashMap<BlockHash, BlockId>,
    meta: Vec<Option<CachedBlock>>,
    tokens: Vec<u32>,
    /// Each block's extra key (an id into `extras`).
    extra: Vec<u32>,
    extras: ExtraKeys,
    /// Children by parent, kept only for partial hits.
    children: Option<Siblings>,
    /// Cached blocks no sequence holds, least recently used first: the eviction order.
    pub lru: Lru,
    /// Events since the last drain, or `None` when they are not recorded.
    events: Option<Vec<PrefixEvent>>,
    /// Query and eviction counters.
    pub counters: PrefixCounters,
}

impl PrefixIndex {
    /// An empty index for a pool of `num_blocks` blocks of `block_size`; fails
    /// ([`crate::KvError::OutOfMemory`]) when the host cannot hold its tables.
    pub fn new(
        kind: HashKind,
        seed: u128,
        partial_hits: bool,
        events: bool,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self> {
        let token_count = crate::sizes::product(
            "the prefix index's token ids",
            &[("num_blocks", num_blocks), ("block_size", block_size)],
        )?;
        Ok(PrefixIndex {
            kind,
            seed,
            partial_hits,
            block_size,
            by_hash: FxHashMap::default(),
            meta: sizes::filled("the prefix index's block entries", num_blocks, None)?,
            tokens: sizes::filled("the prefix index's token ids", token_count, 0)?,
            extra: sizes::filled("the prefix index's extra keys", num_blocks, 0)?,
            extras: ExtraKeys::default(),
            children: partial_hits.then(Siblings::default),
            lru: Lru::new(num_blocks)?,
            events: events.then(Vec::new),
            counters: PrefixCounters::default(),
        })
    }

    /// The chain root of `namespace`.
    pub fn root(&self, namespace: &[u8]) -> BlockHash {
        self.kind.root(self.seed, namespace)
    }

    /// The cached block under `hash`.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    /// What the index knows of block `b`, if it is cached.
    pub fn meta(&self, b: BlockId) -> Option<CachedBlock> {
        self.meta[b as usize]
    }

    /// The token ids of cached block `b`.
    pub fn block_tokens(&self, b: BlockId) -> &[u32] {
        &self.tokens[b as usize * self.block_size..(b as usize + 1) * self.block_size]
    }

    /// The extra key cached block `b` was hashed with.
    pub fn block_extra(&self, b: BlockId) -> &[u8] {
        self.extras.bytes(self.extra[b as usize])
    }

    /// With partial hits on, the cached child of `parent` hashed with `extra` whose tokens
    /// share the longest beginning with `want`, and that length (at least 1). Of several
    /// children sharing the longest beginning, the one whose tokens come first in token
    /// order. `O(log siblings)`, no hashing.
    pub fn partial_match(
        &self,
        parent: BlockHash,
        extra: &[u8],
        want: &[u32],
    ) -> Option<(BlockId, usize)> {
        let children = self.children.as_ref()?;
        let id = self.extras.find(extra)?;
        children.best(parent, self.extras.digest(id), want)
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Caches block `b` (holding `tokens`, hashed with `extra`) as `meta` says; false
    /// (and nothing changes) when the hash is already cached or the block already is.
    pub fn register(
        &mut self,
        b: BlockId,
        meta: CachedBlock,
        tokens: &[u32],
        extra: &[u8],
    ) -> bool {
        let CachedBlock { hash, parent, .. } = meta;
        if self.by_hash.contains_key(&hash) || self.meta[b as usize].is_some() {
            return false;
        }
        self.by_hash.insert(hash, b);
        self.meta[b as usize] = Some(meta);
        self.tokens[b as usize * self.block_size..(b as usize + 1) * self.block_size]
            .copy_from_slice(tokens);
        let id = self.extras.acquire(extra);
        self.extra[b as usize] = id;
        if let Some(c) = self.children.as_mut() {
            c.insert(parent, self.extras.digest(id), tokens, b);
        }
        if let Some(ev) = self.events.as_mut() {
            ev.push(PrefixEvent {
                stored: true,
                hash,
                parent,
                num_tokens: self.block_size,
                block: b,
            });
        }
        true
    }

    /// Forgets cached block `b` (it must not be in the LRU list).
    pub fn unregister(&mut self, b: BlockId) -> CachedBlock {
        let m = self.meta[b as usize]
            .take()
            .expect("unregistering a block that is not cached");
        self.by_hash.remove(&m.hash);
        let id = self.extra[b as usize];
        if let Some(c) = self.children.as_mut() {
            let span = b as usize * self.block_size..(b as usize + 1) * self.block_size;
            c.remove(m.parent, self.extras.digest(id), &self.tokens[span]);
        }
        self.extras.release(id);
        if let Some(ev) = self.events.as_mut() {
            ev.push(PrefixEvent {
                stored: false,
                hash: m.hash,
                parent: m.parent,
                num_tokens: self.block_size,
                block: b,
            });
        }
        m
    }

    /// Events since the last call, or `None` when events are not recorded.
    pub fn drain_events(&mut self) -> Option<Vec<PrefixEvent>> {
        self.events.as_mut().map(std::mem::take)
    }

    /// Checks that hashes, metadata, children, extra keys and the LRU list agree.
    pub fn check(&self, refcount: impl Fn(BlockId) -> u32) -> Result<(), String> {
        for (&h, &b) in &self.by_hash {
            match self.meta[b as usize] {
                Some(m) if m.hash == h => {}
                other => {
                    return Err(format!(
                        "hash {h:032x} points at block {b} whose metadata is {other:?}"
                    ))
                }
            }
        }
        let cached = self.meta.iter().filter(|m| m.is_some()).count();
        if cached != self.by_hash.len() {
            return Err(format!(
                "{cached} blocks carry metadata but {} hashes are indexed",
                self.by_hash.len()
            ));
        }
        let mut uses: FxHashMap<u32, u32> = FxHashMap::default();
        for (b, m) in self.meta.iter().enumerate() {
            let Some(m) = m else { continue };
            let id = self.extra[b];
            *uses.entry(id).or_default() += 1;
            if let Some(c) = &self.children {
                let filed = c.get(
                    m.parent,
                    self.extras.digest(id),
                    self.block_tokens(b as BlockId),
                );
                if filed != Some(b as BlockId) {
                    return Err(format!(
                        "block {b} is filed as {filed:?} among its siblings"
                    ));
                }
            }
        }
        if let Some(c) = self.children.as_ref().filter(|c| c.len() != cached) {
            return Err(format!(
                "{} children filed for {cached} cached blocks",
                c.len()
            ));
        }
        self.extras.check(&uses)?;
        for b in 0..self.meta.len() as BlockId {
            let evictable = self.meta[b as usize].is_some() && refcount(b) == 0;
            if self.lru.contains(b) != evictable {
                return Err(format!(
                    "block {b}: in LRU {} but cached-and-unreferenced {evictable}",
                    self.lru.contains(b)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const BS: usize = 4;
    const BLOCKS: usize = 12;
    const EXTRAS: [&[u8]; 3] = [b"", b"lora-a", b"lora-b"];

    #[derive(Clone, Debug)]
    enum Op {
        /// Caches block `b` under parent pick `parent` (a root, or a cached block).
        Register {
            b: BlockId,
            parent: usize,
            tokens: Vec<u32>,
            extra: usize,
        },
        Unregister(usize),
        Match {
            parent: usize,
            want: Vec<u32>,
            extra: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let tokens = |n| prop::collection::vec(0..3u32, n);
        prop_oneof![
            3 => (0..BLOCKS as BlockId, 0..8usize, tokens(BS..=BS), 0..3usize)
                .prop_map(|(b, parent, tokens, extra)| Op::Register { b, parent, tokens, extra }),
            1 => (0..8usize).prop_map(Op::Unregister),
            3 => (0..8usize, tokens(0..=BS), 0..3usize)
                .prop_map(|(parent, want, extra)| Op::Match { parent, want, extra }),
        ]
    }

    /// The reference: cached children in insertion order, scanned for every question.
    #[derive(Clone, Debug)]
    struct Child {
        b: BlockId,
        meta: CachedBlock,
        tokens: Vec<u32>,
        extra: usize,
    }

    const ROOTS: [BlockHash; 2] = [11, 22];

    fn parent_of(model: &[Child], pick: usize) -> BlockHash {
        match pick.checked_sub(ROOTS.len()) {
            None => ROOTS[pick],
            Some(i) if !model.is_empty() => model[i % model.len()].meta.hash,
            Some(_) => ROOTS[0],
        }
    }

    /// The longest common beginning over the children of `parent` under `extra`; of
    /// several, the one whose tokens come first in order.
    fn reference_match(
        model: &[Child],
        parent: BlockHash,
        extra: usize,
        want: &[u32],
    ) -> Option<(BlockId, usize)> {
        let common = |t: &[u32]| t.iter().zip(want).take_while(|(a, b)| a == b).count();
        model
            .iter()
            .filter(|c| c.meta.parent == parent && c.extra == extra && common(&c.tokens) > 0)
            .min_by(|x, y| {
                common(&y.tokens)
                    .cmp(&common(&x.tokens))
                    .then(x.tokens.cmp(&y.tokens))
            })
            .map(|c| (c.b, common(&c.tokens)))
    }

    fn run(partial_hits: bool, ops: &[Op]) {
        let kind = HashKind::Blake3;
        let mut index = PrefixIndex::new(kind, 5, partial_hits, true, BLOCKS, BS).unwrap();
        let mut model: Vec<Child> = Vec::new();
        for op in ops {
            match op {
                Op::Register {
                    b,
                    parent,
                    tokens,
                    extra,
                } => {
                    let parent = parent_of(&model, *parent);
                    let hash = kind.block(parent, tokens, EXTRAS[*extra]);
                    let first = ROOTS.contains(&parent);
                    let meta = CachedBlock {
                        hash,
                        parent,
                        first,
                        root: if first { parent } else { 0 },
                    };
                    let fresh = !model.iter().any(|c| c.b == *b || c.meta.hash == hash);
                    assert_eq!(index.register(*b, meta, tokens, EXTRAS[*extra]), fresh);
                    if fresh {
                        model.push(Child {
                            b: *b,
                            meta,
                            tokens: tokens.clone(),
                            extra: *extra,
                        });
                    }
                }
                Op::Unregister(pick) => {
                    if !model.is_empty() {
                        let c = model.remove(pick % model.len());
                        assert_eq!(index.unregister(c.b), c.meta);
                    }
                }
                Op::Match {
                    parent,
                    want,
                    extra,
                } => {
                    let parent = parent_of(&model, *parent);
                    let want_match = if partial_hits {
                        reference_match(&model, parent, *extra, want)
                    } else {
                        None
                    };
                    assert_eq!(
                        index.partial_match(parent, EXTRAS[*extra], want),
                        want_match
                    );
                }
            }
            index.check(|_| 1).unwrap();
            assert_eq!(index.len(), model.len());
            for c in &model {
                assert_eq!(index.lookup(c.meta.hash), Some(c.b));
                assert_eq!(index.meta(c.b), Some(c.meta));
                assert_eq!(index.block_tokens(c.b), c.tokens.as_slice());
                assert_eq!(index.block_extra(c.b), EXTRAS[c.extra]);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        /// The index against a scan of every cached child: registration, removal, partial
        /// matches (longest common beginning, same parent and extra key, ties to the
        /// first in token order) and the stored tokens and extra keys.
        #[test]
        fn index_matches_a_scan_of_all_children(ops in prop::collection::vec(op(), 1..80), partial in any::<bool>()) {
            run(partial, &ops);
        }
    }
}
