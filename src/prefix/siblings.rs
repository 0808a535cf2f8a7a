//! Cached blocks by parent, for token-granular (partial) hits: per `(parent hash,
//! extra-key digest)`, the children ordered by their token ids.
//!
//! The child sharing the longest beginning with a wanted run of tokens is one of the
//! wanted run's two neighbours in that order (keys at or below it share a non-decreasing
//! beginning with it as they approach it, keys above it a non-increasing one), so a
//! partial match costs three `O(log n)` searches and no hashing, and insertion and
//! removal cost `O(log n)`, however many siblings a parent has: every distinct prompt is
//! a child of its namespace's root.

use std::collections::hash_map::Entry;
use std::collections::BTreeMap;
use std::ops::Bound::{Excluded, Included, Unbounded};

use rustc_hash::FxHashMap;

use super::hash::BlockHash;
use crate::layout::BlockId;

/// The children of one parent under one extra key, by their tokens. Most parents have
/// one child (every block of a chain but its first), kept without a tree.
#[derive(Debug)]
enum Children<T> {
    One(Box<[T]>, BlockId),
    Many(BTreeMap<Box<[T]>, BlockId>),
}

/// The children of every parent, each parent's ordered by tokens (`T` is `u32`, a token
/// id; tests count comparisons through another `T`).
#[derive(Debug)]
pub(crate) struct Siblings<T = u32> {
    by_parent: FxHashMap<(BlockHash, u128), Children<T>>,
}

impl<T> Default for Siblings<T> {
    fn default() -> Self {
        Siblings {
            by_parent: FxHashMap::default(),
        }
    }
}

/// Tokens two runs share at their beginning.
fn common<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<T: Ord + Clone> Siblings<T> {
    /// Files block `b` (holding `tokens`) under `parent` and extra-key digest `extra`.
    /// Siblings hold distinct tokens (same parent, tokens and extra key make the same
    /// hash, cached once); a second `b` for the same tokens replaces the first.
    pub fn insert(&mut self, parent: BlockHash, extra: u128, tokens: &[T], b: BlockId) {
        let children = match self.by_parent.entry((parent, extra)) {
            Entry::Vacant(e) => {
                e.insert(Children::One(tokens.into(), b));
                return;
            }
            Entry::Occupied(e) => e.into_mut(),
        };
        if let Children::One(t, c) = children {
            if **t == *tokens {
                *c = b;
                return;
            }
            let only = (std::mem::take(t), *c);
            *children = Children::Many(BTreeMap::from([only]));
        }
        if let Children::Many(m) = children {
            m.insert(tokens.into(), b);
        }
    }

    /// Removes the child of `parent` (under `extra`) holding `tokens`; returns its block.
    pub fn remove(&mut self, parent: BlockHash, extra: u128, tokens: &[T]) -> Option<BlockId> {
        let children = self.by_parent.get_mut(&(parent, extra))?;
        let (b, emptied) = match children {
            Children::One(t, c) => ((**t == *tokens).then_some(*c)?, true),
            Children::Many(m) => {
                let b = m.remove(tokens)?;
                (b, m.is_empty())
            }
        };
        if emptied {
            self.by_parent.remove(&(parent, extra));
        }
        Some(b)
    }

    /// The child of `parent` (under `extra`) holding `tokens`.
    pub fn get(&self, parent: BlockHash, extra: u128, tokens: &[T]) -> Option<BlockId> {
        match self.by_parent.get(&(parent, extra))? {
            Children::One(t, b) => (**t == *tokens).then_some(*b),
            Children::Many(m) => m.get(tokens).copied(),
        }
    }

    /// The child of `parent` (under `extra`) whose tokens share the longest beginning with
    /// `want`, and that length; `None` when none shares a token. Of several children
    /// sharing the longest beginning, the one whose tokens come first in order.
    pub fn best(&self, parent: BlockHash, extra: u128, want: &[T]) -> Option<(BlockId, usize)> {
        let children = match self.by_parent.get(&(parent, extra))? {
            Children::One(t, b) => return Some((*b, common(t, want))).filter(|m| m.1 > 0),
            Children::Many(m) => m,
        };
        let below = children
            .range::<[T], _>((Unbounded, Included(want)))
            .next_back();
        let above = children.range::<[T], _>((Excluded(want), Unbounded)).next();
        let n = [below, above]
            .into_iter()
            .flatten()
            .map(|(k, _)| common(k, want))
            .max()
            .filter(|&n| n > 0)?;
        // The first key at or above `want[..n]` begins with it: one key does, and every
        // key between `want[..n]` and it would begin with `want[..n]` too.
        let (_, &b) = children
            .range::<[T], _>((Included(&want[..n]), Unbounded))
            .next()?;
        Some((b, n))
    }

    /// Children filed, over every parent.
    pub fn len(&self) -> usize {
        self.by_parent
            .values()
            .map(|c| match c {
                Children::One(..) => 1,
                Children::Many(m) => m.len(),
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::cmp::Ordering;

    use super::*;

    thread_local! {
        static COMPARISONS: Cell<u64> = const { Cell::new(0) };
    }

    /// A token id that counts the comparisons made on it.
    #[derive(Clone, Debug)]
    struct Counted(u32);

    impl PartialEq for Counted {
        fn eq(&self, o: &Self) -> bool {
            COMPARISONS.with(|c| c.set(c.get() + 1));
            self.0 == o.0
        }
    }
    impl Eq for Counted {}
    impl PartialOrd for Counted {
        fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Counted {
        fn cmp(&self, o: &Self) -> Ordering {
            COMPARISONS.with(|c| c.set(c.get() + 1));
            self.0.cmp(&o.0)
        }
    }

    fn counted(f: impl FnOnce()) -> u64 {
        COMPARISONS.with(|c| c.set(0));
        f();
        COMPARISONS.with(Cell::get)
    }

    const BS: usize = 16;

    /// Block `i` of a root's one-block prompts: distinct, sharing beginnings in pairs.
    fn prompt(i: u32) -> Vec<Counted> {
        let mut t: Vec<Counted> = (0..BS as u32).map(|j| Counted(j * 7 % 5)).collect();
        t[BS - 4] = Counted(i / 2);
        t[BS - 1] = Counted(i);
        t
    }

    /// Matching and removing one of `n` root children compares tokens of a few siblings
    /// (a few per level of the tree), never of all of them: evicting every root child is
    /// `O(n log n)`, not `O(n²)`, and a lookup does not grow with the cache.
    #[test]
    fn matching_and_removal_do_not_visit_every_sibling() {
        let mut costs = Vec::new();
        for n in [1_000u32, 100_000] {
            let mut s = Siblings::<Counted>::default();
            for i in 0..n {
                s.insert(7, 0, &prompt(i), i);
            }
            let mut want = prompt(n / 3);
            want[BS - 1] = Counted(u32::MAX);
            let mut best = None;
            let find = counted(|| best = s.best(7, 0, &want[..BS - 1]));
            assert_eq!(best, Some((n / 3 / 2 * 2, BS - 1)));
            let remove = counted(|| assert_eq!(s.remove(7, 0, &prompt(n / 3)), Some(n / 3)));
            let bound = 40 * BS as u64 * u64::from(n.ilog2() + 1);
            assert!(
                find < bound && remove < bound,
                "{n}: {find}, {remove} vs {bound}"
            );
            costs.push(find + remove);
        }
        // 100x the siblings, not 100x the work (a scan would compare every sibling).
        assert!(costs[1] < 3 * costs[0], "{costs:?}");
    }

    #[test]
    fn best_prefers_the_longest_then_the_first_in_order() {
        let mut s = Siblings::<u32>::default();
        s.insert(1, 0, &[5, 6, 7, 8], 10);
        s.insert(1, 0, &[5, 6, 1, 1], 11);
        s.insert(1, 0, &[5, 9, 9, 9], 12);
        s.insert(1, 3, &[5, 6, 7, 9], 13);
        s.insert(2, 0, &[5, 6, 7, 9], 14);
        assert_eq!(s.best(1, 0, &[5, 6, 7]), Some((10, 3)));
        assert_eq!(s.best(1, 0, &[5, 6, 9]), Some((11, 2)));
        assert_eq!(s.best(1, 0, &[5, 7]), Some((11, 1)));
        assert_eq!(s.best(1, 0, &[4]), None);
        assert_eq!(s.best(1, 0, &[]), None);
        assert_eq!(s.best(1, 3, &[5, 6, 7, 8]), Some((13, 3)));
        assert_eq!(s.best(9, 0, &[5]), None);
        assert_eq!(s.remove(1, 0, &[5, 6, 1, 1]), Some(11));
        assert_eq!(s.best(1, 0, &[5, 6, 9]), Some((10, 2)));
        assert_eq!(s.remove(1, 3, &[5, 6, 7, 9]), Some(13));
        assert_eq!(s.remove(1, 3, &[5, 6, 7, 9]), None);
        assert_eq!(s.len(), 3);
        assert_eq!(s.get(2, 0, &[5, 6, 7, 9]), Some(14));
        assert_eq!(s.get(2, 0, &[5, 6, 7, 8]), None);
        assert_eq!(s.best(2, 0, &[5, 6, 0]), Some((14, 2)));
        assert_eq!(s.best(2, 0, &[0]), None);
        s.insert(2, 0, &[5, 6, 7, 9], 15);
        assert_eq!((s.get(2, 0, &[5, 6, 7, 9]), s.len()), (Some(15), 3));
    }
}
