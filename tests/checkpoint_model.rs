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

use kvrs::unstable::{PoolCore, StateConfig, StateSpec, TensorMut, TensorRef};
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
        2 => (i, 0..10usize).prop_map(|(seq, back)| Op::Truncate { seq, back }),
        1 => Just(Op::EvictAll),
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
        }
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
        let mut w = World { pool: pool(), live: Vec::new() };
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
    let mut w = World {
        pool: pool(),
        live: Vec::new(),
    };
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
    let mut w = World {
        pool: pool(),
        live: Vec::new(),
    };
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
