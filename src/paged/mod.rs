//! The paged cache: a pool of fixed-size blocks shared by many sequences ([`pool`]),
//! its block allocator ([`allocator`]) and the ledger that owns every block's state
//! ([`ledger`]), layer kinds and groups ([`groups`]), sequences'
//! block tables ([`seq`]), where blocks live in storage ([`crate::layout`]), prefix caching on
//! the pool ([`caching`]), slots and page tables for kernels ([`slots`]), position edits
//! ([`shift`]) and ollama-style batched forwards ([`forward`]), and hybrid models' recurrent state slots ([`states`])
//! and their checkpoints ([`checkpoints`], [`checkpointing`], in the tiers [`checkpoint_tiers`]),
//! and when cached blocks reach the tiers ([`write_through`]).

pub mod accept;
pub mod allocator;
pub mod attend;
pub mod caching;
pub mod checkpoint_tiers;
pub mod checkpointing;
pub mod checkpoints;
pub mod edit;
pub mod forward;
pub mod groups;
pub mod ledger;
pub mod pool;
pub mod read;
pub mod seq;
pub mod shift;
pub mod slots;
pub mod state_ops;
pub mod states;
pub mod stats;
pub mod tier_lookup;
pub mod tiering;
pub mod tree_mask;
pub mod write_through;

pub use crate::layout::BlockId;
pub use allocator::BlockAllocator;
pub use forward::ForwardPlan;
pub use groups::{Attention, LayerGroups, LayerKind};
pub use pool::{PoolCore, PrefixConfig, SeqId};
pub use seq::{SeqState, Table, NO_BLOCK};
pub use states::{StateConfig, StateSpec};
pub use stats::{KindStats, PoolStats, StateStats};
pub use tree_mask::{MaskInput, PlanMask};
