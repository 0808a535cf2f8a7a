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
        match s {
            "blake3" => Ok(HashKind::Blake3),
            "xxh3" => Ok(HashKind::Xxh3),
            _ => Err(KvError::InvalidArgument {
                name: "hash",
                value: format!("{s:?}"),
                reason: "use 'blake3' or 'xxh3'".into(),
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

/// Feeds byte slices to one of the two hash functions.
enum Hasher {
    Blake3(Box<blake3::Hasher>),
    Xxh3(Box<xxhash_rust::xxh3::Xxh3>),
}

impl Hasher {
    fn new(kind: HashKind) -> Self {
        match kind {
            HashKind::Blake3 => Hasher::Blake3(Box::new(blake3::Hasher::new())),
            HashKind::Xxh3 => Hasher::Xxh3(Box::new(xxhash_rust::xxh3::Xxh3::new())),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Blake3(h) => {
                h.update(bytes);
            }
            Hasher::Xxh3(h) => h.update(bytes),
        }
    }

    fn finish(self) -> BlockHash {
        match self {
            Hasher::Blake3(h) => {
                let out = h.finalize();
                u128::from_le_bytes(out.as_bytes()[..16].try_into().expect("32-byte digest"))
            }
            Hasher::Xxh3(h) => h.digest128(),
        }
    }
}

impl HashKind {
    /// The root of every chain of `namespace` in a pool seeded with `seed`.
    pub fn root(self, seed: u128, namespace: &[u8]) -> BlockHash {
        let mut h = Hasher::new(self);
        h.update(b"kvrs-root\0");
        h.update(&seed.to_le_bytes());
        h.update(&(namespace.len() as u64).to_le_bytes());
        h.update(namespace);
        h.finish()
    }

    /// The hash of a full block of `tokens` after `parent`, with `extra` (LoRA adapter,
    /// multimodal input) mixed in.
    pub fn block(self, parent: BlockHash, tokens: &[u32], extra: &[u8]) -> BlockHash {
        let mut h = Hasher::new(self);
        h.update(&parent.to_le_bytes());
        if cfg!(target_endian = "little") {
            // SAFETY: u32 has no padding; on little-endian targets its bytes are the LE encoding.
            h.update(unsafe {
                std::slice::from_raw_parts(tokens.as_ptr() as *const u8, tokens.len() * 4)
            });
        } else {
            for t in tokens {
                h.update(&t.to_le_bytes());
            }
        }
        h.update(&(extra.len() as u64).to_le_bytes());
        h.update(extra);
        h.finish()
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
    fn blake3_block_hash_is_the_documented_construction() {
        let mut h = blake3::Hasher::new();
        h.update(&5u128.to_le_bytes());
        h.update(&[1, 0, 0, 0, 2, 0, 0, 0]);
        h.update(&0u64.to_le_bytes());
        let expect = u128::from_le_bytes(h.finalize().as_bytes()[..16].try_into().unwrap());
        assert_eq!(HashKind::Blake3.block(5, &[1, 2], b""), expect);
    }
}
