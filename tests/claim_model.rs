//! Property test of one guarantee: a position a sequence claims without writing it reads
//! as zeros, never as K/V that another holder or another token prefix left in the block.
//!
//! Sequences share blocks every way the pool allows (forks, `copy_prefix` inside a block,
//! whole and partial prefix hits, blocks loaded back from an offload tier) and give up
//! positions every way (truncate, `set_seq_len`, free, eviction), then claim positions
//! without writing them (`reserve`, `set_seq_len` growth). The reference keeps each
//! sequence's K/V as plain vectors, zeros where it claimed without writing; after every
//! step each live sequence's gathered K/V must equal it, and the pool's invariants
//! (which include the ledger's written ends) must hold.

use std::sync::Arc;

use kvrs::tier::{HostTier, Tier};
use kvrs::unstable::{PoolCore, TensorMut, TensorRef};
use kvrs::{
    DType, Device, HashKind, KvError, KvLayout, PagedShape, PrefixConfig, SeqId, TierOptions,
};
use proptest::prelude::*;

const L: usize = 2;
const H: usize = 1;
const D: usize = 2;
const BS: usize = 4;
const BLOCKS: usize = 10;

/// The K (or V) vector a model computes at `pos` after `tokens[..=pos]` when the ids are
/// known there, else a value of `seed` (multiples of 1/4, exact in bfloat16; never zero).
fn kv_of(tokens: &[u32], seed: u32, pos: usize, layer: usize, kv: usize) -> Vec<f32> {
    let mut h: u64 = 0xcbf29ce484222325;
    match tokens.get(..=pos) {
        Some(t) => t
            .iter()
            .for_each(|&t| h = (h ^ t as u64).wrapping_mul(0x100000001b3)),
        None => h ^= (seed as u64) << 32 | 1,
    }
    (0..H * D)
        .map(|i| {
            let x = h
                .wrapping_add((pos * 7 + layer * 131 + kv * 17 + i) as u64)
                .wrapping_mul(0x9e3779b97f4a7c15)
                >> 59;
            x as f32 / 4.0 + 0.25
        })
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// A sequence of a prompt sharing `shared` tokens with every other (prefix hits),
    /// prefilled with its K/V and committed with its token ids (so it gets cached).
    Prompt {
        shared: usize,
        suffix: usize,
    },
    Fork(usize),
    CopyPrefix(usize, usize, usize),
    /// Reserves `n` positions of each picked sequence and writes none of them.
    Reserve(Vec<(usize, usize)>),
    /// Writes the reserved, unwritten positions of a sequence and commits them.
    WriteAndCommit(usize, u32),
    Truncate(usize, usize),
    SetSeqLen(usize, usize),
    Free(usize),
    /// Evicts every cached block no one holds (to the tier, which keeps them).
    EvictAll,
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..5usize;
    prop_oneof![
        3 => (0..11usize, 0..4usize).prop_map(|(shared, suffix)| Op::Prompt { shared, suffix }),
        1 => i.clone().prop_map(Op::Fork),
        2 => (i.clone(), i.clone(), 0..12usize).prop_map(|(a, b, n)| Op::CopyPrefix(a, b, n)),
        3 => prop::collection::vec((i.clone(), 1..6usize), 1..3).prop_map(Op::Reserve),
        2 => (i.clone(), any::<u32>()).prop_map(|(s, seed)| Op::WriteAndCommit(s, seed)),
        2 => (i.clone(), 0..12usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        1 => (i.clone(), 0..14usize).prop_map(|(s, n)| Op::SetSeqLen(s, n)),
        2 => i.prop_map(Op::Free),
        1 => Just(Op::EvictAll),
    ]
}

/// What a live sequence must read: per layer, every held position's K and V.
#[derive(Clone, Debug)]
struct RefSeq {
    id: SeqId,
    k: Vec<Vec<Vec<f32>>>,
    v: Vec<Vec<Vec<f32>>>,
    /// Committed positions; those past it (every layer) were reserved and not written.
    seq_len: usize,
    /// The token ids the pool knows for the sequence (its prompt may run ahead).
    tokens: Vec<u32>,
}

impl RefSeq {
    fn held(&self) -> usize {
        self.k[0].len()
    }

    fn cut(&mut self, n: usize) {
        for l in 0..L {
            self.k[l].truncate(n);
            self.v[l].truncate(n);
        }
        self.seq_len = self.seq_len.min(n);
        self.tokens.truncate(n);
    }

    fn claim_zeros(&mut self, n: usize) {
        for l in 0..L {
            self.k[l].extend((0..n).map(|_| vec![0.0; H * D]));
            self.v[l].extend((0..n).map(|_| vec![0.0; H * D]));
        }
    }
}

fn prompt(shared: usize, suffix: usize) -> Vec<u32> {
    let mut t: Vec<u32> = (1..=shared as u32).collect();
    t.extend((0..suffix).map(|i| 100 + (shared * 3 + i) as u32 % 2));
    t
}

struct World {
    pool: PoolCore,
    live: Vec<RefSeq>,
}

impl World {
    fn pick(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    /// Writes positions `start..start + n` of every layer of sequence `i` (appends, or
    /// through the slots of reserved positions): what its token ids compute where they
    /// are known (those blocks may be cached), values of `seed` elsewhere; false (nothing written) when reserved positions lie in a shared block.
    fn write(&mut self, i: usize, start: usize, n: usize, seed: u32) -> bool {
        let id = self.live[i].id;
        let blocks = self.pool.seq(id).unwrap().tables[0].blocks.clone();
        let slots: Vec<i64> = (start..start + n)
            .map(|p| (blocks.get(p / BS).map_or(0, |&b| b as usize) * BS + p % BS) as i64)
            .collect();
        let (held, tokens) = (self.live[i].held(), self.live[i].tokens.clone());
        for layer in 0..L {
            let k: Vec<Vec<f32>> = (start..start + n)
                .map(|p| kv_of(&tokens, seed, p, layer, 0))
                .collect();
            let v: Vec<Vec<f32>> = (start..start + n)
                .map(|p| kv_of(&tokens, seed, p, layer, 1))
                .collect();
            let (kf, vf) = (k.concat(), v.concat());
            let kt = TensorRef::from_f32(&kf, &[n, H, D]).unwrap();
            let vt = TensorRef::from_f32(&vf, &[n, H, D]).unwrap();
            if start < held {
                match self.pool.write(layer as i64, &kt, &vt, &slots) {
                    Ok(()) => {}
                    Err(KvError::InvalidArgument { .. }) if layer == 0 => return false,
                    Err(e) => panic!("{e:?}"),
                }
            } else {
                self.pool.append(id, layer as i64, &kt, &vt).unwrap();
            }
            let r = &mut self.live[i];
            r.k[layer].truncate(start);
            r.v[layer].truncate(start);
            r.k[layer].extend(k);
            r.v[layer].extend(v);
        }
        true
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Prompt { shared, suffix } => {
                let t = prompt(*shared, *suffix);
                if t.is_empty() {
                    return;
                }
                let id = self.pool.new_sequence_with(&t, b"", b"");
                let hit = self.pool.seq(id).unwrap().num_cached_tokens;
                let mut r = RefSeq {
                    id,
                    k: vec![Vec::new(); L],
                    v: vec![Vec::new(); L],
                    seq_len: 0,
                    tokens: t.clone(),
                };
                // A hit reads what the prompt's tokens compute (whoever computed them).
                for layer in 0..L {
                    r.k[layer] = (0..hit).map(|p| kv_of(&t, 0, p, layer, 0)).collect();
                    r.v[layer] = (0..hit).map(|p| kv_of(&t, 0, p, layer, 1)).collect();
                }
                r.seq_len = hit;
                self.live.push(r);
                let i = self.live.len() - 1;
                let rest = t.len() - hit;
                let needed = (hit..t.len()).filter(|p| p % BS == 0 || *p == hit).count();
                if needed > self.pool.num_free_blocks() {
                    return; // stays a hit without its prefill
                }
                assert!(self.write(i, hit, rest, 0));
                self.pool.advance(id, rest as i64, None).unwrap();
                self.live[i].seq_len = t.len();
            }
            Op::Fork(i) => {
                let Some(i) = self.pick(*i) else { return };
                let mut r = self.live[i].clone();
                r.id = self.pool.fork(r.id).unwrap();
                self.live.push(r);
            }
            Op::CopyPrefix(a, b, n) => {
                let (Some(a), Some(b)) = (self.pick(*a), self.pick(*b)) else {
                    return;
                };
                let (src, dst) = (self.live[a].id, self.live[b].id);
                let res = self.pool.copy_prefix(src, dst, *n as i64);
                if a == b || *n > self.live[a].seq_len {
                    assert!(
                        matches!(res, Err(KvError::InvalidArgument { .. })),
                        "{res:?}"
                    );
                    return;
                }
                res.unwrap();
                let mut r = self.live[a].clone();
                r.cut(*n);
                r.id = dst;
                self.live[b] = r;
            }
            Op::Reserve(picks) => {
                let mut seen = Vec::new();
                let mut chosen = Vec::new();
                for &(i, n) in picks {
                    let Some(i) = self.pick(i) else { return };
                    if !seen.contains(&i) {
                        seen.push(i);
                        chosen.push((i, n));
                    }
                }
                let ids: Vec<SeqId> = chosen.iter().map(|&(i, _)| self.live[i].id).collect();
                let counts: Vec<i64> = chosen.iter().map(|&(_, n)| n as i64).collect();
                match self.pool.reserve(&ids, &counts) {
                    Ok(_) => {
                        for &(i, n) in &chosen {
                            self.live[i].claim_zeros(n);
                        }
                    }
                    Err(KvError::CacheFull { .. }) => {}
                    Err(e) => panic!("{e:?}"),
                }
            }
            Op::WriteAndCommit(i, seed) => {
                let Some(i) = self.pick(*i) else { return };
                let r = &self.live[i];
                let (start, n) = (r.seq_len, r.held() - r.seq_len);
                if n == 0 {
                    return;
                }
                if !self.write(i, start, n, *seed) {
                    return; // shared since reserved (a fork): nothing to write in place
                }
                self.pool.advance(self.live[i].id, n as i64, None).unwrap();
                self.live[i].seq_len += n;
            }
            Op::Truncate(i, n) => {
                let Some(i) = self.pick(*i) else { return };
                self.pool.truncate(self.live[i].id, *n as i64).unwrap();
                if *n < self.live[i].seq_len {
                    self.live[i].cut(*n);
                }
            }
            Op::SetSeqLen(i, n) => {
                let Some(i) = self.pick(*i) else { return };
                let r = &mut self.live[i];
                match self.pool.set_seq_len(r.id, *n as i64) {
                    Ok(()) => {
                        if *n < r.held() {
                            r.cut(*n);
                        }
                        let grow = n - r.held();
                        r.claim_zeros(grow);
                        r.seq_len = *n;
                    }
                    Err(KvError::CacheFull { .. }) => {}
                    Err(e) => panic!("{e:?}"),
                }
            }
            Op::Free(i) => {
                let Some(i) = self.pick(*i) else { return };
                let r = self.live.remove(i);
                self.pool.free_sequence(r.id).unwrap();
            }
            Op::EvictAll => {
                self.pool.evict_all();
                self.pool.flush_tiers();
            }
        }
    }

    fn check(&self) {
        self.pool.check_invariants().unwrap();
        for r in &self.live {
            let s = self.pool.seq(r.id).unwrap();
            assert_eq!(s.seq_len, r.seq_len);
            for l in 0..L {
                let len = r.k[l].len();
                assert_eq!(s.layer_len[l], len);
                let cap = len.max(1);
                let (mut k, mut v) = (vec![f32::NAN; H * cap * D], vec![f32::NAN; H * cap * D]);
                self.pool
                    .gather(
                        r.id,
                        l as i64,
                        &mut TensorMut::from_f32_mut(&mut k, &[H, cap, D]).unwrap(),
                        &mut TensorMut::from_f32_mut(&mut v, &[H, cap, D]).unwrap(),
                    )
                    .unwrap();
                for p in 0..len {
                    let (gk, gv) = (&k[p * D..(p + 1) * D], &v[p * D..(p + 1) * D]);
                    assert_eq!(gk, &r.k[l][p][..], "seq {} layer {l} key {p}", r.id);
                    assert_eq!(gv, &r.v[l][p][..], "seq {} layer {l} value {p}", r.id);
                }
            }
        }
    }
}

fn run(layout: KvLayout, dtype: DType, ops: &[Op]) {
    let shape = PagedShape {
        num_layers: L,
        num_kv_heads: H,
        head_dim: D,
        v_head_dim: D,
        block_size: BS,
        num_blocks: BLOCKS,
        layout,
    };
    let prefix = PrefixConfig {
        hash: HashKind::Xxh3,
        seed: 7,
        partial_hits: true,
        events: false,
    };
    let tier = Arc::new(HostTier::new(1 << 20));
    let pool = PoolCore::new(shape, dtype, Device::Cpu, Some(prefix))
        .unwrap()
        .with_tiers(
            vec![tier as Arc<dyn Tier>],
            "claims",
            &TierOptions {
                queue: 64,
                ..TierOptions::default()
            },
        )
        .unwrap();
    let mut w = World {
        pool,
        live: Vec::new(),
    };
    for op in ops {
        w.apply(op);
        w.check();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn claimed_positions_read_zeros_nhd_float32(ops in prop::collection::vec(op(), 1..50)) {
        run(KvLayout::Nhd, DType::F32, &ops);
    }

    #[test]
    fn claimed_positions_read_zeros_hnd_bfloat16(ops in prop::collection::vec(op(), 1..50)) {
        run(KvLayout::Hnd, DType::BF16, &ops);
    }
}

/// The reviewer's case: `copy_prefix` inside a block whose source was filled through
/// `reserve` + `write`; the positions the copy then reserves read zeros.
#[test]
fn copy_prefix_inside_a_block_then_reserve_reads_zeros() {
    let mut w = World {
        pool: PoolCore::new(
            PagedShape {
                num_layers: L,
                num_kv_heads: H,
                head_dim: D,
                v_head_dim: D,
                block_size: BS,
                num_blocks: BLOCKS,
                layout: KvLayout::Nhd,
            },
            DType::F32,
            Device::Cpu,
            None,
        )
        .unwrap(),
        live: Vec::new(),
    };
    for _ in 0..2 {
        let id = w.pool.new_sequence();
        w.live.push(RefSeq {
            id,
            k: vec![Vec::new(); L],
            v: vec![Vec::new(); L],
            seq_len: 0,
            tokens: Vec::new(),
        });
    }
    for op in [Op::Reserve(vec![(0, 3)]), Op::WriteAndCommit(0, 9)] {
        w.apply(&op);
    }
    assert_eq!(w.live[0].seq_len, 3);
    for op in [Op::CopyPrefix(0, 1, 1), Op::Reserve(vec![(1, 2)])] {
        w.apply(&op);
        w.check();
    }
    assert_eq!(w.live[1].k[0][1..], [vec![0.0; H * D], vec![0.0; H * D]]);
}

/// A sequence proptest found in CI: prefix hits, frees, a length cut past a shared block
/// and reservations, then a prompt that hits the same prefix again.
#[test]
fn ci_regression_prefix_hits_after_reserve_and_set_len() {
    use Op::*;
    let p = |shared, suffix| Prompt { shared, suffix };
    let ops = vec![
        p(1, 0),
        p(1, 0),
        Free(0),
        SetSeqLen(0, 2),
        Reserve(vec![(0, 3)]),
        p(0, 1),
        p(0, 1),
        p(8, 0),
        Reserve(vec![(3, 1), (0, 4)]),
        p(0, 1),
        p(6, 2),
        p(0, 0),
        Free(0),
        Free(0),
        Reserve(vec![(3, 2)]),
        p(0, 0),
        SetSeqLen(3, 8),
        p(6, 2),
    ];
    run(KvLayout::Hnd, DType::BF16, &ops);
    run(KvLayout::Nhd, DType::F32, &ops);
}
