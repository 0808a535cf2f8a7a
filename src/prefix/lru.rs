//! An intrusive doubly linked list over block ids: O(1) push to the back, removal of any
//! member and pop from the front, with no allocation after construction.

use crate::error::Result;
use crate::paged::BlockId;
use crate::sizes;

const NIL: BlockId = BlockId::MAX;

/// Least recently used order of a set of blocks (front = least recent).
#[derive(Clone, Debug)]
pub struct Lru {
    prev: Vec<BlockId>,
    next: Vec<BlockId>,
    member: Vec<bool>,
    head: BlockId,
    tail: BlockId,
    len: usize,
}

impl Lru {
    /// An empty list for blocks `0..num_blocks`; fails ([`crate::KvError::OutOfMemory`])
    /// when the host cannot hold its links.
    pub fn new(num_blocks: usize) -> Result<Self> {
        Ok(Lru {
            prev: sizes::filled("the eviction order", num_blocks, NIL)?,
            next: sizes::filled("the eviction order", num_blocks, NIL)?,
            member: sizes::filled("the eviction order", num_blocks, false)?,
            head: NIL,
            tail: NIL,
            len: 0,
        })
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `b` is in the list.
    pub fn contains(&self, b: BlockId) -> bool {
        self.member[b as usize]
    }

    /// Appends `b` as the most recently used.
    pub fn push_back(&mut self, b: BlockId) {
        assert!(
            !self.member[b as usize],
            "block {b} is already in the LRU list"
        );
        self.member[b as usize] = true;
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.len += 1;
    }

    /// Takes `b` out of the list.
    pub fn remove(&mut self, b: BlockId) {
        assert!(self.member[b as usize], "block {b} is not in the LRU list");
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.member[b as usize] = false;
        self.len -= 1;
    }

    /// Takes the least recently used block.
    pub fn pop_front(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// Members from least to most recently used.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        std::iter::successors((self.head != NIL).then_some(self.head), |&b| {
            let n = self.next[b as usize];
            (n != NIL).then_some(n)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_removal() {
        let mut l = Lru::new(5).unwrap();
        for b in [3, 1, 4] {
            l.push_back(b);
        }
        l.remove(1);
        l.push_back(0);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![3, 4, 0]);
        assert_eq!(l.pop_front(), Some(3));
        l.remove(0);
        assert_eq!(l.pop_front(), Some(4));
        assert_eq!(l.pop_front(), None);
        assert!(l.is_empty());
    }
}
