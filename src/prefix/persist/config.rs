//! What a prefix-cache file must match to load into a pool, and the keys it is signed
//! with: taken from the pool once ([`PoolCore::prefix_file_config`]), then used without
//! it to write or check a file.

use std::collections::HashMap;
use std::fmt;

use crate::dtype::DType;
use crate::error::{KvError, Result};
use crate::paged::PoolCore;
use crate::prefix::HashKind;

/// The `format` entry of every prefix-cache file.
pub(super) const FORMAT: &str = "kvrs-prefix-cache";
/// The format version this kvrs writes and reads.
pub(super) const VERSION: &str = "2";
/// The metadata entry holding the MAC (the one entry the MAC does not cover).
pub(super) const MAC: &str = "mac";
/// The metadata entry holding the number of blocks.
pub(super) const NUM_BLOCKS: &str = "num_blocks";
/// The metadata entry holding the state layout of a pool with state layers
/// ([`state_layout`]); absent for a pool without.
pub(super) const STATE_LAYOUT: &str = "state_layout";

/// A pool's configuration as files record it, with the keys derived from its seed.
/// Holds no seed, only one-way values derived from it; `Debug` leaves the MAC key out.
#[derive(Clone)]
pub struct FileConfig {
    /// Metadata every file for this pool carries (besides `num_blocks` and `mac`).
    pub(super) entries: Vec<(&'static str, String)>,
    /// The seed id written in the file ([`seed_id`]).
    pub(super) seed_id: String,
    /// The pool's model id ([`PoolCore::with_model_id`]), written in the file.
    pub(super) model_id: String,
    /// The key of the file MAC ([`mac_key`]).
    mac_key: [u8; 32],
    /// The pool's hash function (block hashes are recomputed with it on load).
    pub(super) kind: HashKind,
    /// Layer groups of the pool (a block's hash is masked by its group's).
    pub(super) groups: usize,
    /// Positions per block.
    pub(super) block_size: usize,
    /// Elements of one block of one storage tensor (K then V).
    pub(super) block_elems: usize,
    /// int8 scales of one block of one storage tensor: one per `scale_unit` elements
    /// (per head vector when K and V have one head size).
    pub(super) vectors: usize,
    /// The storage dtype.
    pub(super) dtype: DType,
    /// Storage tensors (K/V tensors of the file).
    pub(super) tensors: usize,
    /// Scale tensors of the file (int8: one per storage tensor; else none).
    pub(super) scale_tensors: usize,
    /// The pool's state layout ([`state_layout`]; `None` without state layers).
    pub(super) state_layout: Option<String>,
    /// Bytes of one state checkpoint (0 without state layers).
    pub(super) state_bytes: usize,
}

impl fmt::Debug for FileConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileConfig")
            .field("entries", &self.entries)
            .field("seed_id", &self.seed_id)
            .field("model_id", &self.model_id)
            .field("state_layout", &self.state_layout)
            .finish_non_exhaustive()
    }
}

/// The seed id a file records: the first 8 bytes (hex) of
/// `BLAKE3.derive_key("kvrs prefix-cache seed id v2", seed)`. One-way: it names the seed
/// in error messages without revealing it.
pub fn seed_id(seed: u128) -> String {
    let k = blake3::derive_key("kvrs prefix-cache seed id v2", &seed.to_le_bytes());
    k[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The key of a file's MAC: `BLAKE3.derive_key("kvrs prefix-cache file MAC v2", seed)`.
fn mac_key(seed: u128) -> [u8; 32] {
    blake3::derive_key("kvrs prefix-cache file MAC v2", &seed.to_le_bytes())
}

/// The pool's shape, layer kinds, dtype, hash kind and (fp8) scales: what its blocks'
/// bytes and hashes mean.
fn pool_entries(pool: &PoolCore) -> Vec<(&'static str, String)> {
    let sh = pool.shape();
    let hash = pool
        .prefix()
        .map_or_else(String::new, |p| p.kind.to_string());
    // `v_head_dim` only where it differs: files and tier payloads of pools whose K and
    // V share a head size keep the entries (and fingerprints) they always had.
    let v_head_dim =
        (sh.v_head_dim != sh.head_dim).then(|| ("v_head_dim", sh.v_head_dim.to_string()));
    [
        ("num_layers", sh.num_layers.to_string()),
        ("layer_types", layer_types(pool)),
        ("num_kv_heads", sh.num_kv_heads.to_string()),
        ("head_dim", sh.head_dim.to_string()),
    ]
    .into_iter()
    .chain(v_head_dim)
    .chain([
        ("block_size", sh.block_size.to_string()),
        ("layout", sh.layout.to_string()),
        ("dtype", pool.dtype().name().into()),
        ("hash", hash),
    ])
    .collect()
}

/// The configuration entries the offload tiers' payload fingerprint covers: format
/// version 1's metadata (the seed included, as 32 hex digits). The fingerprint is a hash
/// of them, so the seed never leaves the process; kept as it was so that tiers written
/// before keep being found.
pub(crate) fn expected_metadata(pool: &PoolCore) -> Vec<(&'static str, String)> {
    let seed = pool.prefix().map_or(0, |p| p.seed);
    [("format", FORMAT.to_string()), ("version", "1".into())]
        .into_iter()
        .chain(pool_entries(pool))
        .chain([("seed", format!("{seed:032x}"))])
        .chain(fp8_scales(pool).map(|s| ("kv_scales", s)))
        .collect()
}

/// The state layout of a pool with state layers (`None` without): the number of state
/// layers and each state's name, shape and dtype, what a checkpoint's bytes mean. Slot
/// and checkpoint counts are not part of it: pools of other sizes share checkpoints.
pub(crate) fn state_layout(pool: &PoolCore) -> Option<String> {
    let c = pool.states()?.config();
    let specs: Vec<String> = c
        .specs
        .iter()
        .map(|s| format!("{:?}{:?}:{}", s.name, s.dims, s.dtype.name()))
        .collect();
    Some(format!("layers={} {}", c.layers, specs.join(" ")))
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

impl PoolCore {
    /// What a prefix-cache file of this pool records and must match (the model id
    /// included), with the keys derived from the pool's seed; `NotSupported` without prefix caching. Cheap: take
    /// it under the pool's lock, then check a file ([`FileConfig::check`]) without it.
    pub fn prefix_file_config(&self) -> Result<FileConfig> {
        let p = self
            .prefix()
            .ok_or_else(|| KvError::NotSupported("prefix caching is off for this pool".into()))?;
        let sh = self.shape();
        let seed_id = seed_id(p.seed);
        let entries = [("format", FORMAT.to_string()), ("version", VERSION.into())]
            .into_iter()
            .chain(pool_entries(self))
            .chain([
                ("seed_id", seed_id.clone()),
                ("model_id", self.model_id().to_string()),
            ])
            .chain(fp8_scales(self).map(|s| ("kv_scales", s)))
            .collect();
        let tensors = self.groups().per_block;
        Ok(FileConfig {
            entries,
            seed_id,
            model_id: self.model_id().to_string(),
            mac_key: mac_key(p.seed),
            kind: p.kind,
            groups: self.groups().groups.len(),
            block_size: sh.block_size,
            block_elems: sh.block_elems(),
            vectors: sh.block_elems() / sh.scale_unit(),
            dtype: self.dtype(),
            tensors,
            scale_tensors: if self.dtype() == DType::I8 {
                tensors
            } else {
                0
            },
            state_layout: state_layout(self),
            state_bytes: self.states().map_or(0, |a| a.config().slot_bytes()),
        })
    }
}

impl FileConfig {
    /// The names of the per-block data tensors: K/V of each storage tensor, then (int8)
    /// their per-vector scales.
    pub(super) fn data_names(&self) -> impl Iterator<Item = String> {
        (0..self.tensors)
            .map(|l| format!("kv.{l}"))
            .chain((0..self.scale_tensors).map(|l| format!("scales.{l}")))
    }

    /// The MAC of a file: BLAKE3 keyed with [`mac_key`] over every metadata entry but
    /// the MAC itself, then every tensor's name, shape and bytes, each part
    /// length-prefixed, entries and tensors in name order.
    pub(super) fn mac<'a>(
        &self,
        metadata: &HashMap<String, String>,
        tensors: impl IntoIterator<Item = (&'a str, &'a [usize], &'a [u8])>,
    ) -> blake3::Hash {
        fn part(h: &mut blake3::Hasher, bytes: &[u8]) {
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        }
        let mut h = blake3::Hasher::new_keyed(&self.mac_key);
        part(&mut h, b"kvrs prefix-cache v2");
        let mut entries: Vec<(&String, &String)> =
            metadata.iter().filter(|(k, _)| *k != MAC).collect();
        entries.sort();
        h.update(&(entries.len() as u64).to_le_bytes());
        for (k, v) in entries {
            part(&mut h, k.as_bytes());
            part(&mut h, v.as_bytes());
        }
        let mut tensors: Vec<_> = tensors.into_iter().collect();
        tensors.sort_by_key(|t| t.0);
        h.update(&(tensors.len() as u64).to_le_bytes());
        for (name, shape, data) in tensors {
            part(&mut h, name.as_bytes());
            h.update(&(shape.len() as u64).to_le_bytes());
            for &d in shape {
                h.update(&(d as u64).to_le_bytes());
            }
            part(&mut h, data);
        }
        h.finalize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_ids_and_keys_are_one_way_and_distinct() {
        assert_eq!(seed_id(7).len(), 16);
        assert_ne!(seed_id(7), seed_id(8));
        assert_ne!(mac_key(7), mac_key(8));
        let hex = format!("{:032x}", 7u128);
        assert!(!seed_id(7).contains(&hex[16..]));
    }
}
