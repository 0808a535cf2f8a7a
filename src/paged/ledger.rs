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
}

/// Reference counts, generations, the prefix index and pins of a pool's blocks, and
/// which blocks may hold stale K/V past their holder's positions.
///
/// Invariant (stale tails): a block whose stale flag is clear holds zeros at every
/// position past those its holders hold in it. A block is flagged when it is taken for
/// a new holder (it holds whatever its previous holder left) and when a holder cuts
/// positions out of it; the pool clears the flag by zeroing the block from the first
/// position it claims without a write, so claims in clean blocks cost nothing.
#[derive(Debug)]
pub struct BlockLedger {
    alloc: BlockAllocator,
    prefix: Option<PrefixIndex>,
    pins: FxHashMap<BlockId, u32>,
    stale: Vec<bool>,
}

impl BlockLedger {
    /// `num_blocks` free blocks; caches prefixes in `prefix` when given. Fails
    /// ([`crate::KvError::OutOfMemory`]) when the host cannot hold the bookkeeping.
    pub fn new(num_blocks: usize, prefix: Option<PrefixIndex>) -> Result<Self> {
        // A device's fresh memory is not known to be zero: every block starts flagged.
        let stale = crate::sizes::filled("the pool's stale-block flags", num_blocks, true)?;
        Ok(BlockLedger {
            alloc: BlockAllocator::new(num_blocks)?,
            prefix,
            pins: FxHashMap::default(),
            stale,
        })
    }

    /// Flags `b` as possibly holding stale K/V past its holders' positions.
    pub fn mark_stale(&mut self, b: BlockId) {
        self.stale[b as usize] = true;
    }

    /// Gives `dst` the flag of `src`, whose whole contents were just copied onto it: a
    /// clean block's copy is clean (zeros past the positions the copy's holder keeps,
    /// which are at most those of `src`'s holders).
    pub fn copy_stale(&mut self, src: BlockId, dst: BlockId) {
        self.stale[dst as usize] = self.stale[src as usize];
    }

    /// Clears `b`'s stale flag; returns whether it was set (the caller then zeroes the
    /// block past the positions its holder keeps).
    pub fn take_stale(&mut self, b: BlockId) -> bool {
        std::mem::replace(&mut self.stale[b as usize], false)
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
    pub fn generation(&self, block: BlockId) -> u32 {
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
            self.stale[b as usize] = true;
            return Some((b, None));
        }
        let e = self.pop_evictable(tokens)?;
        self.alloc.revive(e.block);
        self.stale[e.block as usize] = true;
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
        Some(Evicted {
            block: b,
            meta,
            tokens,
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
        }
        registered
    }

    /// Takes a free block (never an evictable one) to load a cached block into; it stays
    /// parked until [`BlockLedger::adopt_loaded`] or [`BlockLedger::discard`].
    pub fn take_for_loading(&mut self) -> Option<BlockId> {
        let b = self.alloc.allocate()?;
        assert!(self.alloc.release(b), "a fresh block has one reference");
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
        BlockLedger::new(n, Some(index)).unwrap()
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
