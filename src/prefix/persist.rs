//! Saving the prefix cache to one safetensors file and warming a pool from it.
//!
//! Tensors: `tokens` (u32 `[n, block_size]`), `hashes` and `parents` (u8 `[n, 16]`,
//! little-endian 128-bit), `first` (u8 `[n]`: 1 when the parent is a chain root) and
//! `kv.{tensor}` (`[n, block_elems]` of the storage dtype: K then V of each block in each
//! cache tensor, in the pool's layout; fp8 and int8 as their codes) and, for int8,
//! `scales.{tensor}` (f32 `[n, block_elems / head_dim]`: the scale of each head vector).
//! fp8 pools record their scales in the metadata (`kv_scales`), so a file is refused by
//! a pool whose codes would mean other values. Blocks are stored least recently used
//! first. The header's metadata
//! records the pool configuration and a BLAKE3 checksum of every tensor's bytes, so a
//! truncated, corrupted or mismatched file is refused before anything is loaded.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use rustc_hash::FxHashSet;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::hash::BlockHash;
use super::index::CachedBlock;
use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::paged::{BlockId, PoolCore};
use crate::tensor::TensorRef;

const FORMAT: &str = "kvrs-prefix-cache";
const VERSION: &str = "1";

/// What a load did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadReport {
    /// Blocks now cached from the file.
    pub loaded: usize,
    /// Blocks of the file not loaded: no room, already cached, or their chain broken.
    pub skipped: usize,
}

fn io(path: &Path, e: impl std::fmt::Display) -> KvError {
    KvError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> KvError {
    KvError::BadFile {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F8E4M3 => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
        DType::I8 => Dtype::I8,
    }
}

/// The names of the per-block tensors of `pool`: K/V of each cache tensor, then (int8)
/// their per-vector scales.
fn block_tensor_names(pool: &PoolCore) -> Vec<String> {
    let tensors = pool.groups().per_block;
    let scales = if pool.dtype() == DType::I8 {
        tensors
    } else {
        0
    };
    (0..tensors)
        .map(|l| format!("kv.{l}"))
        .chain((0..scales).map(|l| format!("scales.{l}")))
        .collect()
}

/// The metadata a file must carry to load into `pool`.
pub(crate) fn expected_metadata(pool: &PoolCore) -> Vec<(&'static str, String)> {
    let sh = pool.shape();
    let p = pool.prefix().expect("prefix caching on");
    vec![
        ("format", FORMAT.into()),
        ("version", VERSION.into()),
        ("num_layers", sh.num_layers.to_string()),
        ("layer_types", layer_types(pool)),
        ("num_kv_heads", sh.num_kv_heads.to_string()),
        ("head_dim", sh.head_dim.to_string()),
        ("block_size", sh.block_size.to_string()),
        ("layout", sh.layout.to_string()),
        ("dtype", pool.dtype().name().into()),
        ("hash", p.kind.to_string()),
        ("seed", format!("{:032x}", p.seed)),
    ]
    .into_iter()
    .chain(fp8_scales(pool).map(|s| ("kv_scales", s)))
    .collect()
}

/// The fp8 scales the codes were stored with (`None` for other dtypes).
fn fp8_scales(pool: &PoolCore) -> Option<String> {
    pool.dtype().fp8()?;
    let s = pool.scales();
    let all: Vec<String> = s
        .keys()
        .iter()
        .chain(s.values())
        .map(|x| format!("{x:e}"))
        .collect();
    Some(all.join(","))
}

/// The pool's layer kinds, window and chunk size, as one string.
fn layer_types(pool: &PoolCore) -> String {
    let a = &pool.groups().attention;
    let kinds: Vec<&str> = a.kinds.iter().map(|k| k.name()).collect();
    format!(
        "{} window={:?} chunk={:?}",
        kinds.join(","),
        a.sliding_window,
        a.chunk_size
    )
}

/// BLAKE3 over the tensors' names and bytes, in name order.
fn checksum<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> String {
    let mut all: Vec<(&str, &[u8])> = tensors.into_iter().collect();
    all.sort_by_key(|t| t.0);
    let mut h = blake3::Hasher::new();
    for (name, data) in all {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(&(data.len() as u64).to_le_bytes());
        h.update(data);
    }
    h.finalize().to_hex().to_string()
}

impl PoolCore {
    /// Writes every cached block (tokens, hashes, parent links, K/V of every layer) to
    /// `path` atomically (temporary file, fsync, rename); returns the blocks written.
    pub fn save_prefix_cache(&self, path: &Path) -> Result<usize> {
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
        let n = order.len();
        let (mut tokens, mut hashes, mut parents, mut first) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &b in &order {
            let m = p.meta(b).expect("cached");
            tokens.extend(p.block_tokens(b).iter().flat_map(|t| t.to_le_bytes()));
            hashes.extend(m.hash.to_le_bytes());
            parents.extend(m.parent.to_le_bytes());
            first.push(m.first as u8);
        }
        let es = self.dtype().size();
        let block_bytes = sh.block_elems() * es;
        let tensors = self.groups().per_block;
        let vectors = sh.block_elems() / sh.head_dim;
        let names = block_tensor_names(self);
        let mut kv: Vec<Vec<u8>> = Vec::with_capacity(names.len());
        for layer in 0..tensors {
            let mut buf = vec![0u8; n * block_bytes];
            for (i, &b) in order.iter().enumerate() {
                let dst = unsafe {
                    TensorRef::contiguous(
                        buf.as_mut_ptr().add(i * block_bytes),
                        self.dtype(),
                        &[1, 1, sh.block_elems()],
                    )?
                };
                self.storage().read(sh.whole_block(layer, b), &dst)?;
            }
            kv.push(buf);
        }
        for layer in 0..names.len() - tensors {
            let mut scales = vec![0f32; n * vectors];
            for (&b, out) in order.iter().zip(scales.chunks_exact_mut(vectors)) {
                self.storage()
                    .read_row_scales(sh.whole_block(layer, b), out)?;
            }
            kv.push(scales.iter().flat_map(|x| x.to_le_bytes()).collect());
        }
        let mut views: Vec<(String, TensorView<'_>)> = vec![
            (
                "tokens".into(),
                TensorView::new(Dtype::U32, vec![n, sh.block_size], &tokens)
                    .expect("sizes computed above"),
            ),
            (
                "hashes".into(),
                TensorView::new(Dtype::U8, vec![n, 16], &hashes).expect("sizes computed above"),
            ),
            (
                "parents".into(),
                TensorView::new(Dtype::U8, vec![n, 16], &parents).expect("sizes computed above"),
            ),
            (
                "first".into(),
                TensorView::new(Dtype::U8, vec![n], &first).expect("sizes computed above"),
            ),
        ];
        for (i, (name, buf)) in names.iter().zip(&kv).enumerate() {
            let (dtype, width) = if i < tensors {
                (st_dtype(self.dtype()), sh.block_elems())
            } else {
                (Dtype::F32, vectors)
            };
            views.push((
                name.clone(),
                TensorView::new(dtype, vec![n, width], buf).expect("sizes computed above"),
            ));
        }
        let mut meta: HashMap<String, String> = expected_metadata(self)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        meta.insert("num_blocks".into(), n.to_string());
        meta.insert(
            "checksum".into(),
            checksum(views.iter().map(|(k, v)| (k.as_str(), v.data()))),
        );
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
        Ok(n)
    }

    /// Warms the prefix cache from a file written by [`Self::save_prefix_cache`]. The
    /// file must match this pool (layers, heads, head size, dtype, block size, layout,
    /// hash kind and seed) and be whole, or nothing is loaded. With less free room than
    /// the file holds, the most recently used blocks that fit are loaded (only those
    /// whose chain from a root is complete); loaded blocks are evictable, as if freed.
    pub fn load_prefix_cache(&mut self, path: &Path) -> Result<LoadReport> {
        self.prefix()
            .ok_or_else(|| KvError::NotSupported("prefix caching is off for this pool".into()))?;
        let bytes = fs::read(path).map_err(|e| io(path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(path, format!("not a whole safetensors file ({e})")))?;
        let (_, header) =
            SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        for (key, want) in expected_metadata(self) {
            match meta.get(key) {
                Some(got) if *got == want => {}
                got => {
                    return Err(bad(
                        path,
                        format!("{key} is {got:?} in the file but {want:?} in this pool"),
                    ))
                }
            }
        }
        let sh = self.shape();
        let n: usize = meta
            .get("num_blocks")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(path, "num_blocks missing"))?;
        let names: Vec<String> = ["tokens", "hashes", "parents", "first"]
            .into_iter()
            .map(String::from)
            .chain(block_tensor_names(self))
            .collect();
        let per_block = self.groups().per_block;
        let vectors = sh.block_elems() / sh.head_dim;
        let mut tensors = Vec::with_capacity(names.len());
        for name in &names {
            tensors.push(
                st.tensor(name)
                    .map_err(|_| bad(path, format!("tensor {name} missing")))?,
            );
        }
        if st.names().len() != names.len() {
            return Err(bad(
                path,
                format!(
                    "holds {} tensors, expected {}",
                    st.names().len(),
                    names.len()
                ),
            ));
        }
        let expect: Vec<(Dtype, Vec<usize>)> = [
            (Dtype::U32, vec![n, sh.block_size]),
            (Dtype::U8, vec![n, 16]),
            (Dtype::U8, vec![n, 16]),
            (Dtype::U8, vec![n]),
        ]
        .into_iter()
        .chain((0..per_block).map(|_| (st_dtype(self.dtype()), vec![n, sh.block_elems()])))
        .chain((per_block..names.len() - 4).map(|_| (Dtype::F32, vec![n, vectors])))
        .collect();
        for ((name, t), (dtype, shape)) in names.iter().zip(&tensors).zip(&expect) {
            if t.shape() != shape.as_slice() || t.dtype() != *dtype {
                return Err(bad(
                    path,
                    format!(
                        "tensor {name} is {:?} {:?}, expected {dtype:?} {shape:?}",
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
        }
        let sum = checksum(
            names
                .iter()
                .map(String::as_str)
                .zip(tensors.iter().map(|t| t.data())),
        );
        if meta.get("checksum") != Some(&sum) {
            return Err(bad(path, "checksum mismatch (the file is corrupted)"));
        }

        let u128_at = |data: &[u8], i: usize| -> BlockHash {
            u128::from_le_bytes(data[i * 16..(i + 1) * 16].try_into().expect("16 bytes"))
        };
        let (tok, hashes, parents, first) = (
            tensors[0].data(),
            tensors[1].data(),
            tensors[2].data(),
            tensors[3].data(),
        );
        let index = self.prefix().expect("checked");
        // The most recently used blocks that fit in the free room and are not cached yet.
        let room = self.free_block_count();
        let fresh: Vec<usize> = (0..n)
            .filter(|&i| index.lookup(u128_at(hashes, i)).is_none())
            .collect();
        let mut keep: Vec<usize> = fresh[fresh.len().saturating_sub(room)..].to_vec();
        // Only blocks whose chain reaches a root can ever be matched.
        loop {
            let known: FxHashSet<BlockHash> = keep.iter().map(|&i| u128_at(hashes, i)).collect();
            let before = keep.len();
            keep.retain(|&i| {
                first[i] == 1
                    || known.contains(&u128_at(parents, i))
                    || index.lookup(u128_at(parents, i)).is_some()
            });
            if keep.len() == before {
                break;
            }
        }
        let es = self.dtype().size();
        let block_bytes = sh.block_elems() * es;
        // Each block's chain root (where the offload tiers file it): a first block's
        // parent, or its parent's root, from the index or from the file. Parents come
        // first, so the file's blocks are taken in rounds.
        let mut roots: rustc_hash::FxHashMap<BlockHash, BlockHash> = Default::default();
        let mut pending = keep.clone();
        while !pending.is_empty() {
            let before = pending.len();
            let mut later = Vec::new();
            for i in pending {
                let (hash, parent) = (u128_at(hashes, i), u128_at(parents, i));
                let index = self.prefix().expect("checked");
                let root = if first[i] == 1 {
                    Some(parent)
                } else {
                    roots.get(&parent).copied().or_else(|| {
                        index
                            .lookup(parent)
                            .and_then(|b| index.meta(b))
                            .map(|m| m.root)
                    })
                };
                let Some(root) = root else {
                    later.push(i);
                    continue;
                };
                roots.insert(hash, root);
                self.load_file_block(
                    &tensors,
                    names.len(),
                    i,
                    CachedBlock {
                        hash,
                        parent,
                        first: first[i] == 1,
                        root,
                    },
                    &tok[i * sh.block_size * 4..(i + 1) * sh.block_size * 4],
                    block_bytes,
                )?;
            }
            assert!(
                later.len() < before,
                "every kept block's chain reaches a root"
            );
            pending = later;
        }
        Ok(LoadReport {
            loaded: keep.len(),
            skipped: n - keep.len(),
        })
    }

    /// Loads block `i` of a file's tensors into a fresh block and caches it as `meta`.
    fn load_file_block(
        &mut self,
        tensors: &[TensorView<'_>],
        names: usize,
        i: usize,
        meta: CachedBlock,
        tok: &[u8],
        block_bytes: usize,
    ) -> Result<()> {
        let sh = self.shape();
        let per_block = self.groups().per_block;
        let vectors = sh.block_elems() / sh.head_dim;
        let b = self.take_free_block().expect("room counted above");
        for layer in 0..per_block {
            let data = &tensors[4 + layer].data()[i * block_bytes..(i + 1) * block_bytes];
            // SAFETY: `data` holds one block of the storage dtype, alive for the write.
            let src = unsafe {
                TensorRef::contiguous(data.as_ptr(), self.dtype(), &[1, 1, sh.block_elems()])?
            };
            self.storage_mut().write(sh.whole_block(layer, b), &src)?;
        }
        for layer in 0..names - 4 - per_block {
            let data =
                &tensors[4 + per_block + layer].data()[i * vectors * 4..(i + 1) * vectors * 4];
            let scales: Vec<f32> = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            self.storage_mut()
                .write_row_scales(sh.whole_block(layer, b), &scales)?;
        }
        let tokens: Vec<u32> = tok
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        // Version 1 files do not record extra keys.
        let adopted = self.adopt_cached(b, meta, &tokens, b"");
        assert!(adopted, "block {i} of the file was checked to be new");
        Ok(())
    }
}
