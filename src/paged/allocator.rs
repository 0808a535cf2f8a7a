//! Reference-counted block allocation with an O(1) free list.

/// Index of a block in the pool.
pub type BlockId = u32;

/// Hands out blocks and counts references to them.
///
/// A block is free exactly when its count is 0, and then it sits in the free list once.
/// Allocation pops the list, release pushes to it: both O(1). Releasing a free block is a
/// bug in kvrs (a double free), and panics rather than corrupt the list.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    refcount: Vec<u32>,
    free: Vec<BlockId>,
}

impl BlockAllocator {
    /// `num_blocks` free blocks; block 0 is handed out first.
    pub fn new(num_blocks: usize) -> Self {
        BlockAllocator {
            refcount: vec![0; num_blocks],
            free: (0..num_blocks as BlockId).rev().collect(),
        }
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
        Some(b)
    }

    /// Adds a reference to a block in use.
    pub fn share(&mut self, block: BlockId) {
        let c = &mut self.refcount[block as usize];
        assert!(*c > 0, "sharing free block {block}");
        *c += 1;
    }

    /// Drops a reference; the block returns to the free list when none is left.
    pub fn release(&mut self, block: BlockId) {
        let c = &mut self.refcount[block as usize];
        assert!(*c > 0, "double free of block {block}");
        *c -= 1;
        if *c == 0 {
            self.free.push(block);
        }
    }

    /// Checks that the free list holds each zero-count block exactly once and nothing else.
    pub fn check(&self) -> Result<(), String> {
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
        if zero != self.free.len() {
            return Err(format!(
                "{zero} blocks have no reference but {} are free",
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
        let mut a = BlockAllocator::new(3);
        let (x, y, z) = (
            a.allocate().unwrap(),
            a.allocate().unwrap(),
            a.allocate().unwrap(),
        );
        assert_eq!((x, y, z), (0, 1, 2));
        assert_eq!(a.allocate(), None);
        a.share(y);
        a.release(y);
        assert_eq!(a.num_free(), 0);
        a.release(y);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.allocate(), Some(y));
        a.check().unwrap();
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = BlockAllocator::new(1);
        let b = a.allocate().unwrap();
        a.release(b);
        a.release(b);
    }
}
