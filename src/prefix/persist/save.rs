//! Saving: a snapshot of every cached block taken under the pool
//! ([`PoolCore::snapshot_prefix_cache`]), then the file written from it without the pool
//! ([`PrefixSnapshot::write`]): signed, to a temporary file, fsynced and renamed.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use rustc_hash::{FxHashMap, FxHashSet};
use safetensors::tensor::{Dtype, TensorView};

use super::config::{FileConfig, MAC, NUM_BLOCKS};
use super::{io, st_dtype};
use crate::error::{KvError, Result};
use crate::paged::{BlockId, PoolCore};
use crate::tensor::TensorMut;

/// Every cached block of a pool, copied out of it: what [`PrefixSnapshot::write`] writes.
#[derive(Debug)]
pub struct PrefixSnapshot {
    config: FileConfig,
    blocks: usize,
    /// Tensors in file order: name, dtype, shape, little-endian bytes.
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

fn le_bytes<const N: usize, T>(
    values: impl IntoIterator<Item = T>,
    f: fn(T) -> [u8; N],
) -> Vec<u8> {
    values.into_iter().flat_map(f).collect()
}

impl PoolCore {
    /// Copies every cached block (tokens, hashes, parent links, extra keys, K/V of every
    /// storage tensor) out of the pool, least recently used first; `&self` only, so a
    /// caller can write the file ([`PrefixSnapshot::write`]) after letting the pool go.
    pub fn snapshot_prefix_cache(&self) -> Result<PrefixSnapshot> {
        let config = self.prefix_file_config()?;
        let p = self
            .prefix()
            .ok_or_else(|| KvError::NotSupported("prefix caching is off for this pool".into()))?;
        let sh = self.shape();
        // Least recently used first: the evictable blocks in LRU order, then the held ones.
        let mut order: Vec<BlockId> = p.lru.iter().collect();
        let evictable: FxHashSet<BlockId> = order.iter().copied().collect();
        order.extend(
            (0..sh.num_blocks as BlockId)
                .filter(|&b| p.meta(b).is_some() && !evictable.contains(&b)),
        );
        let metas: Vec<_> = order.iter().filter_map(|&b| p.meta(b)).collect();
        let n = metas.len();
        // Distinct extra keys, in order of first use.
        let mut extra_ids: FxHashMap<&[u8], u32> = FxHashMap::default();
        let mut extras: Vec<u8> = Vec::new();
        let mut offsets: Vec<u64> = vec![0];
        let mut extra_index: Vec<u32> = Vec::with_capacity(n);
        for &b in &order {
            let e = p.block_extra(b);
            let id = *extra_ids.entry(e).or_insert_with(|| {
                extras.extend_from_slice(e);
                offsets.push(extras.len() as u64);
                (offsets.len() - 2) as u32
            });
            extra_index.push(id);
        }
        let k = offsets.len() - 1;
        let bs = sh.block_size;
        let mut tensors = vec![
            (
                "tokens".to_string(),
                Dtype::U32,
                vec![n, bs],
                le_bytes(
                    order
                        .iter()
                        .flat_map(|&b| p.block_tokens(b).iter().copied()),
                    u32::to_le_bytes,
                ),
            ),
            (
                "hashes".into(),
                Dtype::U8,
                vec![n, 16],
                le_bytes(metas.iter().map(|m| m.hash), u128::to_le_bytes),
            ),
            (
                "parents".into(),
                Dtype::U8,
                vec![n, 16],
                le_bytes(metas.iter().map(|m| m.parent), u128::to_le_bytes),
            ),
            (
                "first".into(),
                Dtype::U8,
                vec![n],
                metas.iter().map(|m| m.first as u8).collect(),
            ),
            (
                "extra_index".into(),
                Dtype::U32,
                vec![n],
                le_bytes(extra_index, u32::to_le_bytes),
            ),
            (
                "extra_offsets".into(),
                Dtype::U64,
                vec![k + 1],
                le_bytes(offsets, u64::to_le_bytes),
            ),
            ("extras".into(), Dtype::U8, vec![extras.len()], extras),
        ];
        let block_bytes = sh.block_elems() * self.dtype().size();
        let names: Vec<String> = config.data_names().collect();
        for (layer, name) in names.iter().take(config.tensors).enumerate() {
            let mut buf = vec![0u8; n * block_bytes];
            for (chunk, &b) in buf.chunks_exact_mut(block_bytes).zip(&order) {
                let mut dst =
                    TensorMut::from_bytes_mut(chunk, self.dtype(), &[1, 1, sh.block_elems()])?;
                self.storage().read(sh.whole_block(layer, b), &mut dst)?;
            }
            tensors.push((
                name.clone(),
                st_dtype(self.dtype()),
                vec![n, sh.block_elems()],
                buf,
            ));
        }
        for (layer, name) in names.iter().skip(config.tensors).enumerate() {
            let mut scales = vec![0f32; n * config.vectors];
            for (&b, out) in order.iter().zip(scales.chunks_exact_mut(config.vectors)) {
                self.storage()
                    .read_row_scales(sh.whole_block(layer, b), out)?;
            }
            tensors.push((
                name.clone(),
                Dtype::F32,
                vec![n, config.vectors],
                le_bytes(scales, f32::to_le_bytes),
            ));
        }
        Ok(PrefixSnapshot {
            config,
            blocks: n,
            tensors,
        })
    }

    /// Writes every cached block to `path` ([`Self::snapshot_prefix_cache`], then
    /// [`PrefixSnapshot::write`]); returns the blocks written.
    pub fn save_prefix_cache(&self, path: &Path) -> Result<usize> {
        self.snapshot_prefix_cache()?.write(path)
    }
}

impl PrefixSnapshot {
    /// Blocks the snapshot holds.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Writes the snapshot to `path` as a signed safetensors file, atomically (temporary
    /// file, fsync, rename, fsync of the directory); returns the blocks written.
    pub fn write(&self, path: &Path) -> Result<usize> {
        let mut meta: HashMap<String, String> = self
            .config
            .entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        meta.insert(NUM_BLOCKS.into(), self.blocks.to_string());
        let mac = self.config.mac(
            &meta,
            self.tensors
                .iter()
                .map(|(name, _, shape, data)| (name.as_str(), shape.as_slice(), data.as_slice())),
        );
        meta.insert(MAC.into(), mac.to_hex().to_string());
        let views = self
            .tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                TensorView::new(*dtype, shape.clone(), data).map(|v| (name.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| io(path, e))?;
        let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| io(path, e))?;

        let tmp = path.with_file_name(format!(
            ".{}.tmp-{}",
            path.file_name()
                .map_or("kvrs-cache".into(), |f| f.to_string_lossy().to_string()),
            std::process::id()
        ));
        let write = || -> std::io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            fs::rename(&tmp, path)?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io(path, e)
        })?;
        Ok(self.blocks)
    }
}
