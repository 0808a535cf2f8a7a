//! kvrs: KV-cache storage for LLM inference.
//!
//! The core (this crate without the `python` feature) knows nothing of Python:
//! [`layout`] (the shared vocabulary: devices, regions, paged shapes), [`dtype`]
//! (element types and conversion), [`tensor`] (borrowed strided tensors and the
//! strided copy), [`storage`] (the device-independent storage interface and its host
//! backend), [`kv_cache`] (the contiguous cache), [`paged`] (the block pool shared by many
//! sequences) and [`error`] (the one error type).

pub mod attention;
pub mod bytes;
pub mod dtype;
pub mod encoder_cache;
pub mod error;
pub mod kv_cache;
pub mod layout;
pub mod paged;
pub mod prefix;
pub mod rope;
pub mod storage;
pub mod tensor;

#[cfg(feature = "python")]
mod python;

pub use dtype::DType;
pub use error::{KvError, Result};
pub use kv_cache::{CacheShape, KVCache, Kv};
pub use paged::{BlockPool, KvLayout, PagedShape, SeqId};
pub use storage::{Device, Region, Storage};
pub use tensor::TensorRef;
