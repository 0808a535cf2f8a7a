//! Property test of prefix caching for hybrid models: a toy model with one attention
//! layer and one recurrent layer runs prompts that share random prefixes over a small
//! pool, in prefill chunks of random sizes and decode steps, with forks, frees,
//! evictions, explicit checkpoints and rollbacks.
//!
//! The recurrence is `h = h * 0.5 + emb(token)` (float32) and the K/V at a position are
//! functions of `h` after its token, so both depend on every token before. After every
//! step each live sequence's state and K/V must equal, bit for bit, what running its
//! tokens from scratch gives: a prefix hit restored a checkpoint of exactly its length,
//! and a rollback the state at its new length. Reference counts, the checkpoint slots
//! and every pool invariant are checked too.

use kvrs::unstable::{PoolCore, SeqState, StateConfig, StateSpec, TensorMut, TensorRef};
use kvrs::{DType, Device, HashKind, KvError, KvLayout, PagedShape, PrefixConfig, SeqId};
use proptest::prelude::*;

const D: usize = 2;
const BS: usize = 4;
const BLOCKS: usize = 20;
const SLOTS: usize = 5;
const CHECKPOINTS: usize = 6;
const INTERVAL: usize = 8;

fn emb(token: u32) -> [f32; D] {
    [
        (token % 7) as f32 / 8.0 - 0.375,
        (token % 5) as f32 / 16.0 + 0.0625,
    ]
}

/// The state after `tokens`, and the K (= state) and V (= -state) of every position.
fn run_model(tokens: &[u32]) -> ([f32; D], Vec<[f32; D]>) {
    let mut h = [0f32; D];
    let mut kv = Vec::with_capacity(tokens.len());
    for &t in tokens {
        let e = emb(t);
        for i in 0..D {
            h[i] = h[i] * 0.5 + e[i];
        }
        kv.push(h);
    }
    (h, kv)
}

#[derive(Clone, Debug)]
enum Op {
    /// A prompt of `shared` tokens of a common preamble, then `suffix` tokens of `seed`.
    New {
        shared: usize,
        suffix: usize,
        seed: u32,
    },
    /// Computes up to `n` more of a sequence's prompt (one prefill chunk).
    Prefill {
        seq: usize,
        n: usize,
    },
    /// Decodes `n` new tokens one at a time.
    Decode {
        seq: usize,
        n: usize,
        seed: u32,
    },
    Fork(usize),
    Free(usize),
    Checkpoint(usize),
    Truncate {
        seq: usize,
        back: usize,
    },
    EvictAll,
    /// Drafts `n` tokens after a decoding sequence: the first `chain` a chain committed
    /// as plain tokens and checkpointed at their end, the rest tree nodes (node j's
    /// parent from `tree`: an earlier node or the committed end) committed by a draft
    /// batch; then accepts the path to node `leaf` (none when `leaf % (n + 1) == n`).
    Accept {
        seq: usize,
        n: usize,
        chain: usize,
        tree: u32,
        leaf: usize,
        seed: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..5usize;
    prop_oneof![
        3 => (0..14usize, 0..6usize, any::<u32>()).prop_map(|(shared, suffix, seed)| Op::New { shared, suffix, seed }),
        4 => (i.clone(), 1..9usize).prop_map(|(seq, n)| Op::Prefill { seq, n }),
        3 => (i.clone(), 1..10usize, any::<u32>()).prop_map(|(seq, n, seed)| Op::Decode { seq, n, seed }),
        1 => i.clone().prop_map(Op::Fork),
        2 => i.clone().prop_map(Op::Free),
        1 => i.clone().prop_map(Op::Checkpoint),
        2 => (i.clone(), 0..10usize).prop_map(|(seq, back)| Op::Truncate { seq, back }),
        1 => Just(Op::EvictAll),
        3 => (i, 1..7usize, 0..4usize, any::<u32>(), 0..8usize, any::<u32>())
            .prop_map(|(seq, n, chain, tree, leaf, seed)| Op::Accept { seq, n, chain, tree, leaf, seed }),
    ]
}

fn prompt(shared: usize, suffix: usize, seed: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (1..=shared as u32).collect();
    t.extend(
        (0..suffix).map(|i| 50 + (seed.wrapping_mul(2654435761).wrapping_add(i as u32 * 97) >> 28)),
    );
    t
}

struct Live {
    id: SeqId,
    /// Every token id it was given (its prompt, then its decoded tokens).
    tokens: Vec<u32>,
}

struct World {
    pool: PoolCore,
    live: Vec<Live>,
}

impl World {
    /// A fresh pool, nothing live.
    fn new() -> Self {
        World {
            pool: pool(),
            live: Vec::new(),
        }
    }

    fn pick(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    fn state(&self, id: SeqId) -> [f32; D] {
        let mut h = [0f32; D];
        self.pool
            .read_state(
                id,
                0,
                "h",
                &mut TensorMut::from_f32_mut(&mut h, &[D, 1, 1]).unwrap(),
            )
            .unwrap();
        h
    }

    /// Runs positions `seq_len..seq_len + n` of sequence `i` (its tokens `t`) as the
    /// model does: the state updated in place, the K/V appended, then committed with
    /// their token ids.
    fn compute(&mut self, i: usize, t: &[u32], n: usize) -> bool {
        let id = self.live[i].id;
        let start = self.pool.seq(id).unwrap().seq_len;
        let mut h = self.state(id);
        let mut k = Vec::with_capacity(n * D);
        for &tok in &t[start..start + n] {
            let e = emb(tok);
            for j in 0..D {
                h[j] = h[j] * 0.5 + e[j];
            }
            k.extend_from_slice(&h);
        }
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        match self.pool.append(
            id,
            0,
            &TensorRef::from_f32(&k, &[n, 1, D]).unwrap(),
            &TensorRef::from_f32(&v, &[n, 1, D]).unwrap(),
        ) {
            Ok(_) => {}
            Err(KvError::CacheFull { .. }) => return false,
            Err(e) => panic!("{e:?}"),
        }
        self.pool
            .write_state(id, 0, "h", &TensorRef::from_f32(&h, &[D, 1, 1]).unwrap())
            .unwrap();
        self.pool
            .advance(id, n as i64, Some(&t[start..start + n]))
            .unwrap();
        true
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::New {
                shared,
                suffix,
                seed,
            } => {
                let t = prompt(shared, suffix, seed);
                if t.is_empty() || self.pool.states().unwrap().free_slots() == 0 {
                    return;
                }
                let expect = self.pool.match_prefix(&t, b"", b"");
                let id = self.pool.new_sequence_with(&t, b"", b"");
                let got = self.pool.seq(id).unwrap().seq_len;
                // The hit match_prefix announced, or none when no block was free for a
                // partial copy (a state pool hits exactly a checkpoint's position).
                assert!(
                    got < t.len() && (got == expect || got == 0),
                    "{got} vs {expect}"
                );
                self.live.push(Live { id, tokens: t });
            }
            Op::Prefill { seq, n } => {
                let Some(i) = self.pick(seq) else { return };
                let t = self.live[i].tokens.clone();
                let s = self.pool.seq(self.live[i].id).unwrap();
                let todo = t.len().min(s.prompt_len).saturating_sub(s.seq_len);
                // A chunk ends at the branch point, as generate_batch's do.
                let due = s.branch.map_or(usize::MAX, |b| b.saturating_sub(s.seq_len));
                let n = n.min(todo).min(due);
                if n > 0 {
                    self.compute(i, &t, n);
                }
            }
            Op::Decode { seq, n, seed } => {
                let Some(i) = self.pick(seq) else { return };
                let id = self.live[i].id;
                let s = self.pool.seq(id).unwrap();
                if s.seq_len < s.prompt_len || s.seq_len < self.live[i].tokens.len() {
                    return; // prefill first
                }
                for j in 0..n {
                    let mut t = self.live[i].tokens.clone();
                    t.push(60 + (seed.wrapping_add(j as u32 * 31) >> 4) % 3);
                    if !self.compute(i, &t, 1) {
                        return;
                    }
                    self.live[i].tokens = t;
                }
            }
            Op::Fork(i) => {
                let Some(i) = self.pick(i) else { return };
                if self.pool.states().unwrap().free_slots() == 0 {
                    return;
                }
                let id = self.pool.fork(self.live[i].id).unwrap();
                let tokens = self.live[i].tokens.clone();
                self.live.push(Live { id, tokens });
            }
            Op::Free(i) => {
                let Some(i) = self.pick(i) else { return };
                let l = self.live.remove(i);
                self.pool.free_sequence(l.id).unwrap();
            }
            Op::Checkpoint(i) => {
                let Some(i) = self.pick(i) else { return };
                let id = self.live[i].id;
                if self.pool.checkpoint(id).unwrap() {
                    let s = self.pool.seq(id).unwrap();
                    assert!(s.checkpoints.iter().any(|&(p, _)| p == s.seq_len));
                }
            }
            Op::Truncate { seq, back } => {
                let Some(i) = self.pick(seq) else { return };
                let id = self.live[i].id;
                let s = self.pool.seq(id).unwrap();
                let n = s.seq_len.saturating_sub(back);
                let held: Vec<usize> = s.checkpoints.iter().map(|&(p, _)| p).collect();
                match self.pool.truncate(id, n as i64) {
                    Ok(()) => {}
                    Err(KvError::NotSupported(_)) => {
                        assert!(
                            n > 0 && !held.contains(&n),
                            "refused a rollback to {n} with {held:?}"
                        );
                        return;
                    }
                    Err(e) => panic!("{e:?}"),
                }
                self.live[i]
                    .tokens
                    .truncate(n.max(self.pool.seq(id).unwrap().prompt_len));
            }
            Op::EvictAll => {
                self.pool.evict_all();
            }
            Op::Accept {
                seq,
                n,
                chain,
                tree,
                leaf,
                seed,
            } => {
                let Some(i) = self.pick(seq) else { return };
                self.accept(i, n, chain.min(n), tree, leaf % (n + 1), seed);
            }
        }
    }

    /// See [`Op::Accept`].
    fn accept(&mut self, i: usize, n: usize, chain: usize, tree: u32, leaf: usize, seed: u32) {
        let id = self.live[i].id;
        let s = self.pool.seq(id).unwrap();
        let start = s.seq_len;
        if s.seq_len < s.prompt_len || start != self.live[i].tokens.len() {
            return; // prefill first
        }
        let committed = self.live[i].tokens.clone();
        // Node j: its parent (None: the committed end) and token.
        let parent: Vec<Option<usize>> = (0..n)
            .map(|j| match j {
                0 => None,
                j if j < chain => Some(j - 1),
                j => {
                    let r = (tree >> (3 * (j % 10))) as usize % (j + 1);
                    (r < j).then_some(r)
                }
            })
            .collect();
        let token: Vec<u32> = (0..n)
            .map(|j| 60 + (seed.wrapping_mul(2654435761) >> (2 * j + 4)) % 4)
            .collect();
        let path = |j: usize| {
            let mut p = vec![j];
            while let Some(q) = parent[*p.last().unwrap()] {
                p.push(q);
            }
            p.reverse();
            p
        };
        let context = |j: usize| -> Vec<u32> {
            committed
                .iter()
                .copied()
                .chain(path(j).into_iter().map(|q| token[q]))
                .collect()
        };
        let state_of = |j: usize| run_model(&context(j)).0;
        // The chain: plain tokens, then a checkpoint at their end.
        if chain > 0 {
            let t = context(chain - 1);
            if !self.compute(i, &t, chain) {
                return;
            }
            let _ = self.pool.checkpoint(id).unwrap();
        }
        // The tree nodes: one draft batch, each node's K/V those of its path.
        if n > chain {
            let ids = vec![id; n - chain];
            let plan = match self.pool.start_forward(&ids, None, Some(&token[chain..])) {
                Ok(p) => p,
                Err(KvError::CacheFull { .. }) => {
                    self.roll_back(i, start, &committed);
                    return;
                }
                Err(e) => panic!("{e:?}"),
            };
            plan.mark_draft();
            let k: Vec<f32> = (chain..n).flat_map(state_of).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            let m = n - chain;
            self.pool
                .forward_write(
                    &plan,
                    0,
                    &TensorRef::from_f32(&k, &[m, 1, D]).unwrap(),
                    &TensorRef::from_f32(&v, &[m, 1, D]).unwrap(),
                )
                .unwrap();
            let h = state_of(n - 1);
            self.pool
                .write_state(id, 0, "h", &TensorRef::from_f32(&h, &[D, 1, 1]).unwrap())
                .unwrap();
            self.pool.finish_forward(&plan).unwrap();
        }
        let keep: Vec<usize> = if leaf < n { path(leaf) } else { Vec::new() };
        let offsets: Vec<i64> = keep.iter().map(|&j| j as i64).collect();
        let before: SeqState = self.pool.seq(id).unwrap().clone();
        match self.pool.accept(id, start as i64, &offsets) {
            Ok(()) => {
                self.live[i].tokens = committed
                    .iter()
                    .copied()
                    .chain(keep.iter().map(|&j| token[j]))
                    .collect();
            }
            Err(KvError::NotSupported(m)) => {
                assert!(m.contains("state checkpoint"), "{m}");
                assert_eq!(
                    self.pool.seq(id).unwrap(),
                    &before,
                    "a refused accept changed"
                );
                self.roll_back(i, start, &committed);
            }
            Err(KvError::CacheFull { .. }) => {
                assert_eq!(
                    self.pool.seq(id).unwrap(),
                    &before,
                    "a refused accept changed"
                );
                self.roll_back(i, start, &committed);
            }
            Err(e) => panic!("{e:?}"),
        }
    }

    /// Cuts sequence `i` back to the last position at or below `start` it can restore
    /// (its committed tokens are `committed`).
    fn roll_back(&mut self, i: usize, start: usize, committed: &[u32]) {
        let id = self.live[i].id;
        let s = self.pool.seq(id).unwrap();
        let mut at: Vec<usize> = s
            .checkpoints
            .iter()
            .map(|&(p, _)| p)
            .filter(|&p| p <= start)
            .collect();
        at.sort_unstable();
        at.insert(0, 0);
        let prompt = s.prompt_len;
        for &p in at.iter().rev() {
            if self.pool.truncate(id, p as i64).is_ok() {
                self.live[i].tokens = committed[..p.max(prompt)].to_vec();
                return;
            }
        }
        panic!("no rollback of sequence {id} to {at:?} succeeded");
    }

    fn check(&self) {
        self.pool.check_invariants().unwrap();
        for l in &self.live {
            let s = self.pool.seq(l.id).unwrap();
            let n = s.seq_len;
            let (h, kv) = run_model(&l.tokens[..n]);
            assert_eq!(self.state(l.id), h, "the state of sequence {} at {n}", l.id);
            let cap = n.max(1);
            let (mut k, mut v) = (vec![f32::NAN; cap * D], vec![f32::NAN; cap * D]);
            self.pool
                .gather(
                    l.id,
                    0,
                    &mut TensorMut::from_f32_mut(&mut k, &[1, cap, D]).unwrap(),
                    &mut TensorMut::from_f32_mut(&mut v, &[1, cap, D]).unwrap(),
                )
                .unwrap();
            for (p, want) in kv.iter().enumerate() {
                assert_eq!(&k[p * D..(p + 1) * D], want, "key {p} of sequence {}", l.id);
            }
        }
    }
}

fn pool() -> PoolCore {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: D,
        v_head_dim: D,
        block_size: BS,
        num_blocks: BLOCKS,
        layout: KvLayout::Nhd,
    };
    let prefix = PrefixConfig {
        hash: HashKind::Xxh3,
        seed: 3,
        partial_hits: true,
        events: false,
    };
    PoolCore::new(shape, DType::F32, Device::Cpu, Some(prefix))
        .unwrap()
        .with_states(StateConfig {
            layers: 1,
            slots: SLOTS,
            checkpoints: CHECKPOINTS,
            specs: vec![StateSpec {
                name: "h".into(),
                dims: vec![D],
                dtype: DType::F32,
            }],
        })
        .unwrap()
        .with_checkpoint_interval(INTERVAL)
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn restored_states_equal_running_from_scratch(ops in prop::collection::vec(op(), 1..70)) {
        let mut w = World::new();
        for op in &ops {
            w.apply(op);
            w.check();
        }
    }
}

/// A 7-token shared prefix (block size 4): the second prompt computes up to the branch
/// point and checkpoints it, and the third hits all 7 tokens, not 4.
#[test]
fn hits_are_token_granular() {
    let mut w = World::new();
    let shared: Vec<u32> = (1..=7).collect();
    let with = |tail: &[u32]| [shared.as_slice(), tail].concat();
    for (k, tail) in [[40u32, 41, 42], [50, 51, 52], [60, 61, 62]]
        .iter()
        .enumerate()
    {
        let t = with(tail);
        let id = w.pool.new_sequence_with(&t, b"", b"");
        w.live.push(Live {
            id,
            tokens: t.clone(),
        });
        let hit = w.pool.seq(id).unwrap().seq_len;
        assert_eq!(hit, [0, 0, 7][k], "request {k}");
        while w.pool.seq(id).unwrap().seq_len < t.len() {
            w.apply(&Op::Prefill { seq: k, n: 100 });
        }
        w.apply(&Op::Decode {
            seq: k,
            n: 3,
            seed: 0,
        });
        w.check();
    }
    let st = w.pool.stats().states.unwrap();
    assert_eq!(st.counters.hits, 1);
}

/// A rollback to a position without a checkpoint is refused and changes nothing; to one
/// with a checkpoint, or to 0, it restores the state there.
#[test]
fn rollbacks_restore_a_checkpoint_or_refuse() {
    let mut w = World::new();
    let t: Vec<u32> = (1..=6).collect();
    let id = w.pool.new_sequence_with(&t, b"", b"");
    w.live.push(Live { id, tokens: t });
    w.apply(&Op::Prefill { seq: 0, n: 6 });
    w.apply(&Op::Decode {
        seq: 0,
        n: 5,
        seed: 1,
    });
    w.check();
    let err = w.pool.truncate(id, 9).unwrap_err();
    assert!(
        matches!(&err, KvError::NotSupported(m) if m.contains("state checkpoint")),
        "{err}"
    );
    assert_eq!(w.pool.seq(id).unwrap().seq_len, 11);
    w.check();
    // The prompt's end (6) and the interval (8) have checkpoints.
    w.pool.truncate(id, 8).unwrap();
    w.live[0].tokens.truncate(8);
    w.check();
    w.pool.truncate(id, 0).unwrap();
    w.live[0].tokens.truncate(6);
    w.check();
}

/// The probe of a stale state: prompt `P = [1, 2, 3, 4]`, drafts `[10, 11, 12, 13]`
/// committed, a checkpoint taken at 6 among them, then `accept(4, [1, 3])`. The state
/// after `P + [11, 13]` exists nowhere: the accept is refused and changes nothing (the
/// checkpoint at 6 is that of `P + [10, 11]`, not of the kept tokens).
#[test]
fn accept_never_restores_the_state_of_rejected_drafts() {
    let mut w = World::new();
    let p: Vec<u32> = vec![1, 2, 3, 4];
    let id = w.pool.new_sequence_with(&p, b"", b"");
    w.live.push(Live {
        id,
        tokens: p.clone(),
    });
    w.apply(&Op::Prefill { seq: 0, n: 4 });
    let drafted = [p.clone(), vec![10, 11, 12, 13]].concat();
    assert!(w.compute(0, &drafted, 2));
    assert!(w.pool.checkpoint(id).unwrap());
    assert!(w.compute(0, &drafted, 2));
    w.live[0].tokens = drafted.clone();
    w.check();
    let before = w.pool.seq(id).unwrap().clone();
    let err = w.pool.accept(id, 4, &[1, 3]).unwrap_err();
    assert!(
        matches!(&err, KvError::NotSupported(m) if m.contains("exactly the token ids")),
        "{err}"
    );
    assert_eq!(w.pool.seq(id).unwrap(), &before);
    // Keeping the drafts the checkpoint was taken after restores it.
    w.pool.accept(id, 4, &[0, 1]).unwrap();
    w.live[0].tokens.truncate(6);
    w.check();
}

/// The second way in: another request cached `P + [10, 11, ...]` with a checkpoint at 6.
/// Accepting `[11, 13]` must not restore it; a request that cached `P + [11, 13]` with a
/// checkpoint there is restored.
#[test]
fn accept_restores_only_a_cached_checkpoint_of_the_kept_tokens() {
    let mut w = World::new();
    let p: Vec<u32> = vec![1, 2, 3, 4];
    let run = |w: &mut World, tokens: Vec<u32>, at: usize| {
        let id = w.pool.new_sequence_with(&tokens[..at], b"", b"");
        w.live.push(Live { id, tokens });
        let k = w.live.len() - 1;
        while w.pool.seq(id).unwrap().seq_len < at {
            w.apply(&Op::Prefill { seq: k, n: at });
        }
        let t = w.live[k].tokens.clone();
        assert!(w.compute(k, &t, t.len() - at));
        id
    };
    // Two earlier requests: prompts ending at 6 (a checkpoint there), then two decoded
    // tokens (the block fills and is cached, so the checkpoint is published).
    for tail in [[10u32, 11, 12, 13], [11, 13, 7, 7]] {
        let id = run(&mut w, [p.clone(), tail.to_vec()].concat(), 6);
        w.check();
        w.pool.free_sequence(id).unwrap();
        w.live.pop();
    }
    let drafted = [p.clone(), vec![10, 11, 12, 13]].concat();
    let id = run(&mut w, drafted, 4);
    assert_eq!(w.pool.seq(id).unwrap().seq_len, 8);
    let before = w.pool.seq(id).unwrap().clone();
    assert!(w.pool.accept(id, 4, &[1, 2]).is_err());
    assert_eq!(w.pool.seq(id).unwrap(), &before);
    w.pool.accept(id, 4, &[1, 3]).unwrap();
    let s = w.pool.seq(id).unwrap();
    assert_eq!((s.seq_len, &s.tokens[..]), (6, &[1, 2, 3, 4, 11, 13][..]));
    assert_eq!(w.state(id), run_model(&s.tokens).0);
}

/// `accept` never moves a position that was not committed into the committed range.
#[test]
fn accept_refuses_to_commit_an_uncommitted_draft() {
    let mut w = World::new();
    let t: Vec<u32> = (1..=6).collect();
    let id = w.pool.new_sequence_with(&t, b"", b"");
    w.live.push(Live { id, tokens: t });
    w.apply(&Op::Prefill { seq: 0, n: 6 });
    let k = vec![0.5f32; 4 * D];
    w.pool
        .append(
            id,
            0,
            &TensorRef::from_f32(&k, &[4, 1, D]).unwrap(),
            &TensorRef::from_f32(&k, &[4, 1, D]).unwrap(),
        )
        .unwrap();
    let before = w.pool.seq(id).unwrap().clone();
    let err = w.pool.accept(id, 4, &[0, 5]).unwrap_err();
    assert!(
        matches!(&err, KvError::InvalidArgument { name: "keep", reason, .. } if reason.contains("not committed")),
        "{err}"
    );
    assert_eq!(w.pool.seq(id).unwrap(), &before);
    // From the committed length on, the kept drafts stay uncommitted.
    w.pool.accept(id, 6, &[1, 3]).unwrap();
    let s = w.pool.seq(id).unwrap();
    assert_eq!((s.seq_len, s.layer_len[0]), (6, 8));
}
