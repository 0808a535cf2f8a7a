//! What one sequence of a pool holds: a block table per layer group, fill lengths and
//! token ids.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::layout::BlockId;
use crate::prefix::BlockHash;

/// Marks a table entry whose block was released (it holds no position the layers keep).
pub const NO_BLOCK: BlockId = BlockId::MAX;

/// The blocks of one layer group of one sequence.
///
/// Entry `i` covers positions `i * block_size..(i + 1) * block_size`. The group holds
/// positions `start..held` (held: its longest layer); an entry is a block exactly when it
/// covers one of those positions, else [`NO_BLOCK`]. Full-attention groups start at 0;
/// sliding and chunked groups move `start` forward as their old positions fall out of
/// every window.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Block ids in position order ([`NO_BLOCK`] before `start`'s block).
    pub blocks: Vec<BlockId>,
    /// First position the group holds.
    pub start: usize,
}

impl Table {
    /// The blocks actually held, in position order.
    pub fn held_blocks(&self) -> impl DoubleEndedIterator<Item = BlockId> + '_ {
        self.blocks.iter().copied().filter(|&b| b != NO_BLOCK)
    }

    /// Index of the first entry that holds a block.
    pub fn first_entry(&self, block_size: usize) -> usize {
        self.start / block_size
    }
}

/// A sequence's block tables, fill lengths and (when it tracks them) token ids.
///
/// Each layer has its own fill length, and `seq_len` is the committed length, never
/// above any layer's. `tokens` are the known token ids (the prompt may run ahead of the
/// held positions); `hashes` are the chained hashes of the first full, committed blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqState {
    /// One block table per layer group (inline for up to two groups: one less pointer
    /// to follow on every scheduling step).
    pub tables: SmallVec<[Table; 2]>,
    /// Positions written per layer.
    pub layer_len: Vec<usize>,
    /// Committed positions.
    pub seq_len: usize,
    /// Known token ids, from position 0.
    pub tokens: Vec<u32>,
    /// Chained hashes of blocks `0..hashes.len()`.
    pub hashes: Vec<BlockHash>,
    /// Root of the sequence's hash chain (its namespace).
    pub root: BlockHash,
    /// Mixed into every block hash (LoRA adapter, multimodal inputs).
    pub extra: Arc<[u8]>,
    /// Prompt tokens served from the prefix cache when the sequence started.
    pub num_cached_tokens: usize,
    /// Of those, the tokens each offload tier served (by tier index; empty without tiers).
    pub tier_tokens: smallvec::SmallVec<[usize; 2]>,
    /// Blocks at or past this position are never cached: their K/V were moved by a
    /// middle removal and no longer match what the model computes for the tokens.
    pub cache_limit: usize,
    /// The first position claimed by [`super::PoolCore::reserve`] and not yet committed by
    /// `advance` (which states the K/V are there), or `usize::MAX`: a `set_seq_len` that
    /// commits past it commits positions nobody said were written, which never join the
    /// prefix cache.
    pub claimed_from: usize,
    /// Counts the edits other than growth (cuts, removals, replacements): a
    /// [`super::ForwardPlan`] placed before one is stale.
    pub edits: u64,
    /// Its recurrent-state slot in a pool with state layers (`paged::states`).
    pub state_slot: Option<u32>,
    /// Token ids it started with (its prompt): commits up to there are prefill chunks,
    /// each ending in a state checkpoint ([`super::checkpointing`]).
    pub prompt_len: usize,
    /// The state checkpoints it holds, by position (each holds one reference).
    pub checkpoints: SmallVec<[(usize, super::checkpoints::CheckpointSlot); 2]>,
    /// Where its prompt leaves the K/V the cache holds, past its state hit: a prefill
    /// chunk should end there, so that a checkpoint lets the next request with this
    /// prefix hit all of it.
    pub branch: Option<usize>,
}

impl SeqState {
    /// Positions the longest layer holds.
    pub fn held(&self) -> usize {
        self.layer_len.iter().copied().max().unwrap_or(0)
    }

    /// Positions the longest of `layers` holds.
    pub fn held_by(&self, layers: &[usize]) -> usize {
        layers.iter().map(|&l| self.layer_len[l]).max().unwrap_or(0)
    }

    /// The common length of every layer, if they agree.
    pub fn uniform_len(&self) -> Option<usize> {
        let first = self.layer_len[0];
        self.layer_len.iter().all(|&l| l == first).then_some(first)
    }

    /// Records an edit other than growth (see [`SeqState::edits`]).
    pub fn edited(&mut self) {
        self.edits += 1;
    }

    /// Every block held, all groups.
    pub fn all_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.tables.iter().flat_map(Table::held_blocks)
    }
}
