//! Prefix caching: chained block hashes ([`hash`]), the index of cached blocks with
//! their LRU eviction order ([`index`], [`lru`]; children by parent for partial hits and
//! interned extra keys in private modules) and persistence of the cache to a safetensors
//! file ([`persist`]).

mod extras;
pub mod hash;
pub mod index;
pub mod lru;
pub mod persist;
mod siblings;

pub use hash::{BlockHash, HashKind};
pub use index::{CachedBlock, PrefixCounters, PrefixEvent, PrefixIndex};
