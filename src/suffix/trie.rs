//! The counted suffix trie behind [`super::SuffixIndex`]: every window of at most
//! `max_depth` tokens of every retained sequence is a path from its namespace's root,
//! each node counting the windows through it (so a child never counts more than its
//! parent). Nodes live in an arena with a free list; `(parent, token)` edges in a hash
//! map for O(1) descent, and each node's children in a vector (with each child's slot
//! in it) for the best-child scan and O(1) unlinking.

use rustc_hash::FxHashMap;

/// No node (a root's parent).
pub(crate) const NIL: u32 = u32::MAX;

/// One trie node: the token on the edge into it, its depth, and the windows through it.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub token: u32,
    pub parent: u32,
    pub depth: u32,
    pub count: u32,
    /// Its index in its parent's `children`.
    slot: u32,
    pub children: Vec<u32>,
}

/// The arena of nodes, their edges and free list.
#[derive(Debug, Default)]
pub(crate) struct Trie {
    pub nodes: Vec<Node>,
    free: Vec<u32>,
    edges: FxHashMap<(u32, u32), u32>,
    /// Nodes in use (roots included).
    pub live: usize,
}

impl Trie {
    /// A new root (a namespace's).
    pub fn root(&mut self) -> u32 {
        self.alloc(Node {
            token: 0,
            parent: NIL,
            depth: 0,
            count: 0,
            slot: 0,
            children: Vec::new(),
        })
    }

    fn alloc(&mut self, node: Node) -> u32 {
        self.live += 1;
        if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    /// The child of `node` along `token`, if any.
    pub fn child(&self, node: u32, token: u32) -> Option<u32> {
        self.edges.get(&(node, token)).copied()
    }

    /// Counts one more window through `node`'s child along `token` (created when new).
    pub fn step(&mut self, node: u32, token: u32) -> u32 {
        let c = match self.child(node, token) {
            Some(c) => c,
            None => {
                let depth = self.nodes[node as usize].depth + 1;
                let slot = self.nodes[node as usize].children.len() as u32;
                let c = self.alloc(Node {
                    token,
                    parent: node,
                    depth,
                    count: 0,
                    slot,
                    children: Vec::new(),
                });
                self.nodes[node as usize].children.push(c);
                self.edges.insert((node, token), c);
                c
            }
        };
        self.nodes[c as usize].count += 1;
        c
    }

    /// Counts one window less along `path` from `root` (a window counted by `step`s);
    /// nodes left with no window are freed.
    pub fn unwind(&mut self, root: u32, path: &[u32]) {
        let mut node = root;
        let mut trail: smallvec::SmallVec<[u32; 32]> = smallvec::SmallVec::new();
        for &t in path {
            match self.child(node, t) {
                Some(c) => {
                    trail.push(c);
                    node = c;
                }
                None => break,
            }
        }
        debug_assert_eq!(trail.len(), path.len(), "a window that was never counted");
        // Deepest first: a node's count is at least its children's, so the freed nodes
        // are a tail of the trail and each is a leaf when it goes.
        for &c in trail.iter().rev() {
            let n = &mut self.nodes[c as usize];
            n.count -= 1;
            if n.count == 0 {
                self.unlink(c);
            }
        }
    }

    fn unlink(&mut self, c: u32) {
        let (parent, token, slot) = {
            let n = &self.nodes[c as usize];
            debug_assert!(n.children.is_empty());
            (n.parent, n.token, n.slot as usize)
        };
        self.edges.remove(&(parent, token));
        let siblings = &mut self.nodes[parent as usize].children;
        siblings.swap_remove(slot);
        if let Some(&moved) = siblings.get(slot) {
            self.nodes[moved as usize].slot = slot as u32;
        }
        self.free_node(c);
    }

    /// Frees `c` (a leaf, or a root with no children).
    pub fn free_node(&mut self, c: u32) {
        let n = &mut self.nodes[c as usize];
        n.children = Vec::new();
        n.count = 0;
        self.free.push(c);
        self.live -= 1;
    }

    /// The child of `node` with the most windows (the smallest token among equals).
    pub fn best_child(&self, node: u32) -> Option<u32> {
        let mut best: Option<(u32, u32, u32)> = None;
        for &c in &self.nodes[node as usize].children {
            let n = &self.nodes[c as usize];
            let better = match best {
                None => true,
                Some((count, token, _)) => n.count > count || (n.count == count && n.token < token),
            };
            if better {
                best = Some((n.count, n.token, c));
            }
        }
        best.map(|(_, _, c)| c)
    }

    /// Bytes the trie holds (nodes, child vectors, edges), an estimate.
    pub fn bytes(&self) -> usize {
        let node = std::mem::size_of::<Node>();
        // Every node but a root is one entry of its parent's children (vectors at most
        // twice as long as they are full).
        let children = self.nodes.len() * 4 * 2;
        // An FxHashMap entry: key, value and a control byte, at its load factor.
        let edge = (std::mem::size_of::<((u32, u32), u32)>() + 1) * 8 / 7;
        self.nodes.capacity() * node
            + self.free.capacity() * 4
            + children
            + self.edges.capacity() * edge
    }
}
