//! The binary payload of one cached block in an offload tier, and the keys tiers file
//! it under.
//!
//! Layout (little-endian), then a keyed BLAKE3 MAC of everything before it:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `KVRSBLK` and format version 2 |
//! | 16 | the pool-configuration fingerprint ([`fingerprint`]) |
//! | 16, 16, 16 | the block's key in the prefix index, its parent's, its chain root |
//! | 1 + 3 | 1 when it is its chain's first block; 3 zero bytes |
//! | 4, 4 | block_size, number of cache tensors `T` |
//! | 8, 8 | bytes of K/V per tensor, bytes of int8 scales per tensor (0 otherwise) |
//! | 12 | zero bytes (the tokens and K/V start 16-byte aligned) |
//! | 4 x block_size | the block's token ids |
//! | T x K/V bytes | each cache tensor's block (K then V, the pool's layout and dtype) |
//! | T x scale bytes | each cache tensor's per-vector scales (int8) |
//! | 32 | keyed BLAKE3 of all the above, under the namespace's [`MacKey`] |
//!
//! A payload is only ever loaded after [`decode`] has checked every field against what
//! the pool expects and the MAC against the bytes: anything else is a miss.
//!
//! **Trust.** The MAC key of a namespace is derived from the pools' shared secret
//! ([`TierKey`]), then from the configuration fingerprint, then from the namespace's
//! root: a writer without the secret cannot produce a payload any pool loads, and a
//! payload of one model or namespace fails the MAC of every other, whatever its key
//! name and header say. Without a secret the key is public (derived from nothing) and
//! the MAC is a checksum: whoever can write to the store is trusted.

use crate::prefix::BlockHash;

/// The payload's magic bytes and version.
const MAGIC: &[u8; 8] = b"KVRSBLK\x02";

/// Bytes before the token ids.
pub(crate) const HEADER: usize = 8 + 16 + 3 * 16 + 4 + 4 + 4 + 8 + 8 + 12;

/// Bytes of the trailing MAC.
pub(crate) const MAC: usize = 32;

/// The shortest secret [`TierKey::new`] accepts, in bytes.
pub const MIN_SECRET: usize = 16;

/// The root of the MAC keys of pools that share a secret (or of none: a public key).
#[derive(Clone)]
pub struct TierKey {
    key: [u8; 32],
    keyed: bool,
}

impl std::fmt::Debug for TierKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TierKey({})",
            if self.keyed { "secret" } else { "public" }
        )
    }
}

impl TierKey {
    /// The key of `secret` (at least [`MIN_SECRET`] bytes), or the public key for `None`.
    pub fn new(secret: Option<&[u8]>) -> Self {
        const CONTEXT: &str = "kvrs 2026-11 tier payload MAC root key";
        TierKey {
            key: blake3::derive_key(CONTEXT, secret.unwrap_or_default()),
            keyed: secret.is_some(),
        }
    }

    /// Whether a secret was given (false: anyone who can write to a store is trusted).
    pub fn is_secret(&self) -> bool {
        self.keyed
    }

    /// A public tag of the key, for the configuration fingerprint: pools with different
    /// secrets file their blocks under different names instead of refusing each other's.
    pub fn tag(&self) -> String {
        hex(&blake3::keyed_hash(&self.key, b"tag").as_bytes()[..8])
    }

    /// The key of the configuration `fp`: the root of its namespaces' keys.
    pub fn config(&self, fp: &Fingerprint) -> ConfigKey {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(b"config");
        h.update(fp);
        ConfigKey(*h.finalize().as_bytes())
    }
}

/// The MAC key root of one configuration ([`TierKey::config`]).
#[derive(Clone)]
pub struct ConfigKey([u8; 32]);

impl std::fmt::Debug for ConfigKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConfigKey(..)")
    }
}

impl ConfigKey {
    /// The MAC key of the payloads of namespace `root`.
    pub fn namespace(&self, root: BlockHash) -> MacKey {
        *blake3::keyed_hash(&self.0, &root.to_le_bytes()).as_bytes()
    }
}

/// The key of a namespace's payload MACs.
pub type MacKey = [u8; 32];

/// What identifies a pool's blocks: two pools share payloads only when they have the
/// same fingerprint (model, layers, heads, head_dim, dtype, scales, block size, layout,
/// hash kind and seed).
pub type Fingerprint = [u8; 16];

/// The fingerprint of a configuration given as `(name, value)` pairs.
pub fn fingerprint<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> Fingerprint {
    let mut h = blake3::Hasher::new();
    h.update(b"kvrs-tier-fingerprint-1");
    for (k, v) in fields {
        for part in [k, v] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
    }
    h.finalize().as_bytes()[..16].try_into().expect("16 bytes")
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key of block `key` of namespace `root` in a tier: `kvrs:{fingerprint}:{root}:{key}`
/// (hex). A namespace is dropped by the key prefix [`namespace_prefix`] gives.
pub fn block_key(fp: &Fingerprint, root: BlockHash, key: BlockHash) -> String {
    format!("{}{:032x}", namespace_prefix(fp, root), key)
}

/// The prefix of every key of namespace `root`.
pub fn namespace_prefix(fp: &Fingerprint, root: BlockHash) -> String {
    format!("kvrs:{}:{:032x}:", hex(fp), root)
}

/// The block-level fields of a payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockMeta {
    /// The block's key in the prefix index.
    pub key: BlockHash,
    /// Its parent's key.
    pub parent: BlockHash,
    /// Its chain root.
    pub root: BlockHash,
    /// Whether it is its chain's first block.
    pub first: bool,
}

/// The shape every payload of a pool has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadShape {
    /// Tokens per block.
    pub block_size: usize,
    /// Cache tensors (one per layer, or per layer group's slot).
    pub tensors: usize,
    /// Bytes of one tensor's block.
    pub tensor_bytes: usize,
    /// Bytes of one tensor's per-vector scales (0 unless int8).
    pub scale_bytes: usize,
}

impl PayloadShape {
    /// Bytes of a whole payload.
    pub fn len(&self) -> usize {
        HEADER + 4 * self.block_size + self.tensors * (self.tensor_bytes + self.scale_bytes) + MAC
    }

    /// Whether payloads hold no K/V (never, for a real pool).
    pub fn is_empty(&self) -> bool {
        self.tensors == 0
    }

    /// Where the K/V of tensor `t` lies in a payload.
    pub fn kv_range(&self, t: usize) -> std::ops::Range<usize> {
        let at = HEADER + 4 * self.block_size + t * self.tensor_bytes;
        at..at + self.tensor_bytes
    }

    /// Where the scales of tensor `t` lie in a payload.
    pub fn scale_range(&self, t: usize) -> std::ops::Range<usize> {
        let at =
            HEADER + 4 * self.block_size + self.tensors * self.tensor_bytes + t * self.scale_bytes;
        at..at + self.scale_bytes
    }
}

/// The header of a payload of `shape` for block `meta`: the bytes before its token ids.
pub fn header(fp: &Fingerprint, shape: &PayloadShape, meta: &BlockMeta) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..24].copy_from_slice(fp);
    for (i, k) in [meta.key, meta.parent, meta.root].into_iter().enumerate() {
        h[24 + 16 * i..40 + 16 * i].copy_from_slice(&k.to_le_bytes());
    }
    h[72] = u8::from(meta.first);
    h[76..80].copy_from_slice(&(shape.block_size as u32).to_le_bytes());
    h[80..84].copy_from_slice(&(shape.tensors as u32).to_le_bytes());
    h[84..92].copy_from_slice(&(shape.tensor_bytes as u64).to_le_bytes());
    h[92..100].copy_from_slice(&(shape.scale_bytes as u64).to_le_bytes());
    h
}

/// Writes the header and tokens of a payload of `shape` into a zeroed buffer of
/// `shape.len()` bytes, whose K/V and scales the caller then fills at
/// [`PayloadShape::kv_range`] and [`PayloadShape::scale_range`] before [`seal`].
pub fn begin(fp: &Fingerprint, shape: &PayloadShape, meta: &BlockMeta, tokens: &[u32]) -> Vec<u8> {
    assert_eq!(tokens.len(), shape.block_size, "a block's tokens");
    let mut out = Vec::with_capacity(shape.len());
    out.extend_from_slice(&header(fp, shape, meta));
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.resize(shape.len(), 0);
    out
}

/// The MAC (under `mac`) of a payload whose bytes before the MAC are the concatenation
/// of `parts`: what [`seal`] writes at its end, computed where the parts lie.
pub fn mac_of(parts: &[&[u8]], mac: &MacKey) -> [u8; MAC] {
    let mut h = blake3::Hasher::new_keyed(mac);
    for p in parts {
        h.update(p);
    }
    *h.finalize().as_bytes()
}

/// Writes the MAC (under `mac`, the key of the payload's namespace) of a payload
/// [`begin`] started and the caller filled.
pub fn seal(payload: &mut [u8], mac: &MacKey) {
    let n = payload.len() - MAC;
    let sum = *blake3::keyed_hash(mac, &payload[..n]).as_bytes();
    payload[n..].copy_from_slice(&sum);
}

/// Why a payload was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not a kvrs payload, or of another format version.
    Format,
    /// Written by a pool of another configuration (fingerprint or shape).
    Config,
    /// Filed under another key than the one asked for.
    Key,
    /// Its bytes do not match its MAC (truncated, corrupted, forged, or of another
    /// namespace or secret).
    Checksum,
}

/// A payload that passed every check: its block fields and token ids (the K/V and
/// scales are read from the bytes at the shape's ranges).
#[derive(Debug)]
pub struct Checked {
    /// The block's fields.
    pub meta: BlockMeta,
    /// Its token ids.
    pub tokens: Vec<u32>,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u128_at(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

/// Checks `payload` as the block `key` of a pool with fingerprint `fp` and payloads of
/// `shape`, in the namespace whose MAC key is `mac`: format, configuration, key, then
/// MAC (compared in constant time).
pub fn decode(
    payload: &[u8],
    fp: &Fingerprint,
    shape: &PayloadShape,
    key: BlockHash,
    mac: &MacKey,
) -> Result<Checked, Refusal> {
    if payload.len() < HEADER || &payload[..8] != MAGIC {
        return Err(Refusal::Format);
    }
    if &payload[8..24] != fp {
        return Err(Refusal::Config);
    }
    let fields = (
        u32_at(payload, 76) as usize,
        u32_at(payload, 80) as usize,
        u64_at(payload, 84) as usize,
        u64_at(payload, 92) as usize,
    );
    if fields
        != (
            shape.block_size,
            shape.tensors,
            shape.tensor_bytes,
            shape.scale_bytes,
        )
    {
        return Err(Refusal::Config);
    }
    if payload.len() != shape.len() {
        return Err(Refusal::Checksum);
    }
    let meta = BlockMeta {
        key: u128_at(payload, 24),
        parent: u128_at(payload, 40),
        root: u128_at(payload, 56),
        first: payload[72] == 1,
    };
    if meta.key != key {
        return Err(Refusal::Key);
    }
    let n = payload.len() - MAC;
    let trailer: [u8; 32] = payload[n..].try_into().expect("32 bytes");
    if blake3::keyed_hash(mac, &payload[..n]) != blake3::Hash::from(trailer) {
        return Err(Refusal::Checksum);
    }
    let tokens = payload[HEADER..HEADER + 4 * shape.block_size]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    Ok(Checked { meta, tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(secret: &[u8], fp: &Fingerprint, root: BlockHash) -> MacKey {
        TierKey::new(Some(secret)).config(fp).namespace(root)
    }

    const SECRET: &[u8] = b"sixteen-byte-key-of-the-pools";

    fn sample() -> (Fingerprint, PayloadShape, BlockMeta, Vec<u8>) {
        let fp = fingerprint([("model", "m"), ("dtype", "float16")]);
        let shape = PayloadShape {
            block_size: 4,
            tensors: 2,
            tensor_bytes: 16,
            scale_bytes: 0,
        };
        let meta = BlockMeta {
            key: 7,
            parent: 3,
            root: 1,
            first: false,
        };
        let mut p = begin(&fp, &shape, &meta, &[10, 11, 12, 13]);
        for t in 0..2 {
            let r = shape.kv_range(t);
            p[r].iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (i + 16 * t) as u8);
        }
        seal(&mut p, &mac(SECRET, &fp, 1));
        (fp, shape, meta, p)
    }

    #[test]
    fn a_payload_round_trips_and_every_fault_is_refused() {
        let (fp, shape, meta, p) = sample();
        let m = mac(SECRET, &fp, 1);
        let ok = decode(&p, &fp, &shape, 7, &m).unwrap();
        assert_eq!(
            (ok.meta, ok.tokens.as_slice()),
            (meta, &[10, 11, 12, 13][..])
        );
        assert_eq!(p[shape.kv_range(1)][3], 19);
        assert_eq!(decode(&p, &fp, &shape, 8, &m).unwrap_err(), Refusal::Key);
        let other = fingerprint([("model", "other"), ("dtype", "float16")]);
        assert_eq!(
            decode(&p, &other, &shape, 7, &m).unwrap_err(),
            Refusal::Config
        );
        let wider = PayloadShape {
            tensor_bytes: 32,
            ..shape
        };
        assert_eq!(decode(&p, &fp, &wider, 7, &m).unwrap_err(), Refusal::Config);
        assert_eq!(
            decode(&p[..p.len() - 1], &fp, &shape, 7, &m).unwrap_err(),
            Refusal::Checksum
        );
        assert_eq!(
            decode(&p[..20], &fp, &shape, 7, &m).unwrap_err(),
            Refusal::Format
        );
        for bit in [0, 100, 8 * 120, 8 * (p.len() - 1)] {
            let mut q = p.clone();
            q[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&q, &fp, &shape, 7, &m).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn only_the_secret_of_the_namespace_and_configuration_verifies_a_payload() {
        let (fp, shape, _, p) = sample();
        assert!(decode(&p, &fp, &shape, 7, &mac(SECRET, &fp, 1)).is_ok());
        // Another secret, no secret, another namespace, another configuration's key.
        let other_fp = fingerprint([("model", "other")]);
        for wrong in [
            mac(b"another-sixteen-byte-secret", &fp, 1),
            TierKey::new(None).config(&fp).namespace(1),
            mac(SECRET, &fp, 2),
            mac(SECRET, &other_fp, 1),
        ] {
            assert_eq!(
                decode(&p, &fp, &shape, 7, &wrong).unwrap_err(),
                Refusal::Checksum
            );
        }
        // A writer without the secret re-signs forged K/V: refused.
        let mut forged = p.clone();
        forged[shape.kv_range(0)].fill(0xAB);
        seal(&mut forged, &TierKey::new(None).config(&fp).namespace(1));
        assert_eq!(
            decode(&forged, &fp, &shape, 7, &mac(SECRET, &fp, 1)).unwrap_err(),
            Refusal::Checksum
        );
        assert!(TierKey::new(Some(SECRET)).is_secret() && !TierKey::new(None).is_secret());
        assert_ne!(TierKey::new(Some(SECRET)).tag(), TierKey::new(None).tag());
        assert!(!format!("{:?}", TierKey::new(Some(SECRET))).contains("sixteen"));
    }

    #[test]
    fn keys_file_blocks_by_configuration_and_namespace() {
        let fp = fingerprint([("a", "1")]);
        let k = block_key(&fp, 5, 9);
        assert!(k.starts_with(&namespace_prefix(&fp, 5)));
        assert!(!k.starts_with(&namespace_prefix(&fp, 6)));
        assert_ne!(fingerprint([("a", "1")]), fingerprint([("a", "2")]));
        assert_ne!(fingerprint([("ab", "")]), fingerprint([("a", "b")]));
    }
}
