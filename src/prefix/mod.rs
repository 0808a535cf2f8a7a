//! Prefix caching: chained block hashes ([`hash`]), the index of cached blocks with
//! their LRU eviction order ([`index`], [`lru`]) and persistence of the cache to a
//! safetensors file ([`persist`]).

pub mod hash;
pub mod index;
pub mod lru;
pub mod persist;

pub use hash::{BlockHash, HashKind};
pub use index::{CachedBlock, PrefixCounters, PrefixEvent, PrefixIndex};
pub use lru::Lru;
pub use persist::LoadReport;
