//! The block ledger: the one owner of "who holds this block, since when, and what it
//! holds" in a pool. It keeps the reference counts and generations (the allocator),
//! the prefix index (which blocks are cached under which hash, in which eviction
//! order) and the pins, in private fields; its methods are the only way to take, share,
//! free, cache, pin or evict a block, and its invariant check lives beside them.
//!
//! Invariants (checked by [`BlockLedger::check`]):
//! - a block is in exactly one state: free (in the free list, no reference, uncached),
//!   held (references > 0; cached or not), or evictable (no reference, cached, in the
//!   LRU list); a block taken for loading is parked (no reference, uncached, outside
//!   the free list) only until [`BlockLedger::adopt_loaded`] or [`BlockLedger::discard`];
//! - a cached block is immutable: no caller writes it (the pool copies it first);
//! - a block's generation changes whenever its references or its cached state change,
//!   so a plan that recorded the generations of the blocks it writes can tell when one
//!   of them has changed holder since.

use rustc_hash::FxHashMap;

use super::allocator::BlockAllocator;
use crate::error::Result;
use crate::layout::BlockId;
use crate::prefix::{CachedBlock, PrefixCounters, PrefixEvent, PrefixIndex};

/// A cached block that left the index to be reused: what the offload tiers need to
/// write it back (read before the block is overwritten).
#[derive(Clone, Debug)]
pub struct Evicted {
    /// The block.
    pub block: BlockId,
    /// Its index entry.
    pub meta: CachedBlock,
    /// Its token ids.
    pub tokens: Vec<u32>,
    /// Whether the offload tiers hold it already (written through, or loaded from them):
    /// it is not written again.
    pub stored: bool,
}

/// What the ledger knows of a cached block's copy in the offload tiers: the tiers hold
/// it, or how many prefix hits it had since it was cached (write-through-selective
/// writes it at a threshold).
const STORED: u32 = u32::MAX;

/// Reference counts, generations, the prefix index and pins of a pool's blocks, and
/// how far each block may hold K/V.
///
/// Invariant (written ends): positions at or past `written_end(b)` of block `b` hold
/// zeros in every layer of its group. The end moves up with every write and every claim
/// of positions ([`BlockLedger::wrote`], [`BlockLedger::claim`]), travels with the
/// contents when a block is copied ([`BlockLedger::copied`]) and never moves down when
/// positions are cut or a block changes holder: the K/V left there are still there. A
/// claim of positions below the end is told to zero from the claim to the end first, so
/// what a holder claims without writing reads as zeros, never as K/V of another holder
/// or another token prefix, whatever path (a fork, a partial hit, `copy_prefix`, a
/// rollback, a load) put the block in its hands.
#[derive(Debug)]
pub struct BlockLedger {
    alloc: BlockAllocator,
    prefix: Option<PrefixIndex>,
    pins: FxHashMap<BlockId, u32>,
    written_end: Vec<u32>,
    /// Per block: [`STORED`], or the prefix hits it had since it was cached.
    tier_marks: Vec<u32>,
    block_size: u32,
}

impl BlockLedger {
    /// `num_blocks` free blocks of `block_size` positions; caches prefixes in `prefix`
    /// when given. Fails ([`crate::KvError::OutOfMemory`]) when the host cannot hold the
    /// bookkeeping.
    pub fn new(num_blocks: usize, block_size: usize, prefix: Option<PrefixIndex>) -> Result<Self> {
        let block_size = u32::try_from(block_size).expect("slots fit in int32");
        // A device's fresh memory is not known to be zero: every block may hold anything.
        let written_end = crate::sizes::filled("the blocks' written ends", num_blocks, block_size)?;
        Ok(BlockLedger {
            alloc: BlockAllocator::new(num_blocks)?,
            prefix,
            pins: FxHashMap::default(),
            written_end,
            tier_marks: crate::sizes::filled("the blocks' tier marks", num_blocks, 0)?,
            block_size,
        })
    }

    /// Positions of `b` at or past this hold zeros in every layer (see the invariant).
    pub fn written_end(&self, b: BlockId) -> usize {
        self.written_end[b as usize] as usize
    }

    /// Records that positions below `end` of `b` were written.
    pub fn wrote(&mut self, b: BlockId, end: usize) {
        let e = &mut self.written_end[b as usize];
        *e = (*e).max(end.min(self.block_size as usize) as u32);
    }

    /// Records that the holder of `b` claims positions `from..to` in every layer (they
    /// read as zeros until written); returns the positions the caller must zero now in
    /// every layer, `from..written_end`, when the claim starts below the written end.
    #[must_use = "the returned positions must be zeroed"]
    pub fn claim(&mut self, b: BlockId, from: usize, to: usize) -> Option<std::ops::Range<usize>> {
        let end = self.written_end(b);
        self.written_end[b as usize] = to.min(self.block_size as usize) as u32;
        (from < end).then_some(from..end)
    }

    /// Gives `dst` the written end of `src`, whose contents were just copied onto it.
    pub fn copied(&mut self, src: BlockId, dst: BlockId) {
        self.written_end[dst as usize] = self.written_end[src as usize];
    }

    /// Blocks in the free list (not counting evictable cached ones).
    pub fn num_free(&self) -> usize {
        self.alloc.num_free()
    }

    /// Blocks that [`BlockLedger::take`] can hand out: free ones and evictable cached ones.
    pub fn num_available(&self) -> usize {
        self.alloc.num_free() + self.num_evictable()
    }

    /// Cached blocks no one holds.
    pub fn num_evictable(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.lru.len())
    }

    /// References to `block` (from sequences and pins).
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.alloc.refcount(block)
    }

    /// The generation of `block` (see the module's invariants).
    pub fn generation(&self, block: BlockId) -> u64 {
        self.alloc.generation(block)
    }

    /// Whether `block` is in the prefix index (and so immutable).
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.prefix
            .as_ref()
            .is_some_and(|p| p.meta(block).is_some())
    }

    /// Whether one holder may write `block` in place: exactly one reference, uncached.
    pub fn is_private(&self, block: BlockId) -> bool {
        self.alloc.refcount(block) == 1 && !self.is_cached(block)
    }

    /// The prefix index, when prefix caching is on.
    pub fn prefix(&self) -> Option<&PrefixIndex> {
        self.prefix.as_ref()
    }

    /// Pinned blocks and how many pins each has.
    pub fn pins(&self) -> impl Iterator<Item = (BlockId, u32)> + '_ {
        self.pins.iter().map(|(&b, &c)| (b, c))
    }

    // ----- holding ------------------------------------------------------------------------

    /// Takes a block for one holder: a free one, else the least recently used evictable
    /// cached one, which leaves the index (returned, with its tokens when `tokens` is
    /// true, for the offload tiers). `None` when no block is available.
    pub fn take(&mut self, tokens: bool) -> Option<(BlockId, Option<Evicted>)> {
        if let Some(b) = self.alloc.allocate() {
            return Some((b, None));
        }
        let e = self.pop_evictable(tokens)?;
        self.alloc.revive(e.block);
        Some((e.block, Some(e)))
    }

    /// Takes the least recently used evictable block out of the index (no reference, in
    /// no list: the caller revives or frees it).
    fn pop_evictable(&mut self, tokens: bool) -> Option<Evicted> {
        let p = self.prefix.as_mut()?;
        let b = p.lru.pop_front()?;
        let tokens = if tokens {
            p.block_tokens(b).to_vec()
        } else {
            Vec::new()
        };
        let meta = p.unregister(b);
        p.counters.evictions += 1;
        let stored = std::mem::take(&mut self.tier_marks[b as usize]) == STORED;
        Some(Evicted {
            block: b,
            meta,
            tokens,
            stored,
        })
    }

    /// Adds a reference to `b` (held, or cached and evictable: it leaves the eviction
    /// order).
    pub fn hold(&mut self, b: BlockId) {
        if self.alloc.refcount(b) == 0 {
            self.prefix
                .as_mut()
                .expect("only cached blocks rest unreferenced outside the free list")
                .lru
                .remove(b);
            self.alloc.revive(b);
        } else {
            self.alloc.share(b);
        }
    }

    /// Drops a reference to `b`; an unreferenced cached block becomes evictable (most
    /// recently used), any other goes back to the free list.
    pub fn release(&mut self, b: BlockId) {
        if self.alloc.release(b) {
            match self.prefix.as_mut() {
                Some(p) if p.meta(b).is_some() => p.lru.push_back(b),
                _ => self.alloc.push_free(b),
            }
        }
    }

    // ----- caching ------------------------------------------------------------------------

    /// Caches held block `b` under `meta` with `tokens` (hashed with the extra key
    /// `extra`); false (and nothing changes) when prefix caching is off, or the hash or
    /// the block is cached already.
    pub fn register(
        &mut self,
        b: BlockId,
        meta: CachedBlock,
        tokens: &[u32],
        extra: &[u8],
    ) -> bool {
        let Some(p) = self.prefix.as_mut() else {
            return false;
        };
        let registered = p.register(b, meta, tokens, extra);
        if registered {
            self.alloc.bump(b);
            self.tier_marks[b as usize] = 0;
        }
        registered
    }

    /// Records that the offload tiers hold cached block `b` (written through, or loaded
    /// from them): it is not written to them again while it stays cached.
    pub fn mark_stored(&mut self, b: BlockId) {
        self.tier_marks[b as usize] = STORED;
    }

    /// Whether the offload tiers hold cached block `b` ([`Self::mark_stored`]).
    pub fn is_stored(&self, b: BlockId) -> bool {
        self.tier_marks[b as usize] == STORED
    }

    /// Counts a prefix hit of cached block `b`; returns its hits since it was cached
    /// (`None` when the tiers hold it already).
    pub fn count_hit(&mut self, b: BlockId) -> Option<u32> {
        let m = &mut self.tier_marks[b as usize];
        (*m != STORED).then(|| {
            *m = (*m + 1).min(STORED - 1);
            *m
        })
    }

    /// Takes a free block (never an evictable one) to load a whole cached block into; it
    /// stays parked until [`BlockLedger::adopt_loaded`] or [`BlockLedger::discard`].
    pub fn take_for_loading(&mut self) -> Option<BlockId> {
        let b = self.alloc.allocate()?;
        assert!(self.alloc.release(b), "a fresh block has one reference");
        self.wrote(b, self.block_size as usize);
        Some(b)
    }

    /// Caches parked block `b` (loaded from a file or a tier) as evictable, most
    /// recently used; when its hash or block is cached already, `b` returns to the free
    /// list instead and false is returned.
    pub fn adopt_loaded(
        &mut self,
        b: BlockId,
        meta: CachedBlock,
        tokens: &[u32],
        extra: &[u8],
    ) -> bool {
        let p = self.prefix.as_mut().expect("loading needs prefix caching");
        if !p.register(b, meta, tokens, extra) {
            self.alloc.push_free(b);
            return false;
        }
        self.alloc.bump(b);
        p.lru.push_back(b);
        self.tier_marks[b as usize] = 0;
        true
    }

    /// Returns parked block `b` to the free list (a load that failed).
    pub fn discard(&mut self, b: BlockId) {
        self.alloc.push_free(b);
    }

    /// Evicts the least recently used evictable block to the free list; `None` when none
    /// is evictable.
    pub fn evict_one(&mut self, tokens: bool) -> Option<Evicted> {
        let e = self.pop_evictable(tokens)?;
        self.alloc.bump(e.block);
        self.alloc.push_free(e.block);
        Some(e)
    }

    /// Counts one prefix query of `tokens` tokens that found `hits` cached.
    pub fn count_query(&mut self, tokens: usize, hits: usize) {
        if let Some(p) = self.prefix.as_mut() {
            p.counters.queries += 1;
            p.counters.query_tokens += tokens as u64;
            p.counters.hit_tokens += hits as u64;
        }
    }

    /// The query and eviction counters (zeros without prefix caching).
    pub fn counters(&self) -> PrefixCounters {
        self.prefix
            .as_ref()
            .map_or_else(PrefixCounters::default, |p| p.counters)
    }

    /// Blocks stored in and removed from the index since the last call; `None` when
    /// prefix caching or its events are off.
    pub fn drain_events(&mut self) -> Option<Vec<PrefixEvent>> {
        self.prefix.as_mut().and_then(PrefixIndex::drain_events)
    }

    // ----- pins ---------------------------------------------------------------------------

    /// Pins cached block `b`: one more reference, counted as a pin.
    pub fn pin(&mut self, b: BlockId) {
        self.hold(b);
        *self.pins.entry(b).or_insert(0) += 1;
    }

    /// Whether `b` has a pin.
    pub fn is_pinned(&self, b: BlockId) -> bool {
        self.pins.contains_key(&b)
    }

    /// Removes one pin of `b` (which has one) and its reference.
    pub fn unpin(&mut self, b: BlockId) {
        let c = self.pins.get_mut(&b).expect("unpinning a pinned block");
        *c -= 1;
        if *c == 0 {
            self.pins.remove(&b);
        }
        self.release(b);
    }

    // ----- checks -------------------------------------------------------------------------

    /// Checks the ledger against `holders[b]`, the references the pool's sequences hold
    /// to each block: counts equal holders plus pins, the free list and the eviction
    /// order are exact, the prefix index is consistent.
    pub fn check(&self, holders: &[u32]) -> Result<(), String> {
        self.alloc.check(self.num_evictable())?;
        if let Some(p) = &self.prefix {
            p.check(|b| self.alloc.refcount(b))?;
        }
        for (b, &h) in holders.iter().enumerate() {
            let b = b as BlockId;
            let expected = h + self.pins.get(&b).copied().unwrap_or(0);
            if expected != self.alloc.refcount(b) {
                return Err(format!(
                    "block {b} has {expected} holders but counts {} references",
                    self.alloc.refcount(b)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::HashKind;

    fn ledger(n: usize) -> BlockLedger {
        let index = PrefixIndex::new(HashKind::Xxh3, 0, false, false, n, 2).unwrap();
        BlockLedger::new(n, 2, Some(index)).unwrap()
    }

    fn meta(hash: u128) -> CachedBlock {
        CachedBlock {
            hash,
            parent: 0,
            first: true,
            root: 0,
        }
    }

    #[test]
    fn a_cached_block_rests_evictable_and_is_taken_last() {
        let mut l = ledger(2);
        let (a, _) = l.take(false).unwrap();
        assert!(l.register(a, meta(1), &[1, 2], b""));
        l.release(a);
        assert_eq!((l.num_free(), l.num_evictable()), (1, 1));
        let (b, evicted) = l.take(true).unwrap();
        assert!(b != a && evicted.is_none());
        let (c, evicted) = l.take(true).unwrap();
        let e = evicted.expect("the cached block is evicted");
        assert_eq!((c, e.block, e.tokens), (a, a, vec![1, 2]));
        assert!(l.take(false).is_none());
        l.check(&[1, 1]).unwrap();
    }

    #[test]
    fn generations_move_with_holders_and_caching() {
        let mut l = ledger(1);
        let (a, _) = l.take(false).unwrap();
        let g = l.generation(a);
        assert!(l.register(a, meta(1), &[0, 0], b""));
        assert_ne!(l.generation(a), g);
        let g = l.generation(a);
        l.hold(a);
        assert_ne!(l.generation(a), g);
        assert!(!l.is_private(a));
    }

    #[test]
    fn claims_below_the_written_end_zero_up_to_it() {
        let mut l = ledger(2);
        let (a, _) = l.take(false).unwrap();
        // Fresh memory may hold anything.
        assert_eq!(l.claim(a, 0, 1), Some(0..2));
        assert_eq!(l.claim(a, 1, 2), None);
        // A copy holds what its source holds, whoever holds it next.
        let (b, _) = l.take(false).unwrap();
        assert_eq!(l.claim(b, 0, 0), Some(0..2));
        assert_eq!(l.written_end(b), 0);
        l.copied(a, b);
        assert_eq!(l.claim(b, 1, 2), Some(1..2));
        // Cut positions keep their K/V until claimed again.
        l.release(b);
        let (c, _) = l.take(false).unwrap();
        assert_eq!(c, b);
        assert_eq!(l.claim(c, 0, 1), Some(0..2));
        l.wrote(c, 2);
        assert_eq!(l.written_end(c), 2);
    }

    #[test]
    fn a_load_that_is_not_adopted_returns_its_block() {
        let mut l = ledger(2);
        let (a, _) = l.take(false).unwrap();
        assert!(l.register(a, meta(7), &[0, 0], b""));
        let b = l.take_for_loading().unwrap();
        assert!(
            !l.adopt_loaded(b, meta(7), &[0, 0], b""),
            "hash 7 is cached"
        );
        assert_eq!(l.num_free(), 1);
        l.check(&[1, 0]).unwrap();
        let b = l.take_for_loading().unwrap();
        l.discard(b);
        l.check(&[1, 0]).unwrap();
    }
}
