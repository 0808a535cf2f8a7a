//! Checking a prefix-cache file without the pool: structure, version, seed id, MAC,
//! configuration, shapes and dtypes, then every block's hash recomputed from its parent,
//! tokens and extra key, duplicates and chain links. A file passes whole or is refused.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use safetensors::tensor::{Dtype, SafeTensors};

use super::checkpoints::{self, FileCheckpoints};
use super::config::{FileConfig, FORMAT, MAC, NUM_BLOCKS, STATE_LAYOUT, VERSION};
use super::{bad, st_dtype};
use crate::error::{KvError, Result};
use crate::paged::caching::group_key;
use crate::prefix::BlockHash;
use crate::sizes;

/// One block of a checked file.
#[derive(Clone, Copy, Debug)]
pub(super) struct FileBlock {
    /// Its hash (its group's key in the index).
    pub hash: BlockHash,
    /// Its parent's hash.
    pub parent: BlockHash,
    /// For a chain's first block, the chain's root (its namespace's).
    pub root: Option<BlockHash>,
    /// The file's block holding its parent, if any.
    pub file_parent: Option<usize>,
    /// Its extra key, an index into [`CheckedFile::extras`].
    pub extra: usize,
    /// Its layer group (0: its hash is the chain hash itself).
    pub group: usize,
}

/// A file that passed every check, ready for [`crate::paged::PoolCore::commit_file`].
#[derive(Debug)]
pub struct CheckedFile {
    /// The configuration entries it was checked against.
    pub(super) entries: Vec<(&'static str, String)>,
    /// The file's bytes.
    pub(super) bytes: Vec<u8>,
    /// Its blocks, least recently used first.
    pub(super) blocks: Vec<FileBlock>,
    /// Token ids, `block_size` per block.
    pub(super) tokens: Vec<u32>,
    /// Distinct extra keys.
    pub(super) extras: Vec<Arc<[u8]>>,
    /// Where each data tensor (K/V of each storage tensor, then int8 scales) lies in `bytes`.
    pub(super) data: Vec<Range<usize>>,
    /// The state layout it records (a pool with state layers wrote it).
    pub(super) state_layout: Option<String>,
    /// Its state checkpoints (when it records a state layout).
    pub(super) checkpoints: Option<FileCheckpoints>,
}

impl CheckedFile {
    /// Blocks the file holds.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}

/// What the checked file's allocations name when the host refuses them.
const CHECKED: &str = "the checked prefix-cache file";

/// The little-endian values of `N` bytes each in `data`, allocated fallibly.
fn values<const N: usize, T>(data: &[u8], f: fn([u8; N]) -> T) -> Result<Vec<T>> {
    let mut out = sizes::with_capacity(CHECKED, data.len() / N)?;
    out.extend(
        data.chunks_exact(N)
            .map(|c| f(c.try_into().expect("chunks of N bytes"))),
    );
    Ok(out)
}

impl FileConfig {
    /// Checks `bytes`, the content of the file at `path` (named in errors), against this
    /// configuration: the whole file or nothing (`KvError::BadFile`). Pure: needs no
    /// pool, so it can run without the pool's lock.
    pub fn check(&self, path: &Path, bytes: Vec<u8>) -> Result<CheckedFile> {
        let fail = |reason: String| bad(path, reason);
        let (header_len, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| fail(format!("not a whole safetensors file ({e})")))?;
        let meta: HashMap<String, String> = header.metadata().clone().unwrap_or_default();
        let entry = |k: &str| meta.get(k).map(String::as_str);
        if entry("format") != Some(FORMAT) {
            return Err(fail("not a kvrs prefix-cache file".into()));
        }
        match entry("version") {
            Some(VERSION) => {}
            Some("1") => {
                return Err(fail(
                    "prefix-cache format version 1, which this kvrs no longer reads (version 2 \
                     signs files with a key derived from the seed and records extra keys); \
                     save the cache again with this kvrs"
                        .into(),
                ))
            }
            v => {
                return Err(fail(format!(
                    "prefix-cache format version {}, expected {VERSION}",
                    shown(v)
                )))
            }
        }
        if entry("seed_id") != Some(self.seed_id.as_str()) {
            return Err(fail(format!(
                "this file was written by a pool with another seed (seed id {}, this pool's is \
                 '{}'; a seed id is a one-way digest of the seed, not the seed); load it into a \
                 pool made with the writing pool's seed: BlockPool(..., seed=<that pool's \
                 pool.seed, an int or its hex string>)",
                shown(entry("seed_id")),
                self.seed_id
            )));
        }
        let data_start = 8 + header_len;
        let infos = header.tensors();
        let all: Vec<(&str, &[usize], &[u8])> = infos
            .iter()
            .map(|(name, info)| {
                let (s, e) = info.data_offsets;
                (
                    name.as_str(),
                    info.shape.as_slice(),
                    &bytes[data_start + s..data_start + e],
                )
            })
            .collect();
        let mac = blake3::Hash::from_hex(entry(MAC).unwrap_or_default())
            .map_err(|_| fail("the file carries no MAC".into()))?;
        // blake3::Hash compares in constant time.
        if self.mac(&meta, all) != mac {
            return Err(fail(
                "MAC mismatch: the file was changed after it was written, or written by a \
                 pool with another seed"
                    .into(),
            ));
        }
        // After the MAC: the model id named is the one the file was signed with.
        let model_id = entry("model_id");
        if model_id != Some(self.model_id.as_str()) {
            let written = model_id.map_or_else(
                || "records no model_id".into(),
                |m| format!("was written by a pool with model_id {m:?}"),
            );
            return Err(fail(format!(
                "this file {written}, this pool's model_id is {:?}; a prefix-cache file loads \
                 only into a pool of the same model_id",
                self.model_id
            )));
        }
        for (key, want) in &self.entries {
            let got = entry(key);
            if got != Some(want.as_str()) {
                return Err(fail(format!(
                    "{key} is {} in the file but {} in this pool",
                    shown(got),
                    shown(Some(want))
                )));
            }
        }
        if let Some(k) = meta.keys().find(|k| {
            ![MAC, NUM_BLOCKS, STATE_LAYOUT].contains(&k.as_str())
                && !self.entries.iter().any(|e| e.0 == *k)
        }) {
            return Err(fail(format!("unexpected metadata entry {k:?}")));
        }
        let state_layout = entry(STATE_LAYOUT);
        match (state_layout, self.state_layout.as_deref()) {
            (None, _) => {}
            (Some(f), Some(p)) if f == p => {}
            (Some(f), None) => {
                return Err(fail(format!(
                    "this file holds the recurrent-state checkpoints of a pool with state \
                     layers ({f}), and this pool has none; load it into a pool with the same \
                     state_layers, state_shapes and state_dtype"
                )))
            }
            (Some(f), Some(p)) => {
                return Err(fail(format!(
                    "state_layout is '{f}' in the file but '{p}' in this pool: its state \
                     checkpoints hold states of another layout; load it into a pool with the \
                     same state_layers, state_shapes and state_dtype"
                )))
            }
        }
        let n: usize = entry(NUM_BLOCKS)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| fail("num_blocks missing".into()))?;
        let data_names: Vec<String> = self.data_names().collect();
        let extras_k = infos
            .get("extra_offsets")
            .and_then(|t| t.shape.first())
            .map_or(0, |&k| k.saturating_sub(1));
        let extras_len = infos
            .get("extras")
            .and_then(|t| t.shape.first())
            .copied()
            .unwrap_or(0);
        let bs = self.block_size;
        let expect: Vec<(String, Dtype, Vec<usize>)> = [
            ("tokens", Dtype::U32, vec![n, bs]),
            ("hashes", Dtype::U8, vec![n, 16]),
            ("parents", Dtype::U8, vec![n, 16]),
            ("first", Dtype::U8, vec![n]),
            ("extra_index", Dtype::U32, vec![n]),
            ("extra_offsets", Dtype::U64, vec![extras_k + 1]),
            ("extras", Dtype::U8, vec![extras_len]),
        ]
        .into_iter()
        .map(|(name, d, s)| (name.to_string(), d, s))
        .chain(data_names.iter().enumerate().map(|(i, name)| {
            if i < self.tensors {
                (
                    name.clone(),
                    st_dtype(self.dtype),
                    vec![n, self.block_elems],
                )
            } else {
                (name.clone(), Dtype::F32, vec![n, self.vectors])
            }
        }))
        .chain(state_layout.into_iter().flat_map(|_| {
            let (m, total) = checkpoints::counts(&infos);
            checkpoints::expected(m, total, self.state_bytes)
        }))
        .collect();
        if infos.len() != expect.len() {
            return Err(fail(format!(
                "holds {} tensors, expected {}",
                infos.len(),
                expect.len()
            )));
        }
        // Where each expected tensor's bytes lie, in `expect`'s order.
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(expect.len());
        for (name, dtype, shape) in &expect {
            let t = infos
                .get(name)
                .ok_or_else(|| fail(format!("tensor {name} missing")))?;
            if t.shape != *shape || t.dtype != *dtype {
                return Err(fail(format!(
                    "tensor {name} is {:?} {:?}, expected {dtype:?} {shape:?}",
                    t.dtype, t.shape
                )));
            }
            ranges.push(data_start + t.data_offsets.0..data_start + t.data_offsets.1);
        }
        let at = |i: usize| &bytes[ranges[i].clone()];
        let tokens = values(at(0), u32::from_le_bytes)?;
        let (hashes, parents) = (
            values(at(1), u128::from_le_bytes)?,
            values(at(2), u128::from_le_bytes)?,
        );
        let first = at(3);
        let extra_index = values(at(4), u32::from_le_bytes)?;
        let extra_bytes = at(6);
        let ends = values(at(5), |b| {
            usize::try_from(u64::from_le_bytes(b)).unwrap_or(usize::MAX)
        })?;
        if ends.first() != Some(&0)
            || ends.last() != Some(&extra_bytes.len())
            || ends.windows(2).any(|w| w[0] > w[1])
        {
            return Err(fail("extra_offsets do not split the extras tensor".into()));
        }
        let mut extras: Vec<Arc<[u8]>> = sizes::with_capacity(CHECKED, ends.len() - 1)?;
        extras.extend(ends.windows(2).map(|w| Arc::from(&extra_bytes[w[0]..w[1]])));

        let mut by_hash: FxHashMap<BlockHash, usize> = FxHashMap::default();
        by_hash.try_reserve(n).map_err(|_| KvError::OutOfMemory {
            what: CHECKED,
            bytes: n.saturating_mul(size_of::<(BlockHash, usize)>()),
        })?;
        let mut blocks = sizes::with_capacity(CHECKED, n)?;
        let mut buf = Vec::new();
        for i in 0..n {
            let (hash, parent) = (hashes[i], parents[i]);
            let extra = extra_index[i] as usize;
            let Some(key) = extras.get(extra) else {
                return Err(fail(format!(
                    "block {i} names extra key {extra} of {}",
                    extras.len()
                )));
            };
            if first[i] > 1 {
                return Err(fail(format!(
                    "block {i}: first is {}, not 0 or 1",
                    first[i]
                )));
            }
            // The group whose key the hash is: the chain hash of (parent, tokens, extra key).
            let toks = &tokens[i * bs..(i + 1) * bs];
            let group = (0..self.groups).find(|&g| {
                let h = self
                    .kind
                    .block_with(&mut buf, group_key(parent, g), toks, key);
                group_key(h, g) == hash
            });
            let Some(g) = group else {
                return Err(fail(format!(
                    "block {i}'s hash is not the hash of its parent, tokens and extra key"
                )));
            };
            if let Some(j) = by_hash.insert(hash, i) {
                return Err(fail(format!("blocks {j} and {i} have the same hash")));
            }
            blocks.push(FileBlock {
                hash,
                parent,
                root: (first[i] == 1).then(|| group_key(parent, g)),
                file_parent: None,
                extra,
                group: g,
            });
        }
        for (i, b) in blocks.iter_mut().enumerate() {
            let p = by_hash.get(&b.parent).copied();
            if b.root.is_some() && p.is_some() {
                return Err(fail(format!(
                    "block {i} is marked first but its parent is a block"
                )));
            }
            b.file_parent = p;
        }
        if let Some(i) = find_loop(&blocks)? {
            return Err(fail(format!("the chain of block {i} loops")));
        }
        let ckpt_ranges = ranges.split_off(7 + data_names.len());
        let checkpoints = match state_layout {
            Some(_) => Some(checkpoints::check(
                self,
                &bytes,
                &ckpt_ranges,
                &blocks,
                &by_hash,
                fail,
            )?),
            None => None,
        };
        Ok(CheckedFile {
            entries: self.entries.clone(),
            data: ranges.split_off(7),
            bytes,
            blocks,
            tokens,
            extras,
            state_layout: state_layout.map(str::to_string),
            checkpoints,
        })
    }
}

/// `Some(i)` when following parents within the file from block `i` comes back to it.
fn find_loop(blocks: &[FileBlock]) -> Result<Option<usize>> {
    // 0: not seen, 1: on the current walk, 2: its chain leaves the file or reaches a root.
    let mut state = sizes::filled(CHECKED, blocks.len(), 0u8)?;
    for start in 0..blocks.len() {
        let mut i = Some(start);
        while let Some(j) = i.filter(|&j| state[j] != 2) {
            if state[j] == 1 {
                return Ok(Some(j));
            }
            state[j] = 1;
            i = blocks[j].file_parent;
        }
        // The walk ended without a loop: mark it done.
        let mut i = Some(start);
        while let Some(j) = i.filter(|&j| state[j] == 1) {
            state[j] = 2;
            i = blocks[j].file_parent;
        }
    }
    Ok(None)
}

/// A metadata entry as messages show it: `'value'`, or `missing`. The recorded
/// `layer_types` keeps Rust's `Some(128)`/`None` (the tiers' fingerprint covers that text,
/// so it cannot change); messages show `128`/`none`.
fn shown(entry: Option<&str>) -> String {
    let plain = |v: &str| {
        v.replace("=Some(", "=")
            .replace(')', "")
            .replace("=None", "=none")
    };
    entry.map_or_else(|| "missing".into(), |v| format!("'{}'", plain(v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(file_parent: Option<usize>) -> FileBlock {
        FileBlock {
            hash: 0,
            parent: 0,
            root: file_parent.is_none().then_some(1),
            file_parent,
            extra: 0,
            group: 0,
        }
    }

    #[test]
    fn loops_are_found_and_chains_pass() {
        let chain = [block(None), block(Some(0)), block(Some(1)), block(Some(1))];
        assert_eq!(find_loop(&chain).unwrap(), None);
        let looped = [block(None), block(Some(2)), block(Some(1)), block(Some(3))];
        assert_eq!(find_loop(&looped).unwrap(), Some(1));
        assert_eq!(find_loop(&[block(Some(0))]).unwrap(), Some(0));
    }
}
