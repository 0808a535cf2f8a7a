//! A pool's recurrent state slots seen from its sequences ([`super::states`]): making a
//! pool with state layers, the room check before a sequence starts, the edits a state
//! forbids, packing a batch's slots, and reading and writing one sequence's state.

use super::pool::{PoolCore, SeqId};
use super::states::{StateArena, StateConfig};
use crate::error::{KvError, Result};
use crate::tensor::{TensorMut, TensorRef};

impl PoolCore {
    /// Gives the pool `config.layers` state layers beside its K/V layers: one state slot
    /// per sequence (of `config.slots`), taken zeroed when a sequence starts, copied by
    /// `fork`, freed with the sequence. A pool that caches prefixes also keeps
    /// `config.checkpoints` state checkpoints (at least one), so that a prefix hit
    /// restores the state of exactly its length ([`super::checkpointing`]).
    pub fn with_states(mut self, config: StateConfig) -> Result<Self> {
        if self.prefix().is_some() && config.checkpoints == 0 {
            return Err(KvError::InvalidArgument {
                name: "state_checkpoints",
                value: "0".into(),
                reason: "a pool with state layers that caches prefixes needs checkpoint slots: \
                         a hit restores the recurrent state from a checkpoint at its length \
                         (give state_checkpoints >= 1, or prefix_caching=False)"
                    .into(),
            });
        }
        if !self.seqs.is_empty() {
            return Err(KvError::NotSupported(
                "state layers are given before the pool's first sequence".into(),
            ));
        }
        if self.tiers.is_some() {
            return Err(KvError::NotSupported(
                "state layers are given before the pool's offload tiers (with_states, then \
                 with_tiers): the tiers' fingerprint covers the state layout"
                    .into(),
            ));
        }
        if self.prefix().is_some() {
            self.checkpoints = Some(super::checkpoints::CheckpointIndex::new(
                config.checkpoints,
            )?);
        }
        self.states = Some(StateArena::new(config, self.device())?);
        Ok(self)
    }

    /// Takes a state checkpoint whenever a decode commit reaches a multiple of
    /// `interval` positions (a multiple of the block size; 0: never), beside those of
    /// prefill chunks ([`super::checkpointing`]).
    pub fn with_checkpoint_interval(mut self, interval: usize) -> Result<Self> {
        if !interval.is_multiple_of(self.shape.block_size) {
            return Err(KvError::InvalidArgument {
                name: "checkpoint_interval",
                value: interval.to_string(),
                reason: format!(
                    "must be a multiple of block_size ({}): checkpoints sit at block boundaries \
                     during decode",
                    self.shape.block_size
                ),
            });
        }
        self.checkpoint_interval = interval;
        Ok(self)
    }

    /// The state slots, for a pool with state layers.
    pub fn states(&self) -> Option<&StateArena> {
        self.states.as_ref()
    }

    /// Fails unless `n` more sequences can take a state slot (always true without state
    /// layers): callers that start or fork sequences check first.
    pub fn check_state_room(&self, n: usize, what: impl FnOnce() -> String) -> Result<()> {
        self.states
            .as_ref()
            .map_or(Ok(()), |a| a.check_room(n, what))
    }

    /// Moves the states of `ids` (distinct live sequences; a repeat is an error) to
    /// consecutive slots in their order (see [`StateArena::pack`]); returns the first.
    /// Nothing moves on an error.
    pub fn pack_states(&mut self, ids: &[SeqId]) -> Result<u32> {
        let mut seen = rustc_hash::FxHashSet::default();
        if let Some(dup) = ids.iter().find(|&&id| !seen.insert(id)) {
            return Err(KvError::InvalidArgument {
                name: "seqs",
                value: format!("sequence {dup} twice"),
                reason: "each sequence has one state slot: list each once".into(),
            });
        }
        let slots = ids
            .iter()
            .map(|&id| {
                self.seq(id)?.state_slot.ok_or_else(|| {
                    KvError::NotSupported(format!("sequence {id} has no state slot"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let arena = self.states.as_mut().ok_or_else(no_states)?;
        let (first, moved) = arena.pack(&slots)?;
        for (&id, slot) in ids.iter().zip(moved) {
            self.seq_mut(id).state_slot = Some(slot);
        }
        Ok(first)
    }

    /// Fails when sequence `id` has a recurrent state that an edit of its committed
    /// positions from `n` on, other than a cut (a middle removal, a shift), would leave
    /// out of step with its K/V.
    pub(crate) fn check_state_kept(&self, id: SeqId, n: usize, what: &str) -> Result<()> {
        let s = self.seq(id)?;
        if self.states.is_some() && n < s.seq_len {
            return Err(KvError::NotSupported(format!(
                "{what}: sequence {id} has recurrent state, which holds all its {} committed \
                 positions in order and cannot drop or move positions from {n}: only a cut \
                 of the tail (truncate, remove(begin) with end=None) to a position with a \
                 state checkpoint",
                s.seq_len
            )));
        }
        Ok(())
    }

    /// Sequence `id`'s slot, checked.
    fn state_slot(&self, id: SeqId) -> Result<(&StateArena, u32)> {
        let arena = self.states.as_ref().ok_or_else(no_states)?;
        let slot = self
            .seq(id)?
            .state_slot
            .ok_or_else(|| KvError::NotSupported(format!("sequence {id} has no state slot")))?;
        Ok((arena, slot))
    }

    /// Reads state `name` of state layer `layer` of sequence `id` into `dst` (the
    /// state's shape, flattened: `[numel, 1, 1]`; any supported dtype).
    pub fn read_state(&self, id: SeqId, layer: i64, name: &str, dst: &mut TensorMut) -> Result<()> {
        let (arena, slot) = self.state_slot(id)?;
        let (s, layer) = arena.locate(layer, name)?;
        arena.read(s, layer, slot, dst)
    }

    /// Writes `src` (the state's shape, flattened: `[numel, 1, 1]`) as state `name` of
    /// state layer `layer` of sequence `id`.
    pub fn write_state(
        &mut self,
        id: SeqId,
        layer: i64,
        name: &str,
        src: &TensorRef,
    ) -> Result<()> {
        let slot = self.state_slot(id)?.1;
        let arena = self.states.as_mut().expect("checked above");
        let (s, layer) = arena.locate(layer, name)?;
        arena.write(s, layer, slot, src)
    }
}

/// The error of a state operation on a pool without state layers.
fn no_states() -> KvError {
    KvError::NotSupported("this pool has no state layers".into())
}
