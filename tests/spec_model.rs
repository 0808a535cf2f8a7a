//! Property test: speculative decoding over a pool with prefix caching.
//!
//! Sequences are prefilled and decoded as in `prefix_model` (the K/V at position `p` is a
//! function of the token ids up to `p`), and take draft steps: a chain or a tree of
//! draft tokens is placed by one batch at the positions after the sequence, each node's
//! K/V written as a model with tree attention computes it (a function of the committed
//! tokens and the node's path from the root), committed by the batch or not, and then a
//! random root path (or a prefix of it) is accepted with `accept`, the rest cut. After
//! every step each sequence's K/V must equal the function of its tokens, whatever was
//! forked, cached, hit or evicted (a tree's rejected or reordered K/V in the prefix cache
//! would be read back by a later prompt), the invariants hold, and positions a batch
//! reserves without writing read as zeros (no draft of an earlier holder leaks).

use kvrs::unstable::{PoolCore, TensorMut, TensorRef};
use kvrs::{DType, Device, HashKind, KvError, KvLayout, PagedShape, PrefixConfig, SeqId};
use proptest::prelude::*;

const L: usize = 2;
const H: usize = 2;
const D: usize = 2;
const BS: usize = 4;
const BLOCKS: usize = 18;

/// The K (or V, `kv = 1`) vector a model would compute at `pos` after `tokens[..=pos]`.
fn kv_of(tokens: &[u32], pos: usize, layer: usize, kv: usize) -> Vec<f32> {
    let mut h: u64 = 0xcbf29ce484222325;
    for &t in &tokens[..=pos] {
        h = (h ^ t as u64).wrapping_mul(0x100000001b3);
    }
    (0..H * D)
        .map(|i| {
            let x = h
                .wrapping_add((layer * 131 + kv * 17 + i) as u64)
                .wrapping_mul(0x9e3779b97f4a7c15)
                >> 58;
            // Never zero: a zero would pass for an unwritten position.
            x as f32 / 4.0 + 0.125
        })
        .collect()
}

fn tensor<'a>(v: &'a [f32], shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_f32(v, shape).unwrap()
}

fn tensor_mut<'a>(v: &'a mut [f32], shape: &[usize]) -> TensorMut<'a> {
    TensorMut::from_f32_mut(v, shape).unwrap()
}

/// A prompt: the first `shared` tokens of a common preamble, then 2-id noise.
fn prompt(shared: usize, suffix: usize, seed: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (1..=shared as u32).collect();
    t.extend((0..suffix).map(|i| 100 + (seed.wrapping_mul(2654435761) >> (i % 16)) % 2));
    t
}

/// A draft: node `j` has token `tokens[j]` and parent `parents[j]` (`< j`; node 0 is
/// the root), placed at slot `start + j`.
#[derive(Clone, Debug)]
struct Draft {
    tokens: Vec<u32>,
    parents: Vec<usize>,
}

impl Draft {
    fn new(n: usize, tree: bool, seed: u32) -> Self {
        let r = |i: usize, m: u32| {
            (seed.wrapping_mul(2654435761).wrapping_add(i as u32 * 40503) >> 7) % m
        };
        let tokens = (0..n).map(|i| 200 + r(i, 2)).collect();
        let parents = (0..n)
            .map(|j| match j {
                0 => 0,
                _ if tree => r(j + 50, j as u32) as usize,
                _ => j - 1,
            })
            .collect();
        Draft { tokens, parents }
    }

    /// Node indices from the root to `j`.
    fn path(&self, mut j: usize) -> Vec<usize> {
        let mut p = vec![j];
        while j != 0 {
            j = self.parents[j];
            p.push(j);
        }
        p.reverse();
        p
    }

    /// The tokens a model sees at node `j`: the committed ones, then its path's.
    fn context(&self, committed: &[u32], j: usize) -> Vec<u32> {
        let mut t = committed.to_vec();
        t.extend(self.path(j).iter().map(|&x| self.tokens[x]));
        t
    }
}

#[derive(Clone, Debug)]
enum Op {
    New {
        shared: usize,
        suffix: usize,
        seed: u32,
    },
    /// A prompt that continues a draft batch's tokens in slot order (a tree's slot
    /// order is not a path: its K/V must never be served for it).
    Replay {
        which: usize,
        len: usize,
    },
    Prefill(usize),
    Decode {
        seq: usize,
        n: usize,
        seed: u32,
    },
    Spec {
        seq: usize,
        n: usize,
        tree: bool,
        seed: u32,
        leaf: usize,
        cut: usize,
        commit: bool,
    },
    Reserve {
        seq: usize,
        n: usize,
    },
    Fork(usize),
    Free(usize),
    Truncate(usize, usize),
    EvictAll,
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..5usize;
    prop_oneof![
        3 => (0..14usize, 0..5usize, any::<u32>()).prop_map(|(shared, suffix, seed)| Op::New { shared, suffix, seed }),
        3 => i.clone().prop_map(Op::Prefill),
        2 => (i.clone(), 1..4usize, any::<u32>()).prop_map(|(seq, n, seed)| Op::Decode { seq, n, seed }),
        5 => (i.clone(), 1..8usize, any::<bool>(), any::<u32>(), any::<usize>(), 0..3usize, any::<bool>())
            .prop_map(|(seq, n, tree, seed, leaf, cut, commit)| Op::Spec { seq, n, tree, seed, leaf, cut, commit }),
        1 => (i.clone(), 1..6usize).prop_map(|(seq, n)| Op::Reserve { seq, n }),
        1 => i.clone().prop_map(Op::Fork),
        2 => i.clone().prop_map(Op::Free),
        1 => (i, 0..24usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        2 => (any::<usize>(), 0..40usize).prop_map(|(which, len)| Op::Replay { which, len }),
        1 => Just(Op::EvictAll),
    ]
}

struct Live {
    id: SeqId,
    tokens: Vec<u32>,
}

struct World {
    pool: PoolCore,
    live: Vec<Live>,
    /// Each draft batch's tokens in slot order, after the committed ones.
    drafted: Vec<Vec<u32>>,
}

impl World {
    fn pick(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    fn committed(&self, i: usize) -> usize {
        self.pool.seq(self.live[i].id).unwrap().seq_len
    }

    /// Appends positions `start..start + n` of `tokens` to every layer and commits them.
    fn extend(&mut self, i: usize, tokens: &[u32], n: usize) -> bool {
        let id = self.live[i].id;
        let start = self.committed(i);
        for layer in 0..L {
            let kv = |x| {
                (start..start + n)
                    .flat_map(|p| kv_of(tokens, p, layer, x))
                    .collect::<Vec<_>>()
            };
            let (k, v) = (kv(0), kv(1));
            match self.pool.append(
                id,
                layer as i64,
                &tensor(&k, &[n, H, D]),
                &tensor(&v, &[n, H, D]),
            ) {
                Ok(_) => {}
                Err(KvError::CacheFull { .. }) => return false,
                Err(e) => panic!("{e:?}"),
            }
        }
        self.pool
            .advance(id, n as i64, Some(&tokens[start..start + n]))
            .unwrap();
        true
    }

    /// One speculative step of sequence `i`: `n` draft nodes, the path to node
    /// `leaf % n` accepted without its last `cut` nodes.
    #[allow(clippy::too_many_arguments)]
    fn spec(
        &mut self,
        i: usize,
        n: usize,
        tree: bool,
        seed: u32,
        leaf: usize,
        cut: usize,
        commit: bool,
    ) {
        let id = self.live[i].id;
        let start = self.committed(i);
        if start != self.live[i].tokens.len() {
            return; // prefill first
        }
        let draft = Draft::new(n, tree, seed);
        let ids = vec![id; n];
        let plan = match self.pool.start_forward(&ids, None, Some(&draft.tokens)) {
            Ok(p) => p,
            Err(KvError::CacheFull { .. }) => return,
            Err(e) => panic!("{e:?}"),
        };
        // A chain's K/V are those of its tokens in slot order; a tree's are not, and
        // must stay out of the prefix cache until accepted.
        if tree {
            plan.mark_draft();
        }
        let committed = self.live[i].tokens.clone();
        self.drafted
            .push([committed.clone(), draft.tokens.clone()].concat());
        for layer in 0..L {
            let kv = |x| {
                (0..n)
                    .flat_map(|j| {
                        kv_of(
                            &draft.context(&committed, j),
                            start + draft.path(j).len() - 1,
                            layer,
                            x,
                        )
                    })
                    .collect::<Vec<_>>()
            };
            let (k, v) = (kv(0), kv(1));
            self.pool
                .forward_write(
                    &plan,
                    layer as i64,
                    &tensor(&k, &[n, H, D]),
                    &tensor(&v, &[n, H, D]),
                )
                .unwrap();
        }
        if commit {
            self.pool.finish_forward(&plan).unwrap();
        }
        let mut path = draft.path(leaf % n);
        path.truncate(path.len().saturating_sub(cut));
        let keep: Vec<i64> = path.iter().map(|&j| j as i64).collect();
        // Refusals first: they change nothing.
        let before = self.pool.seq(id).unwrap().clone();
        let bad = [vec![0, 0], vec![n as i64], vec![-1]];
        for b in &bad {
            assert!(matches!(
                self.pool.accept(id, start as i64, b),
                Err(KvError::InvalidArgument { .. })
            ));
            assert_eq!(self.pool.seq(id).unwrap(), &before);
        }
        match self.pool.accept(id, start as i64, &keep) {
            Ok(()) => {}
            Err(KvError::CacheFull { .. }) => {
                // Copies of shared blocks did not fit: roll the whole draft back.
                assert_eq!(self.pool.seq(id).unwrap(), &before);
                self.pool.truncate(id, start as i64).unwrap();
                if !commit {
                    self.pool.cancel_forward(&plan);
                }
                return;
            }
            Err(e) => panic!("{e:?}"),
        }
        let accepted: Vec<u32> = path.iter().map(|&j| draft.tokens[j]).collect();
        let s = self.pool.seq(id).unwrap();
        assert!(s.layer_len.iter().all(|&l| l == start + path.len()));
        if commit {
            assert_eq!(s.seq_len, start + path.len());
        } else {
            assert_eq!(s.seq_len, start);
            self.pool
                .advance(id, path.len() as i64, Some(&accepted))
                .unwrap();
        }
        self.live[i].tokens.extend(accepted);
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::New {
                shared,
                suffix,
                seed,
            } => {
                let t = prompt(shared, suffix, seed);
                let id = self.pool.new_sequence_with(&t, b"", b"");
                self.live.push(Live { id, tokens: t });
            }
            Op::Replay { which, len } => {
                if self.drafted.is_empty() {
                    return;
                }
                let t = &self.drafted[which % self.drafted.len()];
                let t = t[..len.min(t.len())].to_vec();
                let id = self.pool.new_sequence_with(&t, b"", b"");
                self.live.push(Live { id, tokens: t });
            }
            Op::Prefill(i) => {
                let Some(i) = self.pick(i) else { return };
                let t = self.live[i].tokens.clone();
                let done = self.committed(i);
                if t.len() > done {
                    self.extend(i, &t, t.len() - done);
                }
            }
            Op::Decode { seq, n, seed } => {
                let Some(i) = self.pick(seq) else { return };
                if self.committed(i) < self.live[i].tokens.len() {
                    return;
                }
                let mut t = self.live[i].tokens.clone();
                t.extend((0..n).map(|j| 200 + (seed.wrapping_add(j as u32 * 31) >> 3) % 2));
                if self.extend(i, &t, n) {
                    self.live[i].tokens = t;
                }
            }
            Op::Spec {
                seq,
                n,
                tree,
                seed,
                leaf,
                cut,
                commit,
            } => {
                let Some(i) = self.pick(seq) else { return };
                self.spec(i, n, tree, seed, leaf, cut, commit);
            }
            Op::Reserve { seq, n } => {
                // Positions placed and never written read as zeros, whatever an earlier
                // holder of their blocks (a rejected draft) left there.
                let Some(i) = self.pick(seq) else { return };
                let id = self.live[i].id;
                let start = self.committed(i);
                let Ok(plan) = self.pool.start_forward(&vec![id; n], None, None) else {
                    return;
                };
                for layer in 0..L {
                    let (k, _) = self.gather(id, layer);
                    assert!(
                        k[start * H * D..].iter().all(|&x| x == 0.0),
                        "reserved positions read zeros"
                    );
                }
                self.pool.cancel_forward(&plan);
            }
            Op::Fork(i) => {
                let Some(i) = self.pick(i) else { return };
                let id = self.pool.fork(self.live[i].id).unwrap();
                let t = self.live[i].tokens.clone();
                self.live.push(Live { id, tokens: t });
            }
            Op::Free(i) => {
                let Some(i) = self.pick(i) else { return };
                let l = self.live.remove(i);
                self.pool.free_sequence(l.id).unwrap();
            }
            Op::Truncate(i, n) => {
                let Some(i) = self.pick(i) else { return };
                if n < self.committed(i) {
                    self.pool.truncate(self.live[i].id, n as i64).unwrap();
                    self.live[i].tokens.truncate(n);
                }
            }
            Op::EvictAll => {
                self.pool.evict_all();
            }
        }
    }

    /// Sequence `id`'s K and V of `layer`, position-major (`[len][H * D]`).
    fn gather(&self, id: SeqId, layer: usize) -> (Vec<f32>, Vec<f32>) {
        let len = self.pool.seq(id).unwrap().layer_len[layer];
        let cap = len.max(1);
        let (mut k, mut v) = (vec![f32::NAN; H * cap * D], vec![f32::NAN; H * cap * D]);
        self.pool
            .gather(
                id,
                layer as i64,
                &mut tensor_mut(&mut k, &[H, cap, D]),
                &mut tensor_mut(&mut v, &[H, cap, D]),
            )
            .unwrap();
        let reorder = |x: &[f32]| {
            (0..len)
                .flat_map(|p| (0..H).flat_map(move |h| (0..D).map(move |d| (h, p, d))))
                .map(|(h, p, d)| x[(h * cap + p) * D + d])
                .collect()
        };
        (reorder(&k), reorder(&v))
    }

    fn check(&self) {
        self.pool.check_invariants().unwrap();
        for l in &self.live {
            let s = self.pool.seq(l.id).unwrap();
            assert_eq!(s.seq_len, l.tokens.len().min(s.seq_len));
            assert_eq!(&s.tokens[..s.seq_len], &l.tokens[..s.seq_len]);
            for layer in 0..L {
                let (k, v) = self.gather(l.id, layer);
                for p in 0..s.layer_len[layer] {
                    let (ek, ev) = (kv_of(&l.tokens, p, layer, 0), kv_of(&l.tokens, p, layer, 1));
                    assert_eq!(
                        &k[p * H * D..(p + 1) * H * D],
                        &ek[..],
                        "seq {} layer {layer} pos {p}",
                        l.id
                    );
                    assert_eq!(&v[p * H * D..(p + 1) * H * D], &ev[..]);
                }
            }
        }
    }
}

fn run(partial_hits: bool, ops: &[Op]) {
    let shape = PagedShape {
        num_layers: L,
        num_kv_heads: H,
        head_dim: D,
        v_head_dim: D,
        block_size: BS,
        num_blocks: BLOCKS,
        layout: KvLayout::Nhd,
    };
    let cfg = PrefixConfig {
        events: false,
        hash: HashKind::Xxh3,
        seed: 7,
        partial_hits,
    };
    let mut w = World {
        pool: PoolCore::new(shape, DType::F32, Device::Cpu, Some(cfg)).unwrap(),
        live: Vec::new(),
        drafted: Vec::new(),
    };
    for op in ops {
        w.apply(op);
        w.check();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn drafts_accepts_and_rollbacks_match_reference(ops in prop::collection::vec(op(), 1..50)) {
        run(false, &ops);
    }

    #[test]
    fn with_partial_hits(ops in prop::collection::vec(op(), 1..50)) {
        run(true, &ops);
    }
}
