//! Checking a prefix-cache file without the pool: structure, version, seed id, MAC,
//! configuration, shapes and dtypes, then every block's hash recomputed from its parent,
//! tokens and extra key, duplicates and chain links. A file passes whole or is refused.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use safetensors::tensor::{Dtype, SafeTensors};

use super::config::{FileConfig, FORMAT, MAC, NUM_BLOCKS, VERSION};
use super::{bad, st_dtype};
use crate::error::Result;
use crate::paged::caching::group_key;
use crate::prefix::BlockHash;

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
}

impl CheckedFile {
    /// Blocks the file holds.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}

fn u128s(data: &[u8]) -> Vec<u128> {
    data.chunks_exact(16)
        .map(|c| {
            let mut b = [0u8; 16];
            b.copy_from_slice(c);
            u128::from_le_bytes(b)
        })
        .collect()
}

fn u32s(data: &[u8]) -> Vec<u32> {
    data.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn u64s(data: &[u8]) -> Vec<u64> {
    data.chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect()
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
                    "prefix-cache format version {v:?}, expected {VERSION}"
                )))
            }
        }
        if entry("seed_id") != Some(self.seed_id.as_str()) {
            return Err(fail(format!(
                "this file was written by a pool with another seed (seed id {:?}, this pool's is \
                 {:?}); pass that pool's seed= to load it",
                entry("seed_id").unwrap_or("none"),
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
        for (key, want) in &self.entries {
            let got = entry(key);
            if got != Some(want.as_str()) {
                return Err(fail(format!(
                    "{key} is {got:?} in the file but {want:?} in this pool"
                )));
            }
        }
        if let Some(k) = meta.keys().find(|k| {
            ![MAC, NUM_BLOCKS].contains(&k.as_str()) && !self.entries.iter().any(|e| e.0 == *k)
        }) {
            return Err(fail(format!("unexpected metadata entry {k:?}")));
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
        let tokens = u32s(at(0));
        let (hashes, parents, first) = (u128s(at(1)), u128s(at(2)), at(3));
        let extra_index = u32s(at(4));
        let (offsets, extra_bytes) = (u64s(at(5)), at(6));
        let ends: Vec<usize> = offsets
            .iter()
            .map(|&o| usize::try_from(o).unwrap_or(usize::MAX))
            .collect();
        if ends.first() != Some(&0)
            || ends.last() != Some(&extra_bytes.len())
            || ends.windows(2).any(|w| w[0] > w[1])
        {
            return Err(fail("extra_offsets do not split the extras tensor".into()));
        }
        let extras: Vec<Arc<[u8]>> = ends
            .windows(2)
            .map(|w| Arc::from(&extra_bytes[w[0]..w[1]]))
            .collect();

        let mut by_hash: FxHashMap<BlockHash, usize> = FxHashMap::default();
        let mut blocks = Vec::with_capacity(n);
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
        check_acyclic(&blocks).map_err(|i| fail(format!("the chain of block {i} loops")))?;
        Ok(CheckedFile {
            entries: self.entries.clone(),
            data: ranges.split_off(7),
            bytes,
            blocks,
            tokens,
            extras,
        })
    }
}

/// `Err(i)` when following parents within the file from block `i` comes back to it.
fn check_acyclic(blocks: &[FileBlock]) -> std::result::Result<(), usize> {
    // 0: not seen, 1: on the current walk, 2: its chain leaves the file or reaches a root.
    let mut state = vec![0u8; blocks.len()];
    for start in 0..blocks.len() {
        let mut walk = Vec::new();
        let mut i = Some(start);
        while let Some(j) = i.filter(|&j| state[j] != 2) {
            if state[j] == 1 {
                return Err(j);
            }
            state[j] = 1;
            walk.push(j);
            i = blocks[j].file_parent;
        }
        for j in walk {
            state[j] = 2;
        }
    }
    Ok(())
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
        }
    }

    #[test]
    fn loops_are_found_and_chains_pass() {
        let chain = [block(None), block(Some(0)), block(Some(1)), block(Some(1))];
        assert_eq!(check_acyclic(&chain), Ok(()));
        let looped = [block(None), block(Some(2)), block(Some(1)), block(Some(3))];
        assert_eq!(check_acyclic(&looped), Err(1));
        assert_eq!(check_acyclic(&[block(Some(0))]), Err(0));
    }
}
