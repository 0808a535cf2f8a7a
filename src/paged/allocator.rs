//! Reference-counted block allocation with an O(1) free list, and each block's
//! generation.

use crate::error::Result;
use crate::layout::BlockId;
use crate::sizes;

/// Hands out blocks, counts references to them and numbers their changes of holder.
///
/// A block with count 0 is either in the free list (once) or parked by the caller (a
/// cached block waiting in the prefix index's LRU list). Allocation pops the free list,
/// [`BlockAllocator::push_free`] returns a block to it: both O(1). Releasing a block
/// with no reference is a bug in kvrs (a double free), and panics rather than corrupt
/// the counts.
///
/// Every change of a block's references (allocation, sharing, release, revival) and
/// every [`BlockAllocator::bump`] moves its generation on, so a handle that recorded a
/// block's generation (a reserved batch) can tell that the block has since changed
/// holder.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    refcount: Vec<u32>,
    generation: Vec<u64>,
    free: Vec<BlockId>,
}

impl BlockAllocator {
    /// `num_blocks` free blocks; block 0 is handed out first. Fails
    /// ([`crate::KvError::OutOfMemory`]) when the host cannot hold the counts.
    pub fn new(num_blocks: usize) -> Result<Self> {
        let refcount = sizes::filled("the block reference counts", num_blocks, 0)?;
        let generation = sizes::filled("the block generations", num_blocks, 0)?;
        let mut free = sizes::with_capacity("the free-block list", num_blocks)?;
        free.extend((0..num_blocks as BlockId).rev());
        Ok(BlockAllocator {
            refcount,
            generation,
            free,
        })
    }

    /// The generation of `block`: it changes whenever the block's references do.
    ///
    /// 64 bits never wrap: a block changing holder every nanosecond would take 584
    /// years to come back to a generation a plan recorded, so equal generations mean
    /// no change of holder.
    pub fn generation(&self, block: BlockId) -> u64 {
        self.generation[block as usize]
    }

    /// Moves `block`'s generation on (its holders or its cached state changed).
    pub fn bump(&mut self, block: BlockId) {
        let g = &mut self.generation[block as usize];
        *g += 1;
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks with no reference.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// References to `block`.
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcount[block as usize]
    }

    /// Takes a free block (count 1), or `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        debug_assert_eq!(self.refcount[b as usize], 0);
        self.refcount[b as usize] = 1;
        self.bump(b);
        Some(b)
    }

    /// Adds a reference to a block in use.
    pub fn share(&mut self, block: BlockId) {
        let c = &mut self.refcount[block as usize];
        assert!(*c > 0, "sharing free block {block}");
        *c += 1;
        self.bump(block);
    }

    /// Gives a parked block (count 0, not in the free list) its first reference again.
    pub fn revive(&mut self, block: BlockId) {
        let c = &mut self.refcount[block as usize];
        assert!(*c == 0, "reviving block {block} that has {c} references");
        *c = 1;
        self.bump(block);
    }

    /// Drops a reference; true when none is left, and the caller then either
    /// [`push_free`](Self::push_free)s the block or parks it.
    #[must_use]
    pub fn release(&mut self, block: BlockId) -> bool {
        let c = &mut self.refcount[block as usize];
        assert!(*c > 0, "double free of block {block}");
        *c -= 1;
        let none_left = *c == 0;
        self.bump(block);
        none_left
    }

    /// Returns a block with no reference to the free list.
    pub fn push_free(&mut self, block: BlockId) {
        debug_assert_eq!(self.refcount[block as usize], 0);
        self.free.push(block);
    }

    /// Checks that the free list holds zero-count blocks only, each once, and that
    /// `parked` more zero-count blocks exist outside it.
    pub fn check(&self, parked: usize) -> Result<(), String> {
        let mut seen = vec![false; self.refcount.len()];
        for &b in &self.free {
            if seen[b as usize] {
                return Err(format!("block {b} is in the free list twice"));
            }
            if self.refcount[b as usize] != 0 {
                return Err(format!(
                    "block {b} is free but has {} references",
                    self.refcount[b as usize]
                ));
            }
            seen[b as usize] = true;
        }
        let zero = self.refcount.iter().filter(|&&c| c == 0).count();
        if zero != self.free.len() + parked {
            return Err(format!(
                "{zero} blocks have no reference but {} are free and {parked} parked",
                self.free.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_share_release() {
        let mut a = BlockAllocator::new(3).unwrap();
        let (x, y, z) = (
            a.allocate().unwrap(),
            a.allocate().unwrap(),
            a.allocate().unwrap(),
        );
        assert_eq!((x, y, z), (0, 1, 2));
        assert_eq!(a.allocate(), None);
        a.share(y);
        assert!(!a.release(y));
        assert_eq!(a.num_free(), 0);
        assert!(a.release(y));
        a.push_free(y);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.allocate(), Some(y));
        assert!(a.release(z));
        a.check(1).unwrap();
        a.revive(z);
        a.check(0).unwrap();
    }

    #[test]
    fn every_change_of_references_moves_the_generation() {
        let mut a = BlockAllocator::new(2).unwrap();
        let b = a.allocate().unwrap();
        let g = a.generation(b);
        a.share(b);
        assert_ne!(a.generation(b), g);
        let g = a.generation(b);
        assert!(!a.release(b));
        assert_ne!(a.generation(b), g);
        let g = a.generation(b);
        assert!(a.release(b));
        a.push_free(b);
        let g2 = a.generation(b);
        assert_ne!(g2, g);
        assert_eq!(a.allocate(), Some(b));
        assert_ne!(a.generation(b), g2);
    }

    #[test]
    fn generations_do_not_wrap_into_a_recorded_one() {
        // A block that changed holder 2^32 times (a long-running server's hot block)
        // must not come back to the generation a stale plan recorded.
        let mut a = BlockAllocator::new(1).unwrap();
        let b = a.allocate().unwrap();
        let recorded = a.generation(b);
        for _ in 0..1u64 << 32 {
            a.bump(b);
        }
        assert_ne!(a.generation(b), recorded);
        assert_eq!(a.generation(b), recorded + (1 << 32));
    }

    #[test]
    fn an_unallocatable_pool_is_an_error() {
        assert!(BlockAllocator::new(usize::MAX / 2).is_err());
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = BlockAllocator::new(1).unwrap();
        let b = a.allocate().unwrap();
        assert!(a.release(b));
        let _ = a.release(b);
    }
}
