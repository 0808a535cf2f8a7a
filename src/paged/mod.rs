//! The paged cache: a pool of fixed-size blocks shared by many sequences ([`pool`]),
//! its block allocator ([`allocator`]), layer kinds and groups ([`groups`]), sequences'
//! block tables ([`seq`]), where blocks live in storage ([`layout`]), prefix caching on
//! the pool ([`caching`]), slots and page tables for kernels ([`slots`]), position edits
//! ([`shift`]) and ollama-style batched forwards ([`forward`]).

pub mod allocator;
pub mod attend;
pub mod caching;
pub mod forward;
pub mod groups;
pub mod layout;
pub mod pool;
pub mod seq;
pub mod shift;
pub mod slots;

pub use allocator::{BlockAllocator, BlockId};
pub use forward::ForwardPlan;
pub use groups::{Attention, LayerGroups, LayerKind};
pub use layout::{KvLayout, PagedShape};
pub use pool::{BlockPool, KindStats, PoolStats, PrefixConfig, SeqId};
pub use seq::{SeqState, Table, NO_BLOCK};
