//! Property test: prefix caching under memory pressure.
//!
//! Sequences start from prompts that share beginnings, get prefilled and decoded (one
//! token at a time, in batches, with tiny vocabularies so that chains collide), forked,
//! truncated and freed, while a small pool evicts. As in a real model, the K/V written
//! at position `p` is a function of the token ids up to `p`; so after every step each
//! sequence's gathered K/V must equal that function of its tokens, whatever was shared
//! from the cache, copied for a partial hit or evicted. Invariants (reference counts,
//! free list, LRU order, index) are checked after every step too.

use kvrs::unstable::{PoolCore, TensorMut, TensorRef};
use kvrs::{DType, Device, HashKind, KvError, KvLayout, PagedShape, PrefixConfig, SeqId};
use proptest::prelude::*;

const L: usize = 2;
const H: usize = 2;
const D: usize = 2;
const BS: usize = 4;
const BLOCKS: usize = 16;

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
            x as f32 / 4.0 - 8.0
        })
        .collect()
}

fn kv_block(tokens: &[u32], start: usize, n: usize, layer: usize, kv: usize) -> Vec<f32> {
    (start..start + n)
        .flat_map(|p| kv_of(tokens, p, layer, kv))
        .collect()
}

fn tensor<'a>(v: &'a [f32], shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_f32(v, shape).unwrap()
}

fn tensor_mut<'a>(v: &'a mut [f32], shape: &[usize]) -> TensorMut<'a> {
    TensorMut::from_f32_mut(v, shape).unwrap()
}

/// A prompt: the first `shared` tokens of a common preamble, then a suffix from `seed`
/// over a vocabulary of 3 ids.
fn prompt(shared: usize, suffix: usize, seed: u32) -> Vec<u32> {
    let mut t: Vec<u32> = (1..=shared as u32).collect();
    t.extend(
        (0..suffix)
            .map(|i| 100 + (seed.wrapping_mul(2654435761).wrapping_add(i as u32 * 7919) >> 20) % 3),
    );
    t
}

#[derive(Clone, Debug)]
enum Op {
    New {
        shared: usize,
        suffix: usize,
        seed: u32,
    },
    Prefill(usize),
    Decode {
        seq: usize,
        n: usize,
        seed: u32,
    },
    Batch {
        picks: Vec<usize>,
        seed: u32,
        commit: bool,
    },
    Fork(usize),
    Free(usize),
    Truncate(usize, usize),
    Pin {
        shared: usize,
        unpin: bool,
    },
    EvictAll,
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..6usize;
    prop_oneof![
        3 => (0..20usize, 0..6usize, any::<u32>()).prop_map(|(shared, suffix, seed)| Op::New { shared, suffix, seed }),
        3 => i.clone().prop_map(Op::Prefill),
        3 => (i.clone(), 1..6usize, any::<u32>()).prop_map(|(seq, n, seed)| Op::Decode { seq, n, seed }),
        2 => (prop::collection::vec(i.clone(), 1..4), any::<u32>(), any::<bool>()).prop_map(|(picks, seed, commit)| Op::Batch { picks, seed, commit }),
        1 => i.clone().prop_map(Op::Fork),
        2 => i.clone().prop_map(Op::Free),
        1 => (i, 0..24usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        1 => (0..20usize, any::<bool>()).prop_map(|(shared, unpin)| Op::Pin { shared, unpin }),
        1 => Just(Op::EvictAll),
    ]
}

/// A live sequence: its id and the tokens the test fed it (its prompt may run ahead).
struct Live {
    id: SeqId,
    tokens: Vec<u32>,
}

struct World {
    pool: PoolCore,
    live: Vec<Live>,
    pins: Vec<Vec<u32>>,
}

impl World {
    fn pick(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    /// Appends positions `start..start + n` of `tokens` to every layer and commits them.
    fn extend(&mut self, i: usize, tokens: &[u32], n: usize) -> bool {
        let id = self.live[i].id;
        let start = self.pool.seq(id).unwrap().seq_len;
        for layer in 0..L {
            let (k, v) = (
                kv_block(tokens, start, n, layer, 0),
                kv_block(tokens, start, n, layer, 1),
            );
            match self.pool.append(
                id,
                layer as i64,
                &tensor(&k, &[n, H, D]),
                &tensor(&v, &[n, H, D]),
            ) {
                Ok(_) => {}
                Err(KvError::CacheFull { .. }) => {
                    assert_eq!(layer, 0, "only the first layer allocates");
                    return false;
                }
                Err(e) => panic!("{e:?}"),
            }
        }
        self.pool
            .advance(id, n as i64, Some(&tokens[start..start + n]))
            .unwrap();
        true
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::New {
                shared,
                suffix,
                seed,
            } => {
                let t = prompt(*shared, *suffix, *seed);
                let expect = self.pool.match_prefix(&t, b"", b"");
                let id = self.pool.new_sequence_with(&t, b"", b"");
                let s = self.pool.seq(id).unwrap();
                assert!(
                    s.num_cached_tokens < t.len().max(1),
                    "a prompt token is left to compute"
                );
                // All of the match, or its whole blocks when no block was left for the
                // partial copy.
                let got = s.num_cached_tokens;
                assert!(
                    got == expect || (got.is_multiple_of(BS) && got <= expect && expect - got < BS),
                    "{got} vs {expect}"
                );
                self.live.push(Live { id, tokens: t });
            }
            Op::Prefill(i) => {
                let Some(i) = self.pick(*i) else { return };
                let t = self.live[i].tokens.clone();
                let done = self.pool.seq(self.live[i].id).unwrap().seq_len;
                if t.len() > done {
                    self.extend(i, &t, t.len() - done);
                }
            }
            Op::Decode { seq, n, seed } => {
                let Some(i) = self.pick(*seq) else { return };
                let id = self.live[i].id;
                let done = self.pool.seq(id).unwrap().seq_len;
                if done < self.live[i].tokens.len() {
                    return; // prefill first
                }
                let mut t = self.live[i].tokens.clone();
                t.extend((0..*n).map(|j| 200 + (seed.wrapping_add(j as u32 * 31) >> 3) % 2));
                if self.extend(i, &t, *n) {
                    self.live[i].tokens = t;
                }
            }
            Op::Batch {
                picks,
                seed,
                commit,
            } => {
                let mut chosen: Vec<usize> = Vec::new();
                for &p in picks {
                    if let Some(i) = self.pick(p) {
                        let s = self.pool.seq(self.live[i].id).unwrap();
                        if !chosen.contains(&i) && s.seq_len == self.live[i].tokens.len() {
                            chosen.push(i);
                        }
                    }
                }
                if chosen.is_empty() {
                    return;
                }
                let ids: Vec<SeqId> = chosen.iter().map(|&i| self.live[i].id).collect();
                let positions: Vec<i64> = chosen
                    .iter()
                    .map(|&i| self.live[i].tokens.len() as i64)
                    .collect();
                let new: Vec<u32> = (0..chosen.len())
                    .map(|j| 300 + (seed.wrapping_add(j as u32) % 2))
                    .collect();
                let plan = match self.pool.start_forward(&ids, Some(&positions), Some(&new)) {
                    Ok(p) => p,
                    Err(KvError::CacheFull { .. }) => return,
                    Err(e) => panic!("{e:?}"),
                };
                let extended: Vec<Vec<u32>> = chosen
                    .iter()
                    .zip(&new)
                    .map(|(&i, &t)| [self.live[i].tokens.clone(), vec![t]].concat())
                    .collect();
                for layer in 0..L {
                    let k: Vec<f32> = extended
                        .iter()
                        .flat_map(|t| kv_of(t, t.len() - 1, layer, 0))
                        .collect();
                    let v: Vec<f32> = extended
                        .iter()
                        .flat_map(|t| kv_of(t, t.len() - 1, layer, 1))
                        .collect();
                    let n = chosen.len();
                    self.pool
                        .write(
                            layer as i64,
                            &tensor(&k, &[n, H, D]),
                            &tensor(&v, &[n, H, D]),
                            &plan.slots,
                        )
                        .unwrap();
                }
                if *commit {
                    self.pool.finish_forward(&plan).unwrap();
                    for (&i, t) in chosen.iter().zip(extended) {
                        self.live[i].tokens = t;
                    }
                } else {
                    self.pool.cancel_forward(&plan);
                }
            }
            Op::Fork(i) => {
                let Some(i) = self.pick(*i) else { return };
                let id = self.pool.fork(self.live[i].id).unwrap();
                let t = self.live[i].tokens.clone();
                self.live.push(Live { id, tokens: t });
            }
            Op::Free(i) => {
                let Some(i) = self.pick(*i) else { return };
                let l = self.live.remove(i);
                self.pool.free_sequence(l.id).unwrap();
            }
            Op::Truncate(i, n) => {
                let Some(i) = self.pick(*i) else { return };
                let id = self.live[i].id;
                let s = self.pool.seq(id).unwrap();
                if *n < s.seq_len {
                    self.pool.truncate(id, *n as i64).unwrap();
                    self.live[i].tokens.truncate(*n);
                }
            }
            Op::Pin { shared, unpin } => {
                let t = prompt(*shared, 0, 0);
                if *unpin {
                    if let Some(k) = self.pins.iter().position(|p| *p == t) {
                        self.pins.remove(k);
                        self.pool.unpin(&t, b"", b"").unwrap();
                    }
                } else {
                    self.pool.pin(&t, b"", b"").unwrap();
                    self.pins.push(t);
                }
            }
            Op::EvictAll => {
                let before = self.pool.stats();
                let n = self.pool.evict_all();
                assert_eq!(n, before.evictable_blocks);
                assert_eq!(self.pool.stats().cached_blocks, before.cached_blocks - n);
            }
        }
    }

    fn check(&self) {
        self.pool.check_invariants().unwrap();
        for l in &self.live {
            let s = self.pool.seq(l.id).unwrap();
            assert_eq!(&s.tokens[..s.seq_len], &l.tokens[..s.seq_len]);
            for layer in 0..L {
                let len = s.layer_len[layer];
                let cap = len.max(1);
                let (mut k, mut v) = (vec![f32::NAN; H * cap * D], vec![f32::NAN; H * cap * D]);
                self.pool
                    .gather(
                        l.id,
                        layer as i64,
                        &mut tensor_mut(&mut k, &[H, cap, D]),
                        &mut tensor_mut(&mut v, &[H, cap, D]),
                    )
                    .unwrap();
                for p in 0..len {
                    let (ek, ev) = (kv_of(&l.tokens, p, layer, 0), kv_of(&l.tokens, p, layer, 1));
                    for h in 0..H {
                        for d in 0..D {
                            assert_eq!(
                                k[(h * cap + p) * D + d],
                                ek[h * D + d],
                                "seq {} layer {layer} pos {p}",
                                l.id
                            );
                            assert_eq!(v[(h * cap + p) * D + d], ev[h * D + d]);
                        }
                    }
                }
            }
        }
        let st = self.pool.stats();
        assert_eq!(st.free_blocks + st.used_blocks, BLOCKS);
        assert!(st.prefix.hit_tokens <= st.prefix.query_tokens);
    }
}

fn run(hash: HashKind, partial_hits: bool, layout: KvLayout, ops: &[Op]) {
    let shape = PagedShape {
        num_layers: L,
        num_kv_heads: H,
        head_dim: D,
        v_head_dim: D,
        block_size: BS,
        num_blocks: BLOCKS,
        layout,
    };
    let cfg = PrefixConfig {
        events: true,
        hash,
        seed: 42,
        partial_hits,
    };
    let mut w = World {
        pool: PoolCore::new(shape, DType::F32, Device::Cpu, Some(cfg)).unwrap(),
        live: Vec::new(),
        pins: Vec::new(),
    };
    for op in ops {
        w.apply(op);
        w.check();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn blake3_partial_hits_nhd(ops in prop::collection::vec(op(), 1..60)) {
        run(HashKind::Blake3, true, KvLayout::Nhd, &ops);
    }

    #[test]
    fn xxh3_whole_blocks_hnd(ops in prop::collection::vec(op(), 1..60)) {
        run(HashKind::Xxh3, false, KvLayout::Hnd, &ops);
    }
}
