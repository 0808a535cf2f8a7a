//! The paged cache: a pool of fixed-size blocks shared by many sequences
//! ([`pool`]), its block allocator ([`allocator`]), where blocks live in storage
//! ([`layout`]) and ollama-style batched forwards ([`forward`]).

pub mod allocator;
pub mod forward;
pub mod layout;
pub mod pool;

pub use allocator::{BlockAllocator, BlockId};
pub use forward::ForwardPlan;
pub use layout::{KvLayout, PagedShape};
pub use pool::{BlockPool, PoolStats, PrefixConfig, SeqId, SeqState};
