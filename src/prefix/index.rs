//! The prefix index: which full blocks are cached under which chained hash, their
//! parents and tokens (for partial matches), the LRU order of the evictable ones, the
//! events an external router consumes, and hit counters.

use rustc_hash::FxHashMap;

use super::hash::{BlockHash, HashKind};
use super::lru::Lru;
use crate::paged::BlockId;

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
    children: FxHashMap<BlockHash, Vec<BlockId>>,
    /// Cached blocks no sequence holds, least recently used first: the eviction order.
    pub lru: Lru,
    /// Events since the last drain, or `None` when they are not recorded.
    events: Option<Vec<PrefixEvent>>,
    /// Query and eviction counters.
    pub counters: PrefixCounters,
}

impl PrefixIndex {
    /// An empty index for a pool of `num_blocks` blocks of `block_size`.
    pub fn new(
        kind: HashKind,
        seed: u128,
        partial_hits: bool,
        events: bool,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        PrefixIndex {
            kind,
            seed,
            partial_hits,
            block_size,
            by_hash: FxHashMap::default(),
            meta: vec![None; num_blocks],
            tokens: vec![0; num_blocks * block_size],
            children: FxHashMap::default(),
            lru: Lru::new(num_blocks),
            events: events.then(Vec::new),
            counters: PrefixCounters::default(),
        }
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

    /// Cached blocks whose parent is `parent`.
    pub fn children(&self, parent: BlockHash) -> &[BlockId] {
        self.children.get(&parent).map_or(&[], Vec::as_slice)
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Caches block `b` under `hash` (`meta` without its hash); false (and nothing
    /// changes) when the hash is already cached or the block already is.
    pub fn register(&mut self, b: BlockId, meta: CachedBlock, tokens: &[u32]) -> bool {
        let CachedBlock { hash, parent, .. } = meta;
        if self.by_hash.contains_key(&hash) || self.meta[b as usize].is_some() {
            return false;
        }
        self.by_hash.insert(hash, b);
        self.meta[b as usize] = Some(meta);
        self.tokens[b as usize * self.block_size..(b as usize + 1) * self.block_size]
            .copy_from_slice(tokens);
        self.children.entry(parent).or_default().push(b);
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
        if let Some(c) = self.children.get_mut(&m.parent) {
            c.retain(|&x| x != b);
            if c.is_empty() {
                self.children.remove(&m.parent);
            }
        }
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

    /// Checks that hashes, metadata, children and the LRU list agree.
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
