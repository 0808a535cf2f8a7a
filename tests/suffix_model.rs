//! Property test: the suffix index against a brute-force reference.
//!
//! Random sequences in two namespaces are added, extended, removed and evicted (a
//! small token budget over tiny vocabularies, so that windows repeat) while the
//! reference keeps the retained sequences as plain lists with their LRU order. After
//! every operation: the retained sequences and their order match, the token budget
//! holds, the trie holds exactly one node per distinct window prefix (nothing leaked
//! by eviction), and every lookup drafts what a scan over the retained sequences of
//! its own namespace drafts.

use kvrs::{SuffixDraft, SuffixIndex, SuffixParams};
use proptest::prelude::*;
use std::collections::BTreeSet;

const DEPTH: usize = 5;
const BUDGET: usize = 40;
const NAMESPACES: [&[u8]; 2] = [b"a", b"b"];

#[derive(Clone, Debug)]
enum Op {
    Add(usize, Vec<u32>),
    Extend(usize, Vec<u32>),
    Remove(usize),
    Lookup(usize, Vec<u32>, usize, u8),
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 0..max)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, tokens(14)).prop_map(|(n, t)| Op::Add(n, t)),
        3 => (0..8usize, tokens(6)).prop_map(|(i, t)| Op::Extend(i, t)),
        1 => (0..8usize).prop_map(Op::Remove),
        4 => (0..2usize, tokens(8), 0..6usize, 0..4u8).prop_map(|(n, c, k, p)| Op::Lookup(n, c, k, p)),
    ]
}

/// The retained sequences: (handle, namespace, tokens), least recently written first.
#[derive(Default)]
struct Model {
    seqs: Vec<(u64, usize, Vec<u32>)>,
}

impl Model {
    fn total(&self) -> usize {
        self.seqs.iter().map(|s| s.2.len()).sum()
    }

    fn write(&mut self, handle: u64, ns: usize, tokens: &[u32]) {
        let pos = self.seqs.iter().position(|s| s.0 == handle);
        let mut s = pos.map_or((handle, ns, Vec::new()), |p| self.seqs.remove(p));
        let room = BUDGET - s.2.len();
        s.2.extend_from_slice(&tokens[..tokens.len().min(room)]);
        self.seqs.push(s);
        while self.total() > BUDGET {
            let victim = self.seqs.iter().position(|s| s.0 != handle).unwrap();
            self.seqs.remove(victim);
        }
    }

    /// Windows of namespace `ns` that `path` is a prefix of.
    fn count(&self, ns: usize, path: &[u32]) -> usize {
        if path.len() > DEPTH {
            return 0;
        }
        self.seqs
            .iter()
            .filter(|s| s.1 == ns)
            .map(|s| {
                (0..s.2.len())
                    .filter(|&i| s.2[i..].starts_with(path))
                    .count()
            })
            .sum()
    }

    /// Distinct non-empty window prefixes per namespace, plus a root per namespace.
    fn nodes(&self) -> usize {
        let mut paths = BTreeSet::new();
        for s in &self.seqs {
            for i in 0..s.2.len() {
                for j in i + 1..=(i + DEPTH).min(s.2.len()) {
                    paths.insert((s.1, s.2[i..j].to_vec()));
                }
            }
        }
        let spaces: BTreeSet<usize> = self.seqs.iter().map(|s| s.1).collect();
        paths.len() + spaces.len()
    }

    fn draft(&self, ns: usize, context: &[u32], params: &SuffixParams) -> SuffixDraft {
        let mut best = SuffixDraft::default();
        for p in 1..=context.len().min(DEPTH - 1) {
            let mut path = context[context.len() - p..].to_vec();
            if self.count(ns, &path) == 0 {
                break;
            }
            let cap = (p as f64 * params.max_spec_factor + params.max_spec_offset).floor();
            let cap = (cap.max(0.0) as usize)
                .min(params.max_tokens)
                .min(DEPTH - p);
            let mut d = SuffixDraft {
                match_len: p,
                ..SuffixDraft::default()
            };
            let mut prob = 1.0f64;
            while d.tokens.len() < cap {
                let parent = self.count(ns, &path);
                // The most counted next token, the smallest among equals.
                let best_next = (0u32..3)
                    .map(|t| {
                        let mut q = path.clone();
                        q.push(t);
                        (self.count(ns, &q), t)
                    })
                    .filter(|&(c, _)| c > 0)
                    .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
                let Some((c, t)) = best_next else { break };
                prob *= c as f64 / parent as f64;
                if prob < params.min_token_prob {
                    break;
                }
                d.tokens.push(t);
                d.probs.push(prob);
                d.score += prob;
                path.push(t);
            }
            if !d.tokens.is_empty() && d.score >= best.score {
                best = d;
            }
        }
        best
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn suffix_index_matches_a_scan(ops in prop::collection::vec(op(), 1..40)) {
        let mut index = SuffixIndex::new(BUDGET, DEPTH).unwrap();
        let mut model = Model::default();
        let mut handles: Vec<u64> = Vec::new();
        for op in ops {
            match op {
                Op::Add(ns, t) => {
                    let h = index.insert(NAMESPACES[ns], b"", &t);
                    model.write(h, ns, &t);
                    handles.push(h);
                }
                Op::Extend(i, t) => {
                    let Some(&h) = handles.get(i) else { continue };
                    let retained = model.seqs.iter().find(|s| s.0 == h).map(|s| s.1);
                    let r = index.extend(h, &t);
                    prop_assert_eq!(r.is_ok(), retained.is_some());
                    if let Some(ns) = retained {
                        model.write(h, ns, &t);
                    }
                }
                Op::Remove(i) => {
                    let Some(&h) = handles.get(i) else { continue };
                    let pos = model.seqs.iter().position(|s| s.0 == h);
                    prop_assert_eq!(index.remove(h), pos.is_some());
                    if let Some(p) = pos {
                        model.seqs.remove(p);
                    }
                }
                Op::Lookup(ns, context, k, prob) => {
                    let params = SuffixParams {
                        max_tokens: k,
                        max_spec_factor: 1.0 + f64::from(prob % 2),
                        max_spec_offset: f64::from(prob / 2),
                        min_token_prob: [0.0, 0.1, 0.3, 0.6][prob as usize],
                    };
                    let got = index.speculate(NAMESPACES[ns], b"", &context, &params);
                    prop_assert_eq!(got, model.draft(ns, &context, &params));
                }
            }
            // Retained sequences, their LRU order, the budget, and no leaked nodes.
            let order: Vec<u64> = model.seqs.iter().map(|s| s.0).collect();
            prop_assert_eq!(index.handles(), order);
            for s in &model.seqs {
                prop_assert_eq!(index.tokens(s.0), Some(s.2.as_slice()));
            }
            let st = index.stats();
            prop_assert!(st.tokens <= BUDGET);
            prop_assert_eq!(st.tokens, model.total());
            prop_assert_eq!(st.nodes, model.nodes());
            prop_assert!(st.nodes <= st.tokens * DEPTH + NAMESPACES.len());
        }
    }
}

/// A namespace never drafts from another's tokens, nor from another extra key's.
#[test]
fn namespaces_are_isolated() {
    let mut index = SuffixIndex::new(1000, 8).unwrap();
    index.insert(b"tenant-a", b"", &[1, 2, 3, 4, 5, 6]);
    let p = SuffixParams::default();
    assert_eq!(
        index.speculate(b"tenant-a", b"", &[9, 2, 3], &p).tokens,
        vec![4, 5]
    );
    assert!(index
        .speculate(b"tenant-b", b"", &[9, 2, 3], &p)
        .tokens
        .is_empty());
    assert!(index
        .speculate(b"tenant-a", b"lora", &[9, 2, 3], &p)
        .tokens
        .is_empty());
    // The key is (namespace, extra), not their concatenation.
    index.insert(b"ab", b"", &[7, 8, 9]);
    assert!(index.speculate(b"a", b"b", &[7, 8], &p).tokens.is_empty());
}

/// The most frequent continuation wins, and confidence shortens the draft.
#[test]
fn frequency_scores_the_draft() {
    let mut index = SuffixIndex::new(1000, 8).unwrap();
    for _ in 0..3 {
        index.insert(b"", b"", &[1, 2, 3, 4]);
    }
    index.insert(b"", b"", &[1, 2, 7, 7]);
    let p = SuffixParams::default();
    let d = index.speculate(b"", b"", &[1, 2], &p);
    assert_eq!(d.tokens, vec![3, 4]);
    assert_eq!(d.match_len, 2);
    assert!((d.probs[0] - 0.75).abs() < 1e-12 && (d.score - 1.5).abs() < 1e-12);
    // A shorter match allows fewer tokens: half a token per matched token here.
    let half = SuffixParams {
        max_spec_factor: 0.5,
        ..p
    };
    assert_eq!(index.speculate(b"", b"", &[1, 2], &half).tokens, vec![3]);
    let strict = SuffixParams {
        min_token_prob: 0.8,
        ..p
    };
    assert!(index
        .speculate(b"", b"", &[1, 2], &strict)
        .tokens
        .is_empty());
}

/// One sequence longer than the budget keeps its first `max_tokens` tokens; the
/// budget evicts least recently written sequences first.
#[test]
fn the_budget_bounds_memory() {
    let mut index = SuffixIndex::new(10, 4).unwrap();
    let a = index.insert(b"", b"", &[1, 2, 3]);
    let b = index.insert(b"", b"", &[4, 5, 6]);
    index.extend(a, &[7]).unwrap();
    let c = index.insert(b"", b"", &[8, 9, 10, 11]);
    assert!(!index.contains(b) && index.contains(a) && index.contains(c));
    assert_eq!(index.stats().evictions, 1);
    let d = index.insert(b"", b"", &(0..50).collect::<Vec<_>>());
    assert_eq!(index.handles(), vec![d]);
    assert_eq!(index.tokens(d).unwrap().len(), 10);
    assert_eq!(index.stats().tokens, 10);
    assert!(index.extend(b, &[1]).is_err());
    assert!(SuffixIndex::new(0, 4).is_err());
    assert!(SuffixIndex::new(4, 1).is_err());
}
