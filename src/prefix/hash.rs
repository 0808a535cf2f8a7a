//! Chained block hashes: `hash(parent, the block's token ids as little-endian u32,
//! extra_key)`, 128 bits, rooted in the pool's seed and the sequence's namespace.

use std::fmt;
use std::str::FromStr;

use crate::error::KvError;

/// A block's (or a chain root's) hash.
pub type BlockHash = u128;

/// The hash function of a pool's prefix index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashKind {
    /// BLAKE3, truncated to 128 bits: collisions cannot be forged (the default).
    Blake3,
    /// xxh3-128: faster, but collisions can be constructed; for trusted single-tenant use.
    Xxh3,
}

impl FromStr for HashKind {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self, KvError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "blake3" => Ok(HashKind::Blake3),
            "xxh3" | "xxh3_128" | "xxhash" => Ok(HashKind::Xxh3),
            "sha256" | "sha256_cbor" | "sha256_cbor_64bit" => Err(KvError::InvalidArgument {
                name: "hash",
                value: format!("{s:?}"),
                reason: "kvrs has no SHA-256 chains: use 'blake3' (the default, as \
                         collision-resistant and faster) or 'xxh3' (vLLM's 'xxhash')"
                    .into(),
            }),
            _ => Err(KvError::InvalidArgument {
                name: "hash",
                value: format!("{s:?}"),
                reason: "use 'blake3' or 'xxh3' (also spelled 'xxhash', as vLLM does)".into(),
            }),
        }
    }
}

impl fmt::Display for HashKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HashKind::Blake3 => "blake3",
            HashKind::Xxh3 => "xxh3",
        })
    }
}

/// The digest of an extra key: 0 for none, else the first 16 bytes of
/// `BLAKE3("kvrs-extra\0" ‖ extra)`. BLAKE3 block hashes take it as half their key, and
/// the prefix index files cached blocks under it (whatever the pool's hash kind).
pub fn extra_digest(extra: &[u8]) -> u128 {
    if extra.is_empty() {
        return 0;
    }
    let mut h = blake3::Hasher::new();
    h.update(b"kvrs-extra\0");
    h.update(extra);
    let mut first = [0u8; 16];
    first.copy_from_slice(&h.finalize().as_bytes()[..16]);
    u128::from_le_bytes(first)
}

impl HashKind {
    fn digest(self, bytes: &[u8]) -> BlockHash {
        match self {
            HashKind::Blake3 => u128::from_le_bytes(
                blake3::hash(bytes).as_bytes()[..16]
                    .try_into()
                    .expect("32-byte digest"),
            ),
            HashKind::Xxh3 => xxhash_rust::xxh3::xxh3_128(bytes),
        }
    }

    /// The root of every chain of `namespace` in a pool seeded with `seed`:
    /// `hash("kvrs-root\0" ‖ seed ‖ namespace)`.
    pub fn root(self, seed: u128, namespace: &[u8]) -> BlockHash {
        let mut buf = Vec::with_capacity(26 + namespace.len());
        buf.extend_from_slice(b"kvrs-root\0");
        buf.extend_from_slice(&seed.to_le_bytes());
        buf.extend_from_slice(namespace);
        self.digest(&buf)
    }

    /// The hash of a full block of `tokens` after `parent`, with `extra` (LoRA adapter,
    /// multimodal input) mixed in.
    ///
    /// BLAKE3 runs in keyed mode: key `parent ‖ e` (16 + 16 bytes, `e` = 0 without an
    /// extra key, else the first 16 bytes of `BLAKE3("kvrs-extra\0" ‖ extra)`), message
    /// the token ids as little-endian u32, so a 16-token block is one compression. xxh3
    /// hashes `parent ‖ tokens ‖ extra` (unambiguous: parent and block have fixed sizes).
    pub fn block(self, parent: BlockHash, tokens: &[u32], extra: &[u8]) -> BlockHash {
        self.block_with(&mut Vec::new(), parent, tokens, extra)
    }

    /// [`HashKind::block`] reusing `buf` for the input bytes (no allocation once it is large enough).
    pub fn block_with(
        self,
        buf: &mut Vec<u8>,
        parent: BlockHash,
        tokens: &[u32],
        extra: &[u8],
    ) -> BlockHash {
        buf.clear();
        if self == HashKind::Xxh3 {
            buf.extend_from_slice(&parent.to_le_bytes());
        }
        if cfg!(target_endian = "little") {
            // SAFETY: u32 has no padding; on little-endian targets its bytes are the LE encoding.
            buf.extend_from_slice(unsafe {
                std::slice::from_raw_parts(tokens.as_ptr() as *const u8, tokens.len() * 4)
            });
        } else {
            tokens
                .iter()
                .for_each(|t| buf.extend_from_slice(&t.to_le_bytes()));
        }
        match self {
            HashKind::Xxh3 => {
                buf.extend_from_slice(extra);
                xxhash_rust::xxh3::xxh3_128(buf)
            }
            HashKind::Blake3 => {
                let mut key = [0u8; 32];
                key[..16].copy_from_slice(&parent.to_le_bytes());
                key[16..].copy_from_slice(&extra_digest(extra).to_le_bytes());
                u128::from_le_bytes(
                    blake3::keyed_hash(&key, buf).as_bytes()[..16]
                        .try_into()
                        .expect("32-byte digest"),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_depend_on_everything_they_cover() {
        for kind in [HashKind::Blake3, HashKind::Xxh3] {
            let root = kind.root(7, b"");
            assert_ne!(root, kind.root(8, b""));
            assert_ne!(root, kind.root(7, b"tenant"));
            let a = kind.block(root, &[1, 2, 3, 4], b"");
            assert_eq!(a, kind.block(root, &[1, 2, 3, 4], b""));
            assert_ne!(a, kind.block(root, &[1, 2, 3, 5], b""));
            assert_ne!(a, kind.block(root, &[1, 2, 3, 4], b"lora"));
            assert_ne!(a, kind.block(kind.root(7, b"x"), &[1, 2, 3, 4], b""));
        }
        assert_ne!(HashKind::Blake3.root(1, b""), HashKind::Xxh3.root(1, b""));
    }

    #[test]
    fn block_hashes_are_the_documented_construction() {
        let tokens = [1u8, 0, 0, 0, 2, 0, 0, 0];
        let digest = |h: blake3::Hash| u128::from_le_bytes(h.as_bytes()[..16].try_into().unwrap());
        let mut key = [0u8; 32];
        key[..16].copy_from_slice(&5u128.to_le_bytes());
        assert_eq!(
            HashKind::Blake3.block(5, &[1, 2], b""),
            digest(blake3::keyed_hash(&key, &tokens))
        );
        key[16..].copy_from_slice(&blake3::hash(b"kvrs-extra\0xy").as_bytes()[..16]);
        assert_eq!(
            HashKind::Blake3.block(5, &[1, 2], b"xy"),
            digest(blake3::keyed_hash(&key, &tokens))
        );
        let mut input = 5u128.to_le_bytes().to_vec();
        input.extend_from_slice(&tokens);
        input.extend_from_slice(b"xy");
        assert_eq!(
            HashKind::Xxh3.block(5, &[1, 2], b"xy"),
            xxhash_rust::xxh3::xxh3_128(&input)
        );
    }
}
