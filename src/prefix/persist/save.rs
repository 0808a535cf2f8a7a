//! Saving: a snapshot of every cached block taken under the pool
//! ([`PoolCore::snapshot_prefix_cache`]), then the file written from it without the pool
//! ([`PrefixSnapshot::write`]): signed, to a temporary file, fsynced and renamed.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use rustc_hash::FxHashMap;
use safetensors::tensor::{Dtype, TensorView};

use super::config::{FileConfig, MAC, NUM_BLOCKS, STATE_LAYOUT};
use super::{io, st_dtype};
use crate::error::{KvError, Result};
use crate::paged::{BlockId, PoolCore};
use crate::sizes;
use crate::tensor::TensorMut;

/// Every cached block of a pool, copied out of it: what [`PrefixSnapshot::write`] writes.
#[derive(Debug)]
pub struct PrefixSnapshot {
    config: FileConfig,
    blocks: usize,
    /// Tensors in file order: name, dtype, shape, little-endian bytes.
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

/// What the snapshot's allocations name when the host refuses them.
const SNAPSHOT: &str = "the prefix-cache snapshot";

/// The little-endian bytes of `len` values (`N` bytes each), allocated fallibly.
fn le_bytes<const N: usize, T>(
    len: usize,
    values: impl IntoIterator<Item = T>,
    f: fn(T) -> [u8; N],
) -> Result<Vec<u8>> {
    let mut out = sizes::with_capacity(SNAPSHOT, len.saturating_mul(N))?;
    out.extend(values.into_iter().flat_map(f));
    Ok(out)
}

/// Grows `v` by room for `more` elements, fallibly.
fn reserve<T>(v: &mut Vec<T>, more: usize) -> Result<()> {
    v.try_reserve(more).map_err(|_| KvError::OutOfMemory {
        what: SNAPSHOT,
        bytes: more.saturating_mul(size_of::<T>()),
    })
}

impl PoolCore {
    /// Copies every cached block (tokens, hashes, parent links, extra keys, K/V of every
    /// storage tensor) and, with state layers, every cached state checkpoint whose
    /// blocks are cached out of the pool, least recently used first; `&self` only, so a
    /// caller can write the file ([`PrefixSnapshot::write`]) after letting the pool go.
    /// Every buffer is allocated fallibly: a snapshot the host cannot hold fails
    /// ([`KvError::OutOfMemory`]) and the pool is unchanged.
    pub fn snapshot_prefix_cache(&self) -> Result<PrefixSnapshot> {
        let config = self.prefix_file_config()?;
        let p = self
            .prefix()
            .ok_or_else(|| KvError::NotSupported("prefix caching is off for this pool".into()))?;
        let sh = self.shape();
        // Least recently used first: the evictable blocks in LRU order, then the held ones.
        let mut order: Vec<BlockId> = sizes::with_capacity(SNAPSHOT, sh.num_blocks)?;
        order.extend(p.lru.iter());
        let mut evictable = sizes::filled(SNAPSHOT, sh.num_blocks, false)?;
        for &b in &order {
            evictable[b as usize] = true;
        }
        order.extend(
            (0..sh.num_blocks as BlockId)
                .filter(|&b| p.meta(b).is_some() && !evictable[b as usize]),
        );
        drop(evictable);
        let mut metas = sizes::with_capacity(SNAPSHOT, order.len())?;
        metas.extend(order.iter().filter_map(|&b| p.meta(b)));
        let n = metas.len();
        // Distinct extra keys, in order of first use.
        let mut extra_ids: FxHashMap<&[u8], u32> = FxHashMap::default();
        extra_ids.try_reserve(n).map_err(|_| KvError::OutOfMemory {
            what: SNAPSHOT,
            bytes: n.saturating_mul(size_of::<(&[u8], u32)>()),
        })?;
        let mut extras: Vec<u8> = Vec::new();
        let mut offsets: Vec<u64> = sizes::with_capacity(SNAPSHOT, n + 1)?;
        offsets.push(0);
        let mut extra_index: Vec<u32> = sizes::with_capacity(SNAPSHOT, n)?;
        for &b in &order {
            let e = p.block_extra(b);
            let id = match extra_ids.get(e) {
                Some(&id) => id,
                None => {
                    reserve(&mut extras, e.len())?;
                    extras.extend_from_slice(e);
                    offsets.push(extras.len() as u64);
                    let id = (offsets.len() - 2) as u32;
                    extra_ids.insert(e, id);
                    id
                }
            };
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
                    n * bs,
                    order
                        .iter()
                        .flat_map(|&b| p.block_tokens(b).iter().copied()),
                    u32::to_le_bytes,
                )?,
            ),
            (
                "hashes".into(),
                Dtype::U8,
                vec![n, 16],
                le_bytes(n, metas.iter().map(|m| m.hash), u128::to_le_bytes)?,
            ),
            (
                "parents".into(),
                Dtype::U8,
                vec![n, 16],
                le_bytes(n, metas.iter().map(|m| m.parent), u128::to_le_bytes)?,
            ),
            (
                "first".into(),
                Dtype::U8,
                vec![n],
                le_bytes(n, metas.iter().map(|m| m.first as u8), u8::to_le_bytes)?,
            ),
            (
                "extra_index".into(),
                Dtype::U32,
                vec![n],
                le_bytes(n, extra_index, u32::to_le_bytes)?,
            ),
            (
                "extra_offsets".into(),
                Dtype::U64,
                vec![k + 1],
                le_bytes(k + 1, offsets, u64::to_le_bytes)?,
            ),
            ("extras".into(), Dtype::U8, vec![extras.len()], extras),
        ];
        let block_bytes = sh.block_elems() * self.dtype().size();
        let names: Vec<String> = config.data_names().collect();
        for (layer, name) in names.iter().take(config.tensors).enumerate() {
            let mut buf = sizes::filled(SNAPSHOT, n * block_bytes, 0u8)?;
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
        let mut scales = sizes::filled(SNAPSHOT, config.vectors, 0f32)?;
        for (layer, name) in names.iter().skip(config.tensors).enumerate() {
            let mut buf = sizes::with_capacity(SNAPSHOT, n * config.vectors * 4)?;
            for &b in &order {
                self.storage()
                    .read_row_scales(sh.whole_block(layer, b), &mut scales)?;
                buf.extend(scales.iter().flat_map(|x| x.to_le_bytes()));
            }
            tensors.push((name.clone(), Dtype::F32, vec![n, config.vectors], buf));
        }
        tensors.extend(self.snapshot_checkpoints(&config)?);
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
    /// file, fsync, rename, fsync of the directory); returns the blocks written. The
    /// tensors stream from the snapshot to the file: no second copy is built in memory.
    pub fn write(&self, path: &Path) -> Result<usize> {
        let mut meta: HashMap<String, String> = self
            .config
            .entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        meta.insert(NUM_BLOCKS.into(), self.blocks.to_string());
        if let Some(layout) = &self.config.state_layout {
            meta.insert(STATE_LAYOUT.into(), layout.clone());
        }
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

        let tmp = path.with_file_name(format!(
            ".{}.tmp-{}",
            path.file_name()
                .map_or("kvrs-cache".into(), |f| f.to_string_lossy().to_string()),
            std::process::id()
        ));
        let write = || -> std::result::Result<(), Box<dyn std::error::Error>> {
            // serialize_to_file writes through a temporary file of its own, made 0600: the
            // file gets the mode of a file this process creates (its umask) instead.
            let mode = fs::File::create(&tmp)?.metadata()?.permissions();
            safetensors::tensor::serialize_to_file(views, Some(meta), &tmp)?;
            let f = fs::File::open(&tmp)?;
            f.set_permissions(mode)?;
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
