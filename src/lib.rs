//! kvrs: KV-cache storage for LLM inference.
//!
//! Rust programs start at the crate root: [`KvCache`] (one sequence, contiguous, the
//! seed's surface) and [`BlockPool`] (a paged pool shared by many sequences, with forks
//! and prefix caching), typed over `f32`, [`half::f16`] or [`half::bf16`] slices with
//! `usize` indices. Python programs use the same core through the `kvrs`
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
//! # The API
//!
//! The supported API is what the crate root re-exports, and the [`tier`] module:
//!
//! - the caches: [`KvCache`] and [`BlockPool`], over an [`Element`] type;
//! - their configuration: [`PoolConfig`] (with [`PagedShape`], [`KvLayout`],
//!   [`Attention`] and [`LayerKind`] for sliding-window and full layers, [`PrefixConfig`]
//!   and [`HashKind`] for prefix caching, [`DType`] for 8-bit storage and [`KvScales`] for
//!   its fp8 scales), [`TierConfig`], [`TierOptions`], [`WritePolicy`] and [`WriteMode`] for offload
//!   tiers, and [`AttnOptions`] for attention;
//! - what they hand back: [`SeqId`] (a sequence of a pool), [`PoolStats`] (with
//!   [`KindStats`], [`StateStats`], [`PrefixCounters`]), [`Kv`] and [`Device`];
//! - errors: [`KvError`], [`Result`] and [`Unit`];
//! - offload tiers ([`tier`]): [`tier::HostTier`], [`tier::DiskTier`] and, with the
//!   `redis` feature, `tier::RedisTier`, all behind the [`tier::Tier`] trait (a program
//!   may implement its own).
//!
//! Everything else is internal. The dtype-erased cores that the Python bindings (a
//! separate crate, `kvrs-python` in `bindings/python`, built by maturin) are written over
//! (raw strided tensors of any dtype, CUDA devices, slot mappings, page tables, batched
//! forwards) are re-exported, for the bindings and this crate's tests, benches and tools,
//! by a hidden `unstable` module that carries no stability promise: any release may
//! change it.
//!
//! # Cargo features
//!
//! None is on by default: the default build is the core alone (caches, pools, prefix
//! caching, attention, the host and disk tiers): about half the dependencies of the
//! full build, and no network client or TLS stack.
//!
//! - `redis`: `tier::RedisTier`, the Redis (or Valkey) tier shared by many
//!   processes, on single servers and Redis Cluster (the `redis` crate; pure Rust);
//! - `redis-tls`: `redis`, plus `rediss://` URLs (rustls with its `ring` provider, which
//!   needs a C compiler, and the system's trust roots); without it a `rediss://` URL is
//!   [`KvError::NotSupported`];
//! - `cuda`: the CUDA backend (the driver and NVRTC are loaded at run time, so it builds
//!   without a toolkit); reached through the Python package, whose wheel is built with
//!   `cuda` and `redis-tls` (`pyproject.toml`), so it has every tier;
//! - `cuda-sim`: tests only, the CUDA backend on a simulated device.

#![warn(missing_docs)]

// The core's modules are crate-private: the supported API is what this root re-exports
// and `tier`; `unstable` re-exports the internals that the bindings crate, tests, benches
// and tools use.
mod attention;
mod bytes;
mod dtype;
mod encoder_cache;
mod error;
mod kv_cache;
mod layout;
mod paged;
mod parallel;
mod per_process;
mod prefix;
mod quant;
mod rope;
mod scales;
mod sizes;
mod storage;
mod suffix;
mod tensor;
pub mod tier;
mod typed;
#[doc(hidden)]
pub mod unstable;
#[cfg(target_arch = "x86_64")]
mod write_avx2;

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
    #[doc = include_str!("../docs/engines.md")]
    pub struct Engines;
    #[doc = include_str!("../docs/attention.md")]
    pub struct Attention;
    #[doc = include_str!("../docs/quantized.md")]
    pub struct Quantized;
    #[doc = include_str!("../docs/transformers.md")]
    pub struct Transformers;
    #[doc = include_str!("../docs/serve.md")]
    pub struct Serve;
    #[doc = include_str!("../docs/speculative.md")]
    pub struct Speculative;
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
pub use layout::{Device, Kv, KvLayout, PagedShape};
pub use paged::checkpoints::CheckpointCounters;
pub use paged::{Attention, KindStats, LayerKind, PoolStats, PrefixConfig, SeqId, StateStats};
pub use prefix::{HashKind, PrefixCounters};
pub use scales::KvScales;
pub use suffix::{SuffixDraft, SuffixIndex, SuffixParams, SuffixStats};
pub use tier::writer::{WriteMode, WritePolicy};
pub use typed::{BlockPool, Element, KvCache, PoolConfig, TierConfig, TierOptions};
