//! kvrs: KV-cache storage for LLM inference.
//!
//! Rust programs start at the crate root: [`KvCache`] (one sequence, contiguous, the
//! seed's surface) and [`BlockPool`] (a paged pool shared by many sequences, with forks
//! and prefix caching), typed over `f32`, [`half::f16`] or [`half::bf16`] slices with
//! `usize` indices ([`typed`]). Python programs use the same core through the `kvrs`
//! package.
//!
//! ```
//! use kvrs::KvCache;
//!
//! let mut cache = KvCache::new(1, 2, 4, 16);
//! let kv = vec![1.0f32; 2 * 4]; // one token: [1, num_kv_heads, head_dim]
//! cache.append(0, &kv, &kv)?;
//! cache.advance();
//! let mut out = vec![0.0f32; 4 * 4]; // [1, num_q_heads = 4, head_dim]
//! cache.attention(0, 4, &vec![0.5f32; 4 * 4], &mut out)?;
//! assert_eq!(out, vec![1.0f32; 16]); // one position: attention returns its value
//! # Ok::<(), kvrs::KvError>(())
//! ```
//!
//! The core (this crate without the `python` feature) knows nothing of Python:
//! [`layout`] (the shared vocabulary: devices, regions, paged shapes), [`dtype`]
//! (element types and conversion), [`tensor`] (borrowed strided tensors and the
//! strided copy), [`storage`] (the device-independent storage interface and its host
//! backend), [`kv_cache`] (the contiguous cache's core, `CacheCore`), [`paged`] (the
//! block pool's core, `PoolCore`), [`prefix`] (prefix caching), [`attention`] (attention
//! over cached K/V in place), [`quant`] (8-bit codecs), [`scales`] (fp8 scales), [`sizes`] (checked sizes, fallible
//! bookkeeping allocations) and [`error`] (the one error type). [`typed`] wraps the cores for Rust callers.

#![warn(missing_docs)]

pub mod attention;
pub mod bytes;
pub mod dtype;
pub mod encoder_cache;
pub mod error;
pub mod kv_cache;
pub mod layout;
pub mod paged;
pub mod parallel;
pub mod per_process;
pub mod prefix;
pub mod quant;
pub mod rope;
pub mod scales;
pub mod sizes;
pub mod storage;
pub mod tensor;
pub mod tier;
pub mod typed;

#[cfg(feature = "python")]
mod python;

/// The README's and the manual's (`docs/`) Rust examples, compiled and run by `cargo test --doc`:
/// each is a complete program, as a reader pastes it.
#[cfg(doctest)]
mod manual {
    #[doc = include_str!("../README.md")]
    pub struct Readme;
    #[doc = include_str!("../docs/index.md")]
    pub struct Index;
    #[doc = include_str!("../docs/caches.md")]
    pub struct Caches;
    #[doc = include_str!("../docs/pools.md")]
    pub struct Pools;
    #[doc = include_str!("../docs/prefix-caching.md")]
    pub struct PrefixCaching;
    #[doc = include_str!("../docs/tiers.md")]
    pub struct Tiers;
    #[doc = include_str!("../docs/attention.md")]
    pub struct Attention;
    #[doc = include_str!("../docs/quantized.md")]
    pub struct Quantized;
    #[doc = include_str!("../docs/transformers.md")]
    pub struct Transformers;
    #[doc = include_str!("../docs/architectures.md")]
    pub struct Architectures;
    #[doc = include_str!("../docs/gpu.md")]
    pub struct Gpu;
    #[doc = include_str!("../docs/guarantees.md")]
    pub struct Guarantees;
    #[doc = include_str!("../docs/rust.md")]
    pub struct Rust;
    #[doc = include_str!("../docs/benchmarks.md")]
    pub struct Benchmarks;
    #[doc = include_str!("../docs/development.md")]
    pub struct Development;
    #[doc = include_str!("../docs/api.md")]
    pub struct Api;
}

pub use attention::AttnOptions;
pub use dtype::DType;
pub use error::{KvError, Result, Unit};
pub use kv_cache::Kv;
pub use layout::{Device, KvLayout, PagedShape};
pub use paged::{Attention, LayerKind, PoolStats, SeqId};
pub use typed::{BlockPool, Element, KvCache, PoolConfig, TierConfig, TierOptions};
