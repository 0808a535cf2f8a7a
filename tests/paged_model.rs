//! Property test: random interleavings of every `PoolCore` operation on many sequences
//! against a reference that keeps each sequence's K/V as plain vectors.
//!
//! After every step: each live sequence's gathered K/V equals the reference; reference
//! counts equal block-table occurrences and the free list is exact (`check_invariants`);
//! `free + used == total`; `tokens_stored` equals the number of distinct (block, offset)
//! slots that some sequence holds, and `fragmentation_tokens` the rest of the used blocks.
//! A refused operation (`CacheFull`, bad arguments) must leave pool and reference alike.
//!
//! The same runs with a full and a sliding-window (or chunked) layer check what each layer
//! must still hold: the reference tracks the first position each layer keeps, so a
//! released block, a window that cannot be resumed and the bounded memory of windowed
//! layers are all checked.

use std::collections::HashSet;

use kvrs::unstable::{PoolCore, Rope, RopeStyle, Table, TensorMut, TensorRef, NO_BLOCK};
use kvrs::{Attention, DType, Device, KvError, KvLayout, LayerKind, PagedShape, SeqId};
use proptest::prelude::*;

const L: usize = 2;
const H: usize = 2;
const D: usize = 2;
const BS: usize = 4;
const BLOCKS: usize = 14;
const TOKEN: usize = H * D;
const WINDOW: usize = 5;
const CHUNK: usize = 6;
const SWA_MEMORY: usize = 2;

/// The reference: per layer, the K and V vectors of every held position.
#[derive(Clone, Debug, PartialEq)]
struct RefSeq {
    k: Vec<Vec<Vec<f32>>>,
    v: Vec<Vec<Vec<f32>>>,
    seq_len: usize,
    /// First position each layer holds.
    start: Vec<usize>,
}

impl RefSeq {
    fn new() -> Self {
        RefSeq {
            k: vec![Vec::new(); L],
            v: vec![Vec::new(); L],
            seq_len: 0,
            start: vec![0; L],
        }
    }
    fn held(&self) -> usize {
        self.k.iter().map(Vec::len).max().unwrap()
    }
    fn cut(&mut self, n: usize) {
        self.seq_len = self.seq_len.min(n);
        for l in 0..L {
            self.k[l].truncate(n);
            self.v[l].truncate(n);
            self.start[l] = self.start[l].min(self.k[l].len());
        }
    }
    fn uniform(&self) -> bool {
        self.k.iter().all(|x| x.len() == self.k[0].len())
    }
}

#[derive(Clone, Debug)]
enum Op {
    New,
    Free(usize),
    Fork(usize),
    CopyPrefix(usize, usize, usize),
    Append {
        seq: usize,
        layer: usize,
        n: usize,
        seed: u32,
    },
    Advance(usize, i64),
    Truncate(usize, usize),
    Remove(usize, usize, Option<usize>),
    Reserve {
        seqs: Vec<(usize, usize)>,
        seed: u32,
    },
    Forward {
        seqs: Vec<(usize, usize)>,
        seed: u32,
        commit: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let i = 0..8usize;
    prop_oneof![
        2 => Just(Op::New),
        1 => i.clone().prop_map(Op::Free),
        1 => i.clone().prop_map(Op::Fork),
        1 => (i.clone(), i.clone(), 0..12usize).prop_map(|(a, b, n)| Op::CopyPrefix(a, b, n)),
        4 => (i.clone(), 0..L, 0..7usize, any::<u32>()).prop_map(|(seq, layer, n, seed)| Op::Append { seq, layer, n, seed }),
        3 => (i.clone(), -1i64..5).prop_map(|(s, n)| Op::Advance(s, n)),
        1 => (i.clone(), 0..14usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        1 => (i.clone(), 0..14usize, prop::option::of(0..16usize)).prop_map(|(s, b, e)| Op::Remove(s, b, e)),
        2 => (prop::collection::vec((i.clone(), 0..6usize), 1..4), any::<u32>()).prop_map(|(seqs, seed)| Op::Reserve { seqs, seed }),
        2 => (prop::collection::vec((i, 1..4usize), 1..4), any::<u32>(), any::<bool>())
            .prop_map(|(seqs, seed, commit)| Op::Forward { seqs, seed, commit }),
    ]
}

fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((seed.wrapping_mul(2654435761).wrapping_add(i as u32 * 40503)) % 65) as f32 / 4.0 - 8.0
        })
        .collect()
}

thread_local! {
    /// The device of the run in progress: the test's tensors are said to live there (on
    /// the simulated CUDA device, host memory is device memory).
    static DEVICE: std::cell::Cell<Device> = const { std::cell::Cell::new(Device::Cpu) };
}

fn tensor<'a>(v: &'a [f32], shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_f32(v, shape).unwrap().on(DEVICE.get())
}

fn tensor_mut<'a>(v: &'a mut [f32], shape: &[usize]) -> TensorMut<'a> {
    TensorMut::from_f32_mut(v, shape).unwrap().on(DEVICE.get())
}

/// Tokens `[n, H, D]` from a seed, and the same split per token.
fn tokens(seed: u32, n: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let flat = values(seed, n * TOKEN);
    let per = flat.chunks(TOKEN).map(<[f32]>::to_vec).collect();
    (flat, per)
}

struct World {
    pool: PoolCore,
    attention: Attention,
    live: Vec<(SeqId, RefSeq)>,
    /// The pool's rotary embedding (middle removals re-rotate keys) and storage dtype.
    rope: Option<Rope>,
    dtype: DType,
}

impl World {
    /// The reference of a middle removal: positions `end..` move to `begin..`, their keys
    /// rotated by `-(end - begin)` in float32 and rounded to the storage dtype.
    fn remove_span(&self, r: &mut RefSeq, begin: usize, end: usize) {
        let rope = self.rope.expect("a pool with a RoPE");
        let shift = end - begin;
        for l in 0..L {
            let new_start = if r.start[l] < begin {
                r.start[l]
            } else {
                r.start[l].max(end) - shift
            };
            let new_len = if r.k[l].len() > end {
                r.k[l].len() - shift
            } else {
                r.k[l].len().min(begin)
            };
            r.start[l] = new_start.min(new_len);
            let len = r.k[l].len();
            if len > end {
                let mut tail: Vec<Vec<f32>> = r.k[l][end..].to_vec();
                for key in &mut tail {
                    rope.rotate(D, key, -(shift as f64)).unwrap();
                    if self.dtype == DType::BF16 {
                        key.iter_mut()
                            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
                    }
                }
                let vtail: Vec<Vec<f32>> = r.v[l][end..].to_vec();
                r.k[l].truncate(begin);
                r.v[l].truncate(begin);
                r.k[l].extend(tail);
                r.v[l].extend(vtail);
            } else {
                r.k[l].truncate(begin);
                r.v[l].truncate(begin);
            }
        }
        r.seq_len = if r.seq_len > end {
            r.seq_len - shift
        } else {
            r.seq_len.min(begin)
        };
    }
}

impl World {
    fn pick(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    fn table(&self, id: SeqId, layer: usize) -> &Table {
        &self.pool.seq(id).unwrap().tables[self.pool.groups().group_of[layer]]
    }

    /// Blocks a write of `start..end` into `table` needs: new ones (past the table or in
    /// released entries) plus copies of shared ones.
    fn table_needs(&self, table: &Table, start: usize, end: usize) -> usize {
        if start >= end {
            return 0;
        }
        let t = &table.blocks;
        let grow = end.div_ceil(BS).saturating_sub(t.len());
        let fix = (start / BS..end.div_ceil(BS).min(t.len()))
            .filter(|&b| t[b] == NO_BLOCK || self.pool.refcount(t[b]) > 1)
            .count();
        grow + fix
    }

    /// Blocks a write of `start..end` into every layer needs.
    fn blocks_needed(&self, id: SeqId, start: usize, end: usize) -> usize {
        let groups = self.pool.groups().groups.len();
        (0..groups)
            .map(|g| self.table_needs(&self.pool.seq(id).unwrap().tables[g], start, end))
            .sum()
    }

    /// The reference's commit: windowed layers release whole blocks that no future
    /// token sees.
    fn committed(&self, r: &mut RefSeq) {
        for l in 0..L {
            let kind = self.attention.kinds[l];
            if kind != LayerKind::Full {
                let keep = self.attention.keep_from(kind, r.seq_len) / BS * BS;
                r.start[l] = r.start[l].max(keep).min(r.k[l].len());
            }
        }
    }

    /// Whether every layer holds what a token at `pos` sees before itself.
    fn window_held(&self, r: &RefSeq, pos: usize) -> bool {
        (0..L).all(|l| {
            let first = self.attention.first_visible(self.attention.kinds[l], pos);
            first >= pos || r.start[l] <= first
        })
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::New => {
                let id = self.pool.new_sequence();
                self.live.push((id, RefSeq::new()));
            }
            Op::Free(i) => {
                if let Some(i) = self.pick(*i) {
                    let (id, _) = self.live.remove(i);
                    self.pool.free_sequence(id).unwrap();
                    assert!(
                        self.pool.free_sequence(id).is_err(),
                        "freeing twice must fail"
                    );
                }
            }
            Op::Fork(i) => {
                if let Some(i) = self.pick(*i) {
                    let id = self.pool.fork(self.live[i].0).unwrap();
                    let r = self.live[i].1.clone();
                    self.live.push((id, r));
                }
            }
            Op::CopyPrefix(a, b, n) => {
                let (Some(a), Some(b)) = (self.pick(*a), self.pick(*b)) else {
                    return;
                };
                let res = self
                    .pool
                    .copy_prefix(self.live[a].0, self.live[b].0, *n as i64);
                if a == b || *n > self.live[a].1.seq_len {
                    assert!(
                        matches!(res, Err(KvError::InvalidArgument { .. })),
                        "{res:?}"
                    );
                    return;
                }
                res.unwrap();
                let mut r = self.live[a].1.clone();
                r.cut(*n);
                r.seq_len = *n;
                self.committed(&mut r);
                self.live[b].1 = r;
            }
            Op::Append {
                seq,
                layer,
                n,
                seed,
            } => {
                let Some(i) = self.pick(*seq) else { return };
                let id = self.live[i].0;
                let start = self.live[i].1.k[*layer].len();
                let needed = self.table_needs(self.table(id, *layer), start, start + n);
                let free = self.pool.num_free_blocks();
                let (k, kt) = tokens(*seed, *n);
                let (v, vt) = tokens(seed ^ 0xabcd, *n);
                let res = self.pool.append(
                    id,
                    *layer as i64,
                    &tensor(&k, &[*n, H, D]),
                    &tensor(&v, &[*n, H, D]),
                );
                if needed > free {
                    assert!(matches!(res, Err(KvError::CacheFull { .. })), "{res:?}");
                    return;
                }
                assert_eq!(res.unwrap(), start);
                self.live[i].1.k[*layer].extend(kt);
                self.live[i].1.v[*layer].extend(vt);
            }
            Op::Advance(i, n) => {
                let Some(i) = self.pick(*i) else { return };
                let r = &mut self.live[i].1;
                let ok = *n >= 0 && r.k.iter().all(|x| x.len() >= r.seq_len + *n as usize);
                assert_eq!(self.pool.advance(self.live[i].0, *n, None).is_ok(), ok);
                if ok {
                    let mut r = self.live[i].1.clone();
                    r.seq_len += *n as usize;
                    self.committed(&mut r);
                    self.live[i].1 = r;
                }
            }
            Op::Truncate(i, n) => {
                let Some(i) = self.pick(*i) else { return };
                self.pool.truncate(self.live[i].0, *n as i64).unwrap();
                if *n < self.live[i].1.seq_len {
                    self.live[i].1.cut(*n);
                }
            }
            Op::Remove(i, b, e) => {
                let Some(i) = self.pick(*i) else { return };
                let held = self.live[i].1.held();
                let end = e.unwrap_or(usize::MAX);
                // A middle removal first copies the shared blocks its moved positions land
                // in (and fills released entries there).
                let needed = if *b < end && end < held {
                    let shift = end - *b;
                    let (id, r) = (self.live[i].0, &self.live[i].1);
                    let groups = &self.pool.groups().groups;
                    groups
                        .iter()
                        .enumerate()
                        .map(|(g, grp)| {
                            let t = &self.pool.seq(id).unwrap().tables[g];
                            let len = grp.layers.iter().map(|&l| r.k[l].len()).max().unwrap();
                            let new_len = if len > end { len - shift } else { len.min(*b) };
                            self.table_needs(t, t.start.max(end) - shift, new_len)
                        })
                        .sum()
                } else {
                    0
                };
                let free = self.pool.num_free_blocks();
                let res = self
                    .pool
                    .remove(self.live[i].0, *b as i64, e.map(|e| e as i64));
                if *b >= end || *b >= held {
                    res.unwrap();
                } else if end < held && self.rope.is_none() {
                    assert!(matches!(res, Err(KvError::NotSupported(_))));
                } else if end < held {
                    if needed > free {
                        assert!(matches!(res, Err(KvError::CacheFull { .. })), "{res:?}");
                    } else {
                        res.unwrap();
                        let mut r = self.live[i].1.clone();
                        self.remove_span(&mut r, *b, end);
                        self.live[i].1 = r;
                    }
                } else {
                    res.unwrap();
                    self.live[i].1.cut(*b);
                }
            }
            Op::Reserve { seqs, seed } => self.reserve_and_write(seqs, *seed),
            Op::Forward { seqs, seed, commit } => self.forward(seqs, *seed, *commit),
        }
    }

    /// Distinct live sequences from `(index, count)` pairs.
    fn distinct(&self, seqs: &[(usize, usize)]) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for &(i, c) in seqs {
            if let Some(i) = self.pick(i) {
                if !out.iter().any(|o| o.0 == i) {
                    out.push((i, c));
                }
            }
        }
        out
    }

    fn reserve_and_write(&mut self, seqs: &[(usize, usize)], seed: u32) {
        let chosen = self.distinct(seqs);
        if chosen.is_empty() {
            return;
        }
        let ids: Vec<SeqId> = chosen.iter().map(|&(i, _)| self.live[i].0).collect();
        let counts: Vec<i64> = chosen.iter().map(|&(_, c)| c as i64).collect();
        let uniform = chosen.iter().all(|&(i, _)| self.live[i].1.uniform());
        let needed: usize = chosen
            .iter()
            .map(|&(i, c)| {
                self.blocks_needed(
                    self.live[i].0,
                    self.live[i].1.held(),
                    self.live[i].1.held() + c,
                )
            })
            .sum();
        let free = self.pool.num_free_blocks();
        let res = self.pool.reserve(&ids, &counts);
        let groups = self.pool.groups().groups.len();
        if !uniform {
            assert!(
                matches!(res, Err(KvError::InvalidArgument { .. })),
                "{res:?}"
            );
            return;
        }
        if needed > free {
            assert!(matches!(res, Err(KvError::CacheFull { .. })), "{res:?}");
            return;
        }
        let slots = res.unwrap();
        let n: usize = counts.iter().sum::<i64>() as usize;
        assert_eq!(slots.len(), n * groups);
        for layer in 0..L {
            let g = self.pool.groups().group_of[layer];
            let (k, kt) = tokens(seed.wrapping_add(layer as u32), n);
            let (v, vt) = tokens(seed ^ 0x5555 ^ layer as u32, n);
            self.pool
                .write(
                    layer as i64,
                    &tensor(&k, &[n, H, D]),
                    &tensor(&v, &[n, H, D]),
                    &slots[g * n..(g + 1) * n],
                )
                .unwrap();
            let mut t = 0;
            for &(i, c) in &chosen {
                self.live[i].1.k[layer].extend_from_slice(&kt[t..t + c]);
                self.live[i].1.v[layer].extend_from_slice(&vt[t..t + c]);
                t += c;
            }
        }
    }

    fn forward(&mut self, seqs: &[(usize, usize)], seed: u32, commit: bool) {
        let chosen = self.distinct(seqs);
        if chosen.is_empty() {
            return;
        }
        // Tokens interleaved round-robin across the sequences.
        let mut order = Vec::new();
        let mut next: Vec<usize> = chosen.iter().map(|&(i, _)| self.live[i].1.held()).collect();
        for round in 0..chosen.iter().map(|c| c.1).max().unwrap() {
            for (j, &(i, c)) in chosen.iter().enumerate() {
                if round < c {
                    order.push((j, i, next[j]));
                    next[j] += 1;
                }
            }
        }
        let token_seqs: Vec<SeqId> = order.iter().map(|&(_, i, _)| self.live[i].0).collect();
        let positions: Vec<i64> = order.iter().map(|&(_, _, p)| p as i64).collect();
        let uniform = chosen.iter().all(|&(i, _)| self.live[i].1.uniform());
        let needed: usize = chosen
            .iter()
            .map(|&(i, c)| {
                self.blocks_needed(
                    self.live[i].0,
                    self.live[i].1.held(),
                    self.live[i].1.held() + c,
                )
            })
            .sum();
        let free = self.pool.num_free_blocks();
        let resumable = chosen
            .iter()
            .all(|&(i, _)| self.window_held(&self.live[i].1, self.live[i].1.held()));
        let res = self.pool.start_forward(&token_seqs, Some(&positions), None);
        if !uniform || needed > free || !resumable {
            assert!(res.is_err());
            return;
        }
        let plan = res.unwrap();
        let n = order.len();
        for layer in 0..L {
            let g = self.pool.groups().group_of[layer];
            let (k, kt) = tokens(seed.wrapping_add(7 * layer as u32), n);
            let (v, vt) = tokens(seed ^ 0x7777 ^ layer as u32, n);
            self.pool
                .write(
                    layer as i64,
                    &tensor(&k, &[n, H, D]),
                    &tensor(&v, &[n, H, D]),
                    plan.group_slots(g),
                )
                .unwrap();
            for (t, &(_, i, _)) in order.iter().enumerate() {
                self.live[i].1.k[layer].push(kt[t].clone());
                self.live[i].1.v[layer].push(vt[t].clone());
            }
        }
        // The history and mask.
        for layer in 0..L {
            let hist = self.pool.forward_history_len(&plan, layer as i64).unwrap();
            let kind = self.attention.kinds[layer];
            let (mut ko, mut vo, mut mask) = (
                vec![0f32; H * hist * D],
                vec![0f32; H * hist * D],
                vec![0f32; n * hist],
            );
            self.pool
                .forward_get(
                    &plan,
                    layer as i64,
                    &mut tensor_mut(&mut ko, &[H, hist, D]),
                    &mut tensor_mut(&mut vo, &[H, hist, D]),
                    &mut mask,
                )
                .unwrap();
            let mut off = 0;
            let mut offsets = vec![];
            for &(i, _) in &chosen {
                let r = &self.live[i].1;
                let first = r.start[layer];
                for p in first..r.k[layer].len() {
                    let c = off + p - first;
                    for h in 0..H {
                        for d in 0..D {
                            assert_eq!(ko[(h * hist + c) * D + d], r.k[layer][p][h * D + d]);
                            assert_eq!(vo[(h * hist + c) * D + d], r.v[layer][p][h * D + d]);
                        }
                    }
                }
                offsets.push((off, first));
                off += r.k[layer].len() - first;
            }
            assert_eq!(off, hist);
            for (t, &(j, _, pos)) in order.iter().enumerate() {
                let (o, first) = offsets[j];
                let lo = self.attention.first_visible(kind, pos).max(first);
                for c in 0..hist {
                    let visible = c >= o + lo - first && c <= o + pos - first;
                    assert_eq!(mask[t * hist + c] == 0.0, visible, "token {t} history {c}");
                    assert!(mask[t * hist + c] == 0.0 || mask[t * hist + c] == f32::NEG_INFINITY);
                }
            }
        }
        if commit {
            self.pool.finish_forward(&plan).unwrap();
            for &(i, _) in &chosen {
                let mut r = self.live[i].1.clone();
                r.seq_len = r.held();
                self.committed(&mut r);
                self.live[i].1 = r;
            }
        } else {
            self.pool.cancel_forward(&plan);
            for &(i, c) in &chosen {
                let r = &mut self.live[i].1;
                let start = r.held() - c;
                r.cut(start);
            }
        }
    }

    fn check(&self) {
        self.pool.check_invariants().unwrap();
        let mut slots = HashSet::new();
        for (id, r) in &self.live {
            let s = self.pool.seq(*id).unwrap();
            assert_eq!(s.seq_len, r.seq_len);
            for l in 0..L {
                let len = r.k[l].len();
                let first = r.start[l];
                assert_eq!(s.layer_len[l], len);
                let cap = len.max(1);
                let (mut ko, mut vo) = (vec![f32::NAN; H * cap * D], vec![f32::NAN; H * cap * D]);
                let got = self
                    .pool
                    .gather(
                        *id,
                        l as i64,
                        &mut tensor_mut(&mut ko, &[H, cap, D]),
                        &mut tensor_mut(&mut vo, &[H, cap, D]),
                    )
                    .unwrap();
                assert_eq!(got, (first, len - first), "seq {id} layer {l}");
                for p in first..len {
                    let c = p - first;
                    for h in 0..H {
                        for d in 0..D {
                            assert_eq!(
                                ko[(h * cap + c) * D + d],
                                r.k[l][p][h * D + d],
                                "seq {id} layer {l} pos {p}"
                            );
                            assert_eq!(vo[(h * cap + c) * D + d], r.v[l][p][h * D + d]);
                        }
                    }
                }
                // A windowed layer holds at most its window, its memory, one partial
                // block and what is not committed yet.
                let kind = self.attention.kinds[l];
                if kind != LayerKind::Full
                    && first == self.attention.keep_from(kind, r.seq_len) / BS * BS
                {
                    let bound = (len - r.seq_len) + WINDOW.max(CHUNK) + SWA_MEMORY + BS;
                    assert!(len - first <= bound, "layer {l} holds {first}..{len}");
                }
                let t = self.table(*id, l);
                for p in first..len {
                    slots.insert((t.blocks[p / BS], p % BS));
                }
            }
        }
        let st = self.pool.stats();
        assert_eq!(st.free_blocks + st.used_blocks, BLOCKS);
        assert_eq!(st.tokens_stored, slots.len());
        assert_eq!(st.fragmentation_tokens, st.used_blocks * BS - slots.len());
        assert_eq!(st.num_sequences, self.live.len());
    }
}

fn run(device: Device, layout: KvLayout, dtype: DType, kinds: [LayerKind; L], ops: &[Op]) {
    DEVICE.set(device);
    let shape = PagedShape {
        num_layers: L,
        num_kv_heads: H,
        head_dim: D,
        v_head_dim: D,
        block_size: BS,
        num_blocks: BLOCKS,
        layout,
    };
    // The bfloat16 pool gets a RoPE, so its middle removals move and re-rotate keys.
    let rope = (dtype == DType::BF16).then_some(Rope {
        theta: 10000.0,
        rotary_dim: None,
        style: RopeStyle::Gptj,
        linear_factor: 1.0,
    });
    let attention = Attention {
        kinds: kinds.to_vec(),
        sliding_window: Some(WINDOW),
        chunk_size: Some(CHUNK),
        swa_memory: if kinds.contains(&LayerKind::Sliding) {
            SWA_MEMORY
        } else {
            0
        },
    };
    let mut pool = PoolCore::with_attention(shape, attention.clone(), dtype, device, None).unwrap();
    if let Some(r) = rope {
        pool = pool.with_rope(r).unwrap();
    }
    let mut w = World {
        pool,
        attention,
        live: Vec::new(),
        rope,
        dtype,
    };
    for op in ops {
        w.apply(op);
        w.check();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn nhd_float32_pool_matches_reference(ops in prop::collection::vec(op(), 1..60)) {
        run(Device::Cpu, KvLayout::Nhd, DType::F32, [LayerKind::Full; L], &ops);
    }

    #[test]
    fn hnd_bfloat16_pool_matches_reference(ops in prop::collection::vec(op(), 1..60)) {
        run(Device::Cpu, KvLayout::Hnd, DType::BF16, [LayerKind::Full; L], &ops);
    }

    #[test]
    fn full_and_sliding_bfloat16_pool_matches_reference(ops in prop::collection::vec(op(), 1..80)) {
        run(Device::Cpu, KvLayout::Nhd, DType::BF16, [LayerKind::Full, LayerKind::Sliding], &ops);
    }

    #[test]
    fn chunked_and_full_float32_pool_matches_reference(ops in prop::collection::vec(op(), 1..80)) {
        run(Device::Cpu, KvLayout::Hnd, DType::F32, [LayerKind::Chunked, LayerKind::Full], &ops);
    }
}

// The same runs on the simulated CUDA device (`cargo test --features cuda-sim`): the CUDA
// storage and its kernels, compiled for the host, against the same reference.
#[cfg(feature = "cuda-sim")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    #[test]
    fn nhd_float32_pool_on_cuda_matches_reference(ops in prop::collection::vec(op(), 1..60)) {
        run(Device::Cuda(0), KvLayout::Nhd, DType::F32, [LayerKind::Full; L], &ops);
    }

    #[test]
    fn hnd_bfloat16_pool_on_cuda_matches_reference(ops in prop::collection::vec(op(), 1..60)) {
        run(Device::Cuda(0), KvLayout::Hnd, DType::BF16, [LayerKind::Full; L], &ops);
    }

    #[test]
    fn full_and_sliding_float32_pool_on_cuda_matches_reference(ops in prop::collection::vec(op(), 1..80)) {
        run(Device::Cuda(0), KvLayout::Nhd, DType::F32, [LayerKind::Full, LayerKind::Sliding], &ops);
    }

    #[test]
    fn chunked_and_full_float32_pool_on_cuda_matches_reference(ops in prop::collection::vec(op(), 1..80)) {
        run(Device::Cuda(0), KvLayout::Hnd, DType::F32, [LayerKind::Chunked, LayerKind::Full], &ops);
    }
}
