//! A cache-wide suffix index for speculative decoding without a draft model
//! (SuffixDecoding, Oliaro et al.; vLLM's `suffix` method through Arctic Inference):
//! token sequences (prompts and outputs of requests, running or finished) go in, and a
//! request's last tokens draft what followed them in any retained sequence of its
//! namespace, the most frequent continuation first.
//!
//! - **Trie.** Every window of at most `max_depth` tokens of every retained sequence is
//!   a counted path from its namespace's root ([`trie`]); a running sequence's new
//!   tokens extend its open windows in O(`max_depth`) each.
//! - **Drafts.** For each match length `p` (the last `p` tokens of the context, as a
//!   path), the draft follows the most counted child while the product of
//!   `count(child) / count(parent)` stays at least `min_token_prob`, at most
//!   `min(max_tokens, floor(p * max_spec_factor + max_spec_offset))` tokens: the draft
//!   length adapts to the match's confidence. Its score is the sum of those
//!   probabilities (the expected accepted tokens); the best score wins, ties to the
//!   longer match. Arctic Inference's `SuffixTree::speculate` with `use_tree_spec=False`.
//! - **Namespaces.** Each (namespace, extra key) has its own root, as prefix caching has
//!   its own chain root: a lookup never sees another namespace's tokens.
//! - **Memory.** At most `max_tokens` tokens are retained (a sequence longer than that
//!   keeps its first `max_tokens`); over that, whole sequences go in least recently
//!   written order (its own LRU). Nodes never exceed `max_depth` per retained token, and
//!   removing a sequence frees exactly the nodes only it counted.

mod trie;

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;

use crate::error::{KvError, Result};
use trie::Trie;

/// How a lookup drafts (vLLM's `suffix_decoding_*` settings).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SuffixParams {
    /// The most tokens a draft holds.
    pub max_tokens: usize,
    /// Draft at most `floor(p * max_spec_factor + max_spec_offset)` tokens after a match
    /// of `p` tokens.
    pub max_spec_factor: f64,
    /// See `max_spec_factor`.
    pub max_spec_offset: f64,
    /// A draft stops before the token whose path probability falls below this.
    pub min_token_prob: f64,
}

impl Default for SuffixParams {
    fn default() -> Self {
        SuffixParams {
            max_tokens: 16,
            max_spec_factor: 1.0,
            max_spec_offset: 0.0,
            min_token_prob: 0.1,
        }
    }
}

/// A lookup's draft: its tokens, each one's path probability, their sum (the expected
/// accepted tokens) and the length of the match it continues (0: no draft).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SuffixDraft {
    /// The drafted token ids.
    pub tokens: Vec<u32>,
    /// Each drafted token's probability (product of count ratios along its path).
    pub probs: Vec<f64>,
    /// The sum of `probs`.
    pub score: f64,
    /// Tokens of the context the draft's match covers.
    pub match_len: usize,
}

/// Size and counters of a [`SuffixIndex`] (the pool's `stats()` reports them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SuffixStats {
    /// Sequences retained.
    pub sequences: usize,
    /// Tokens retained (at most `max_tokens`).
    pub tokens: usize,
    /// The token budget.
    pub max_tokens: usize,
    /// Trie nodes in use, roots included.
    pub nodes: usize,
    /// Bytes held (trie and tokens), an estimate.
    pub bytes: usize,
    /// Sequences evicted to stay within `max_tokens`.
    pub evictions: u64,
    /// Lookups made.
    pub lookups: u64,
    /// Lookups that drafted at least one token.
    pub hits: u64,
}

#[derive(Debug)]
struct Entry {
    space: Vec<u8>,
    tokens: Vec<u32>,
    /// The nodes of its windows still shorter than `max_depth`, oldest (deepest) first.
    open: VecDeque<u32>,
    tick: u64,
}

#[derive(Debug)]
struct Space {
    root: u32,
    sequences: usize,
}

/// Token sequences by namespace, indexed by their windows (see the module's docs).
#[derive(Debug)]
pub struct SuffixIndex {
    max_tokens: usize,
    max_depth: usize,
    trie: Trie,
    spaces: FxHashMap<Vec<u8>, Space>,
    entries: FxHashMap<u64, Entry>,
    /// Entries by last write, oldest first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    next_id: u64,
    tokens: usize,
    evictions: u64,
    lookups: u64,
    hits: u64,
}

/// The key of a (namespace, extra key) pair: the namespace's length, then both.
fn space_key(namespace: &[u8], extra: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(8 + namespace.len() + extra.len());
    k.extend_from_slice(&(namespace.len() as u64).to_le_bytes());
    k.extend_from_slice(namespace);
    k.extend_from_slice(extra);
    k
}

impl SuffixIndex {
    /// An empty index retaining at most `max_tokens` tokens, in windows of at most
    /// `max_depth` (match plus draft); both must be at least 1 (`max_depth` at least 2).
    pub fn new(max_tokens: usize, max_depth: usize) -> Result<Self> {
        if max_tokens < 1 {
            return Err(KvError::InvalidArgument {
                name: "max_tokens",
                value: max_tokens.to_string(),
                reason: "must be >= 1".into(),
            });
        }
        if !(2..=1024).contains(&max_depth) {
            return Err(KvError::InvalidArgument {
                name: "max_depth",
                value: max_depth.to_string(),
                reason: "must be in [2, 1024] (a match and at least one drafted token)".into(),
            });
        }
        Ok(SuffixIndex {
            max_tokens,
            max_depth,
            trie: Trie::default(),
            spaces: FxHashMap::default(),
            entries: FxHashMap::default(),
            lru: BTreeMap::new(),
            tick: 0,
            next_id: 0,
            tokens: 0,
            evictions: 0,
            lookups: 0,
            hits: 0,
        })
    }

    /// The token budget.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The longest window (match plus draft).
    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Adds `tokens` as a new sequence of (`namespace`, `extra`); returns its handle
    /// (for [`Self::extend`] and [`Self::remove`]). Older sequences may be evicted.
    pub fn insert(&mut self, namespace: &[u8], extra: &[u8], tokens: &[u32]) -> u64 {
        let space = space_key(namespace, extra);
        let sp = match self.spaces.get_mut(&space) {
            Some(sp) => sp,
            None => {
                let root = self.trie.root();
                self.spaces
                    .entry(space.clone())
                    .or_insert(Space { root, sequences: 0 })
            }
        };
        sp.sequences += 1;
        let id = self.next_id;
        self.next_id += 1;
        self.tick += 1;
        self.lru.insert(self.tick, id);
        self.entries.insert(
            id,
            Entry {
                space,
                tokens: Vec::new(),
                open: VecDeque::new(),
                tick: self.tick,
            },
        );
        self.append(id, tokens);
        id
    }

    /// Appends `tokens` to sequence `handle` (a running request's new output); fails
    /// when no sequence has that handle (never added, removed or evicted).
    pub fn extend(&mut self, handle: u64, tokens: &[u32]) -> Result<()> {
        let Some(e) = self.entries.get_mut(&handle) else {
            return Err(unknown(handle));
        };
        self.lru.remove(&e.tick);
        self.tick += 1;
        e.tick = self.tick;
        self.lru.insert(self.tick, handle);
        self.append(handle, tokens);
        Ok(())
    }

    /// Whether sequence `handle` is retained.
    pub fn contains(&self, handle: u64) -> bool {
        self.entries.contains_key(&handle)
    }

    /// The tokens retained of sequence `handle`.
    pub fn tokens(&self, handle: u64) -> Option<&[u32]> {
        self.entries.get(&handle).map(|e| e.tokens.as_slice())
    }

    /// Handles of the retained sequences, least recently written first.
    pub fn handles(&self) -> Vec<u64> {
        self.lru.values().copied().collect()
    }

    fn append(&mut self, id: u64, tokens: &[u32]) {
        let depth = self.max_depth as u32;
        let e = self
            .entries
            .get_mut(&id)
            .expect("appending to a retained entry");
        let root = self.spaces[&e.space].root;
        let take = tokens.len().min(self.max_tokens - e.tokens.len());
        for &t in &tokens[..take] {
            e.open.push_back(root);
            for n in e.open.iter_mut() {
                *n = self.trie.step(*n, t);
            }
            while e
                .open
                .front()
                .is_some_and(|&n| self.trie.nodes[n as usize].depth >= depth)
            {
                e.open.pop_front();
            }
            e.tokens.push(t);
        }
        self.tokens += take;
        while self.tokens > self.max_tokens {
            let (&tick, &victim) = self
                .lru
                .iter()
                .find(|&(_, &v)| v != id)
                .expect("another sequence holds the excess");
            let _ = tick;
            self.remove(victim);
            self.evictions += 1;
        }
    }

    /// Removes sequence `handle` and every window only it counted; false when it was
    /// not retained.
    pub fn remove(&mut self, handle: u64) -> bool {
        let Some(e) = self.entries.remove(&handle) else {
            return false;
        };
        self.lru.remove(&e.tick);
        let sp = self.spaces.get_mut(&e.space).expect("an entry's namespace");
        let root = sp.root;
        let n = e.tokens.len();
        for i in 0..n {
            self.trie
                .unwind(root, &e.tokens[i..(i + self.max_depth).min(n)]);
        }
        self.tokens -= n;
        sp.sequences -= 1;
        if sp.sequences == 0 {
            self.spaces.remove(&e.space);
            self.trie.free_node(root);
        }
        true
    }

    /// Removes every sequence.
    pub fn clear(&mut self) {
        let evictions = self.evictions;
        let (lookups, hits) = (self.lookups, self.hits);
        *self = SuffixIndex::new(self.max_tokens, self.max_depth).expect("valid sizes");
        self.evictions = evictions;
        self.lookups = lookups;
        self.hits = hits;
    }

    /// The draft after `context` (a request's tokens so far; only its last
    /// `max_depth - 1` matter) from the sequences of (`namespace`, `extra`).
    pub fn speculate(
        &mut self,
        namespace: &[u8],
        extra: &[u8],
        context: &[u32],
        params: &SuffixParams,
    ) -> SuffixDraft {
        self.lookups += 1;
        let d = self.draft(namespace, extra, context, params);
        if !d.tokens.is_empty() {
            self.hits += 1;
        }
        d
    }

    /// [`Self::speculate`] without counting the lookup.
    pub fn draft(
        &self,
        namespace: &[u8],
        extra: &[u8],
        context: &[u32],
        params: &SuffixParams,
    ) -> SuffixDraft {
        let mut best = SuffixDraft::default();
        let Some(sp) = self.spaces.get(&space_key(namespace, extra)) else {
            return best;
        };
        let longest = context.len().min(self.max_depth - 1);
        'matches: for p in 1..=longest {
            let mut node = sp.root;
            for &t in &context[context.len() - p..] {
                match self.trie.child(node, t) {
                    Some(c) => node = c,
                    // No longer match exists either: its last p tokens would be a path.
                    None => break 'matches,
                }
            }
            let cap = (p as f64 * params.max_spec_factor + params.max_spec_offset).floor();
            let cap = if cap > 0.0 { cap as usize } else { 0 };
            let cap = cap.min(params.max_tokens).min(self.max_depth - p);
            let mut draft = SuffixDraft {
                match_len: p,
                ..SuffixDraft::default()
            };
            let mut prob = 1.0f64;
            while draft.tokens.len() < cap {
                let Some(c) = self.trie.best_child(node) else {
                    break;
                };
                let (cn, nn) = (
                    &self.trie.nodes[c as usize],
                    &self.trie.nodes[node as usize],
                );
                prob *= cn.count as f64 / nn.count as f64;
                if prob < params.min_token_prob {
                    break;
                }
                draft.tokens.push(cn.token);
                draft.probs.push(prob);
                draft.score += prob;
                node = c;
            }
            if !draft.tokens.is_empty() && draft.score >= best.score {
                best = draft;
            }
        }
        best
    }

    /// Its size and counters.
    pub fn stats(&self) -> SuffixStats {
        let token_bytes: usize = self.entries.values().map(|e| e.tokens.capacity() * 4).sum();
        SuffixStats {
            sequences: self.entries.len(),
            tokens: self.tokens,
            max_tokens: self.max_tokens,
            nodes: self.trie.live,
            bytes: self.trie.bytes() + token_bytes,
            evictions: self.evictions,
            lookups: self.lookups,
            hits: self.hits,
        }
    }
}

fn unknown(handle: u64) -> KvError {
    KvError::InvalidArgument {
        name: "handle",
        value: handle.to_string(),
        reason: "no sequence of the suffix index has it (never added, removed or evicted)".into(),
    }
}
