//! The state checkpoints of a pool with state layers in a prefix-cache file: every
//! cached checkpoint (token-granular) whose blocks the file holds, saved, checked and
//! loaded beside the blocks, covered by the file's MAC.
//!
//! A file of such a pool records its state layout (`state_layout`: the state layers and
//! each state's name, shape and dtype) and these tensors, one row per checkpoint, least
//! recently used first: `ckpt_anchors`, `ckpt_extras`, `ckpt_roots` (u8 `[m, 16]`: the
//! anchor, extra-key digest and chain root, little-endian 128-bit), `ckpt_positions`
//! (u64 `[m]`), `ckpt_runs` (u32 `[total]`, each checkpoint's run split by
//! `ckpt_run_offsets`, u64 `[m + 1]`) and `ckpt_states` (u8 `[m, state bytes]`, as
//! [`crate::paged::StateArena::read_checkpoint`] lays them out).
//!
//! A file with a state layout loads only into a pool of the same layout; a file without
//! one (written by a pool without state layers) loads its blocks into a pool with them,
//! which then takes its own checkpoints.

use std::ops::Range;

use rustc_hash::FxHashSet;
use safetensors::tensor::Dtype;

use super::check::FileBlock;
use super::config::FileConfig;
use crate::error::{KvError, Result};
use crate::paged::checkpoints::CheckpointEntry;
use crate::paged::PoolCore;
use crate::prefix::{BlockHash, PrefixIndex};
use crate::sizes;

/// The checkpoint tensors' names, in the order [`expected`] lists them.
const NAMES: [&str; 7] = [
    "ckpt_anchors",
    "ckpt_extras",
    "ckpt_roots",
    "ckpt_positions",
    "ckpt_run_offsets",
    "ckpt_runs",
    "ckpt_states",
];

/// A tensor of a file as written: name, dtype, shape, little-endian bytes.
pub(super) type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// What the allocations name when the host refuses them.
const WHAT: &str = "the prefix-cache file's state checkpoints";

/// One checkpoint of a checked file.
#[derive(Clone, Debug)]
pub(super) struct FileCheckpoint {
    anchor: BlockHash,
    extra: u128,
    root: BlockHash,
    position: usize,
    /// Its run in [`FileCheckpoints::runs`].
    run: Range<usize>,
}

/// The checkpoints of a checked file.
#[derive(Debug)]
pub(super) struct FileCheckpoints {
    entries: Vec<FileCheckpoint>,
    runs: Vec<u32>,
    /// Where `ckpt_states` lies in the file's bytes.
    states: Range<usize>,
    state_bytes: usize,
}

/// The checkpoint tensors a file with `m` checkpoints, runs of `total` tokens and
/// `state_bytes` per checkpoint holds.
pub(super) fn expected(
    m: usize,
    total: usize,
    state_bytes: usize,
) -> Vec<(String, Dtype, Vec<usize>)> {
    let shapes = [
        (Dtype::U8, vec![m, 16]),
        (Dtype::U8, vec![m, 16]),
        (Dtype::U8, vec![m, 16]),
        (Dtype::U64, vec![m]),
        (Dtype::U64, vec![m + 1]),
        (Dtype::U32, vec![total]),
        (Dtype::U8, vec![m, state_bytes]),
    ];
    NAMES
        .iter()
        .zip(shapes)
        .map(|(n, (d, s))| (n.to_string(), d, s))
        .collect()
}

/// `m` and `total` as the file's header states them (0 for a missing tensor: the shape
/// check then fails).
pub(super) fn counts(
    infos: &std::collections::HashMap<String, &safetensors::tensor::TensorInfo>,
) -> (usize, usize) {
    let first = |name: &str| {
        infos
            .get(name)
            .and_then(|t| t.shape.first().copied())
            .unwrap_or(0)
    };
    (first("ckpt_positions"), first("ckpt_runs"))
}

/// The length of the chain of whole blocks ending at the block of chain hash `hash` in
/// `p`'s cache, and its root; `None` when it does not reach a root.
fn pool_depth(p: &PrefixIndex, mut hash: BlockHash, limit: usize) -> Option<(usize, BlockHash)> {
    for depth in 1..=limit {
        let m = p.meta(p.lookup(hash)?)?;
        if m.first {
            return Some((depth, m.root));
        }
        hash = m.parent;
    }
    None
}

/// The length of the chain of whole blocks ending at each group-0 block of `blocks`
/// (within the file) and its root; `None` for one whose chain leaves the file. The
/// file's parent links have no loops (checked).
fn file_depths(blocks: &[FileBlock]) -> Result<Vec<Option<(usize, BlockHash)>>> {
    let mut out: Vec<Option<Option<(usize, BlockHash)>>> = sizes::filled(WHAT, blocks.len(), None)?;
    let mut walk = Vec::new();
    for start in 0..blocks.len() {
        walk.clear();
        let mut i = start;
        let mut found = loop {
            if let Some(d) = out[i] {
                break d;
            }
            walk.push(i);
            match (blocks[i].root, blocks[i].file_parent) {
                (Some(r), _) => break Some((0, r)),
                (None, Some(j)) => i = j,
                (None, None) => break None,
            }
        };
        for &j in walk.iter().rev() {
            found = found.map(|(d, r)| (d + 1, r));
            out[j] = Some(found);
        }
    }
    Ok(out
        .into_iter()
        .zip(blocks)
        .map(|(d, b)| d.flatten().filter(|_| b.group == 0))
        .collect())
}

fn u128s(data: &[u8]) -> impl Iterator<Item = u128> + '_ {
    data.chunks_exact(16)
        .map(|c| u128::from_le_bytes(c.try_into().expect("16 bytes")))
}

fn u64s(data: &[u8]) -> impl Iterator<Item = u64> + '_ {
    data.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
}

/// Checks the checkpoint tensors of a file (at `ranges` of `bytes`, in [`expected`]'s
/// order) against its checked `blocks` (`by_hash`: each hash's block): each run shorter
/// than a block, each anchor the file's root or a block of the file whose chain is
/// whole in it, of the checkpoint's root, its position the chain's length plus its run's,
/// no two with one key. `fail` makes the error.
pub(super) fn check(
    config: &FileConfig,
    bytes: &[u8],
    ranges: &[Range<usize>],
    blocks: &[FileBlock],
    by_hash: &rustc_hash::FxHashMap<BlockHash, usize>,
    fail: impl Fn(String) -> KvError,
) -> Result<FileCheckpoints> {
    let at = |i: usize| &bytes[ranges[i].clone()];
    let bs = config.block_size;
    let (anchors, extras, roots): (Vec<u128>, Vec<u128>, Vec<u128>) = (
        u128s(at(0)).collect(),
        u128s(at(1)).collect(),
        u128s(at(2)).collect(),
    );
    let positions: Vec<u64> = u64s(at(3)).collect();
    let offsets: Vec<usize> = u64s(at(4))
        .map(|o| usize::try_from(o).unwrap_or(usize::MAX))
        .collect();
    let mut runs: Vec<u32> = sizes::with_capacity(WHAT, at(5).len() / 4)?;
    runs.extend(
        at(5)
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))),
    );
    if offsets.first() != Some(&0)
        || offsets.last() != Some(&runs.len())
        || offsets.windows(2).any(|w| w[0] > w[1])
    {
        return Err(fail(
            "ckpt_run_offsets do not split the ckpt_runs tensor".into(),
        ));
    }
    let depths = file_depths(blocks)?;
    let m = positions.len();
    let mut entries = sizes::with_capacity(WHAT, m)?;
    let mut seen: FxHashSet<(BlockHash, u128, &[u32])> = FxHashSet::default();
    for k in 0..m {
        let run = offsets[k]..offsets[k + 1];
        let n = run.len();
        let position = usize::try_from(positions[k]).unwrap_or(usize::MAX);
        let (anchor, root) = (anchors[k], roots[k]);
        if n >= bs {
            return Err(fail(format!(
                "checkpoint {k}'s run has {n} tokens, a block holds {bs}"
            )));
        }
        let whole = if anchor == root {
            0
        } else {
            let block = by_hash.get(&anchor).map(|&i| depths[i]);
            match block {
                Some(Some((d, r))) if r == root => d,
                Some(Some(_)) => {
                    return Err(fail(format!(
                        "checkpoint {k}'s root is not the root of its anchor's chain"
                    )))
                }
                _ => {
                    return Err(fail(format!(
                        "checkpoint {k} is anchored neither at its root nor at a block of \
                         the file whose chain is whole in it"
                    )))
                }
            }
        };
        if position == 0 || position != whole * bs + n {
            return Err(fail(format!(
                "checkpoint {k} is at position {position}, but its anchor's chain and its \
                 run put it at {}",
                whole * bs + n
            )));
        }
        if !seen.insert((anchor, extras[k], &runs[run.clone()])) {
            return Err(fail(format!(
                "checkpoint {k} has the key of an earlier checkpoint"
            )));
        }
        entries.push(FileCheckpoint {
            anchor,
            extra: extras[k],
            root,
            position,
            run,
        });
    }
    drop(seen);
    Ok(FileCheckpoints {
        entries,
        runs,
        states: ranges[6].clone(),
        state_bytes: config.state_bytes,
    })
}

impl PoolCore {
    /// The checkpoint tensors of a file of this pool (none without state layers): every
    /// cached checkpoint whose anchor is its root or a cached block whose chain is
    /// whole, least recently used first.
    pub(super) fn snapshot_checkpoints(&self, config: &FileConfig) -> Result<Vec<Tensor>> {
        let (Some(_), Some(index), Some(arena), Some(p)) = (
            config.state_layout.as_ref(),
            self.checkpoints.as_ref(),
            self.states(),
            self.prefix(),
        ) else {
            return Ok(Vec::new());
        };
        let bs = config.block_size;
        let blocks = self.shape().num_blocks;
        let kept: Vec<(u32, &CheckpointEntry)> = index
            .published_lru_first()
            .into_iter()
            .map(|c| (c, index.entry(c).expect("published")))
            .filter(|(_, e)| {
                let whole = if e.anchor == e.root {
                    Some(0)
                } else {
                    pool_depth(p, e.anchor, blocks)
                        .filter(|&(_, r)| r == e.root)
                        .map(|(d, _)| d)
                };
                whole.is_some_and(|d| e.position == d * bs + e.run.len())
            })
            .collect();
        let m = kept.len();
        let sb = config.state_bytes;
        let mut states = sizes::filled(WHAT, m.saturating_mul(sb), 0u8)?;
        for ((c, _), out) in kept.iter().zip(states.chunks_exact_mut(sb.max(1))) {
            arena.read_checkpoint(*c, out)?;
        }
        let words = |f: fn(&CheckpointEntry) -> u128| -> Vec<u8> {
            kept.iter().flat_map(|(_, e)| f(e).to_le_bytes()).collect()
        };
        let mut offsets = vec![0u64];
        let mut runs = Vec::new();
        for (_, e) in &kept {
            runs.extend(e.run.iter().flat_map(|t| t.to_le_bytes()));
            offsets.push((runs.len() / 4) as u64);
        }
        let total = runs.len() / 4;
        let data = [
            words(|e| e.anchor),
            words(|e| e.extra),
            words(|e| e.root),
            kept.iter()
                .flat_map(|(_, e)| (e.position as u64).to_le_bytes())
                .collect(),
            offsets.iter().flat_map(|o| o.to_le_bytes()).collect(),
            runs,
            states,
        ];
        Ok(expected(m, total, sb)
            .into_iter()
            .zip(data)
            .map(|((name, dtype, shape), bytes)| (name, dtype, shape, bytes))
            .collect())
    }

    /// Loads the checkpoints of a checked file (`bytes`) whose anchor is their root or
    /// a cached block, and whose key the pool does not cache: the most recently used
    /// that the free checkpoint slots hold, published as if released. Returns how many.
    pub(super) fn commit_checkpoints(
        &mut self,
        file: &FileCheckpoints,
        bytes: &[u8],
    ) -> Result<usize> {
        let (Some(index), Some(p)) = (self.checkpoints.as_ref(), self.prefix()) else {
            return Ok(0);
        };
        let run = |e: &FileCheckpoint| &file.runs[e.run.clone()];
        let loadable: Vec<usize> = (0..file.entries.len())
            .filter(|&k| {
                let e = &file.entries[k];
                (e.anchor == e.root || p.lookup(e.anchor).is_some())
                    && index.find(e.anchor, e.extra, run(e)).is_none()
            })
            .collect();
        let room = index.num_free();
        let sb = file.state_bytes;
        let mut loaded = 0;
        for &k in &loadable[loadable.len().saturating_sub(room)..] {
            let e = &file.entries[k];
            let index = self.checkpoints.as_mut().expect("checked");
            let Some((slot, _)) = index.take_for_loading(false) else {
                break;
            };
            let state = &bytes[file.states.start + k * sb..file.states.start + (k + 1) * sb];
            let arena = self
                .states
                .as_mut()
                .expect("checkpoints live in the state arena");
            if let Err(err) = arena.write_checkpoint(slot, state) {
                self.checkpoints.as_mut().expect("checked").discard(slot);
                return Err(err);
            }
            let entry = CheckpointEntry {
                anchor: e.anchor,
                extra: e.extra,
                run: run(e).into(),
                position: e.position,
                root: e.root,
                refs: 0,
                published: true,
            };
            if self
                .checkpoints
                .as_mut()
                .expect("checked")
                .adopt_loaded(slot, entry)
            {
                loaded += 1;
            }
        }
        Ok(loaded)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use safetensors::tensor::{SafeTensors, TensorView};

    use super::*;
    use crate::dtype::DType;
    use crate::layout::{Device, KvLayout, PagedShape};
    use crate::paged::{PrefixConfig, StateConfig, StateSpec};
    use crate::prefix::HashKind;
    use crate::tensor::TensorRef;

    /// A pool with one state layer holding checkpoints at 4, 8 and 10 of a 12-token
    /// prompt (block size 4).
    fn pool() -> PoolCore {
        let shape = PagedShape {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 2,
            v_head_dim: 2,
            block_size: 4,
            num_blocks: 8,
            layout: KvLayout::Nhd,
        };
        let prefix = PrefixConfig {
            hash: HashKind::Blake3,
            seed: 9,
            partial_hits: true,
            events: false,
        };
        let states = StateConfig {
            layers: 1,
            slots: 1,
            checkpoints: 4,
            specs: vec![StateSpec {
                name: "h".into(),
                dims: vec![2],
                dtype: DType::F32,
            }],
        };
        let mut p = PoolCore::new(shape, DType::F32, Device::Cpu, Some(prefix))
            .unwrap()
            .with_states(states)
            .unwrap();
        let tokens: Vec<u32> = (10..22).collect();
        let id = p.new_sequence_with(&tokens[..10], b"", b"");
        for n in [4, 4, 2, 1, 1] {
            let kv = vec![n as f32; n * 2];
            let t = TensorRef::from_f32(&kv, &[n, 1, 2]).unwrap();
            p.append(id, 0, &t, &t).unwrap();
            let at = p.seq(id).unwrap().seq_len;
            p.advance(id, n as i64, Some(&tokens[at..at + n])).unwrap();
        }
        p.free_sequence(id).unwrap();
        p
    }

    /// One checkpoint row: anchor, extra, root, position, run, state bytes.
    type Row = (u128, u128, u128, u64, Vec<u32>, Vec<u8>);

    /// The file `bytes` with its checkpoint rows changed by `edit`, signed again with
    /// the seed's key (as only the seed holder can).
    fn resigned(config: &FileConfig, bytes: &[u8], edit: impl FnOnce(&mut Vec<Row>)) -> Vec<u8> {
        let st = SafeTensors::deserialize(bytes).unwrap();
        let (_, header) = SafeTensors::read_metadata(bytes).unwrap();
        let mut meta: HashMap<String, String> = header.metadata().clone().unwrap();
        let mut tensors: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
            .collect();
        let data = |n: &str| tensors[n].2.clone();
        let sb = config.state_bytes;
        let offsets: Vec<usize> = u64s(&data("ckpt_run_offsets"))
            .map(|o| o as usize)
            .collect();
        let runs: Vec<u32> = data("ckpt_runs")
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let (a, e, r) = (
            u128s(&data("ckpt_anchors")).collect::<Vec<_>>(),
            u128s(&data("ckpt_extras")).collect::<Vec<_>>(),
            u128s(&data("ckpt_roots")).collect::<Vec<_>>(),
        );
        let pos: Vec<u64> = u64s(&data("ckpt_positions")).collect();
        let states = data("ckpt_states");
        let mut rows: Vec<Row> = (0..pos.len())
            .map(|k| {
                let run = runs[offsets[k]..offsets[k + 1]].to_vec();
                (
                    a[k],
                    e[k],
                    r[k],
                    pos[k],
                    run,
                    states[k * sb..(k + 1) * sb].to_vec(),
                )
            })
            .collect();
        edit(&mut rows);
        let m = rows.len();
        let mut offsets = vec![0u64];
        let mut runs = Vec::new();
        for row in &rows {
            runs.extend(row.4.iter().flat_map(|t| t.to_le_bytes()));
            offsets.push((runs.len() / 4) as u64);
        }
        let total = runs.len() / 4;
        let cols: [Vec<u8>; 7] = [
            rows.iter().flat_map(|x| x.0.to_le_bytes()).collect(),
            rows.iter().flat_map(|x| x.1.to_le_bytes()).collect(),
            rows.iter().flat_map(|x| x.2.to_le_bytes()).collect(),
            rows.iter().flat_map(|x| x.3.to_le_bytes()).collect(),
            offsets.iter().flat_map(|o| o.to_le_bytes()).collect(),
            runs,
            rows.iter().flat_map(|x| x.5.clone()).collect(),
        ];
        for ((name, dtype, shape), bytes) in expected(m, total, sb).into_iter().zip(cols) {
            tensors.insert(name, (dtype, shape, bytes));
        }
        meta.remove("mac");
        let mac = config.mac(
            &meta,
            tensors
                .iter()
                .map(|(n, (_, s, d))| (n.as_str(), s.as_slice(), d.as_slice())),
        );
        meta.insert("mac".into(), mac.to_hex().to_string());
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::tensor::serialize(views, Some(meta)).unwrap()
    }

    #[test]
    fn checkpoints_signed_with_the_seed_are_still_checked_for_consistency() {
        let p = pool();
        let dir = std::env::temp_dir().join(format!("kvrs-ckpt-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.kvc");
        p.save_prefix_cache(&path).unwrap();
        let (config, bytes) = (
            p.prefix_file_config().unwrap(),
            std::fs::read(&path).unwrap(),
        );
        let file = config
            .check(&path, resigned(&config, &bytes, |_| {}))
            .unwrap();
        assert_eq!(file.checkpoints.as_ref().unwrap().entries.len(), 3);
        let with_run = |rows: &Vec<Row>| rows.iter().position(|x| !x.4.is_empty()).unwrap();
        type Corrupt<'a> = Box<dyn FnOnce(&mut Vec<Row>) + 'a>;
        let cases: [(&str, Corrupt<'_>); 5] = [
            ("is at position", Box::new(|rows| rows[0].3 += 1)),
            ("anchored neither", Box::new(|rows| rows[0].0 ^= 1)),
            (
                "key of an earlier",
                Box::new(|rows| rows.push(rows[1].clone())),
            ),
            (
                "a block holds",
                Box::new(|rows| {
                    let k = with_run(rows);
                    rows[k].4.extend([1, 2]);
                    rows[k].3 += 2;
                }),
            ),
            (
                "root is not the root",
                Box::new(|rows| {
                    let k = with_run(rows);
                    rows[k].2 ^= 1;
                }),
            ),
        ];
        for (want, edit) in cases {
            match config.check(&path, resigned(&config, &bytes, edit)) {
                Err(KvError::BadFile { reason, .. }) => assert!(reason.contains(want), "{reason}"),
                r => panic!("{want}: {r:?}"),
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
