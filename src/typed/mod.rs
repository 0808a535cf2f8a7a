//! The Rust API: safe, typed caches over slices, for Rust programs.
//!
//! [`KvCache`] is the seed's contiguous cache with its exact surface (`new`,
//! `store_key`, `keys_for`, `advance`, `extract_block`, ...; panicking on bad arguments
//! as the seed's do, each with a `try_` twin that returns a `Result`); [`BlockPool`] is
//! the paged pool shared by many sequences, with forks and prefix caching. Both take
//! `usize` indices and slices of their element type ([`Element`]: `f32`, [`half::f16`],
//! [`half::bf16`]), keep their memory on the host, and call the same core as the Python
//! bindings ([`crate::kv_cache::CacheCore`], [`crate::paged::PoolCore`]), which a program
//! that needs raw strided tensors or a CUDA device can use directly.

mod element;
mod kv_cache;
mod pool;

pub use element::Element;
pub use kv_cache::KvCache;
pub use pool::{BlockPool, PoolConfig, TierConfig, TierOptions};
