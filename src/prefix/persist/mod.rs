//! Saving the prefix cache to one safetensors file and warming a pool from it.
//!
//! Format version 2. Tensors: `tokens` (u32 `[n, block_size]`), `hashes` and `parents`
//! (u8 `[n, 16]`, little-endian 128-bit), `first` (u8 `[n]`: 1 when the parent is a chain
//! root), `extra_index` (u32 `[n]`: each block's extra key, an index into a table of the
//! distinct keys: `extras`, u8 `[total]`, split by `extra_offsets`, u64 `[k + 1]`),
//! `kv.{tensor}` (`[n, block_elems]` of the storage dtype: K then V of each block in each
//! storage tensor, in the pool's layout; fp8 and int8 as their codes) and, for int8,
//! `scales.{tensor}` (f32 `[n, block_elems / scale_unit]`: the scale of each chunk of
//! `gcd(head_dim, v_head_dim)` elements, each head vector's when K and V have one size).
//! Blocks are stored least recently used first. A pool with state layers also records
//! its state layout and every cached state checkpoint ([`checkpoints`]).
//!
//! The metadata records the pool's configuration (fp8 pools their scales too, so a pool
//! whose codes would mean other values refuses the file), its model id (a pool of
//! another model, even of the same seed and shape, refuses the file), a seed id
//! (one-way, for error messages; never the seed) and a MAC: BLAKE3 keyed with a key
//! derived from the pool's seed over every other metadata entry and every tensor's name,
//! shape and bytes. Only a pool with the same seed accepts a file; the seed is the key.
//!
//! Loading reads the file into a buffer allocated fallibly ([`read_file`]) and checks
//! all of it first, without the pool ([`FileConfig::check`]): MAC, model id,
//! configuration, shapes and dtypes, every block's hash recomputed from its parent,
//! tokens and extra key, no two blocks with one hash, no looping chain. Only then are
//! blocks loaded ([`crate::paged::PoolCore::commit_file`]). Saving likewise copies the
//! cache out under the pool into buffers allocated fallibly
//! ([`crate::paged::PoolCore::snapshot_prefix_cache`]) and streams the file from them
//! without it ([`PrefixSnapshot::write`]). A host that cannot hold either is an error
//! (`KvError::OutOfMemory`), never an abort.

mod check;
mod checkpoints;
mod commit;
mod config;
mod save;

use std::fs;
use std::io::Read;
use std::path::Path;

use safetensors::tensor::Dtype;

pub(crate) use config::{expected_metadata, state_layout};

use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::paged::PoolCore;
use crate::sizes;

/// What a load did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadReport {
    /// Blocks now cached from the file.
    pub loaded: usize,
    /// Blocks of the file not loaded: no room, already cached, or their chain broken.
    pub skipped: usize,
    /// State checkpoints now cached from the file (pools with state layers).
    pub checkpoints: usize,
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

/// A checked file given to a pool it was not checked for.
fn bad_config() -> KvError {
    KvError::InvalidArgument {
        name: "file",
        value: "a checked prefix-cache file".into(),
        reason: "was checked against another pool's configuration".into(),
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

/// The bytes of the file at `path`, read into a buffer allocated fallibly: a file the
/// host cannot hold fails with [`KvError::OutOfMemory`], not an abort.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    let mut f = fs::File::open(path).map_err(|e| io(path, e))?;
    let len = f.metadata().map_err(|e| io(path, e))?.len();
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    let mut bytes = sizes::with_capacity("the prefix-cache file", len)?;
    // At most the bytes the room was made for (a file that grew meanwhile reads truncated
    // and fails its checks), so the buffer never grows.
    (&mut f)
        .take(len as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| io(path, e))?;
    Ok(bytes)
}

impl PoolCore {
    /// Warms the prefix cache from a file written by [`Self::save_prefix_cache`]: reads
    /// it, checks all of it ([`FileConfig::check`]) and only then loads it
    /// ([`Self::commit_file`]). A file of another configuration, model id or seed,
    /// changed, or inconsistent is refused (`KvError::BadFile`) and nothing is loaded;
    /// so is one the host cannot hold (`KvError::OutOfMemory`). With less free room than
    /// the file holds, the most recently used blocks that fit are loaded (only those
    /// whose chain from a root is complete); loaded blocks are evictable, as if freed.
    pub fn load_prefix_cache(&mut self, path: &Path) -> Result<LoadReport> {
        let config = self.prefix_file_config()?;
        let bytes = read_file(path)?;
        let file = config.check(path, bytes)?;
        self.commit_file(file)
    }
}
