//! When a pool's cached blocks reach its offload tiers ([`WriteMode`]), and closing a
//! pool's tiers.
//!
//! - **Write-through**: a block is queued for the tiers once, when it becomes cached
//!   (and a cached state checkpoint at a block end when it is published). The queue is
//!   bounded and never waits: a full queue drops the write, and the block is written
//!   when it leaves the pool instead.
//! - **Write-back**: a block is written when it leaves the pool (evicted), or on
//!   `store_to_tiers` and [`PoolCore::close_tiers`].
//! - **Write-through-selective**: a block is written once it has been hit the mode's
//!   number of times while cached, else when it leaves the pool.
//!
//! Whatever the mode, a block the tiers hold (written through, or loaded from them) is
//! never written again while it stays cached: the ledger marks it
//! ([`super::ledger::BlockLedger::mark_stored`]).

use super::pool::PoolCore;
use super::tiering::TierSet;
use crate::layout::BlockId;
use crate::tier::writer::WriteMode;

impl PoolCore {
    /// The write mode of the pool's tiers (`None` without tiers).
    pub fn tier_write_mode(&self) -> Option<WriteMode> {
        self.tiers.as_ref().map(|ts| ts.mode)
    }

    /// Blocks `blocks` just became cached: under write-through each is queued once.
    pub(crate) fn on_cached(&mut self, blocks: &[BlockId]) {
        if self.tier_write_mode() == Some(WriteMode::Through) {
            for &b in blocks {
                self.write_through(b);
            }
        }
    }

    /// A prefix hit attached `blocks`: under write-through-selective, a block reaching
    /// the threshold of hits is queued.
    pub(crate) fn on_hits(&mut self, blocks: &[BlockId]) {
        let Some(WriteMode::ThroughSelective(n)) = self.tier_write_mode() else {
            return;
        };
        for &b in blocks {
            if self.blocks.count_hit(b).is_some_and(|hits| hits >= n) {
                self.write_through(b);
            }
        }
    }

    /// Queues cached block `b` for the tiers unless they hold it; marks it held by them
    /// once queued. Returns whether it was queued.
    fn write_through(&mut self, b: BlockId) -> bool {
        if self.blocks.is_stored(b) {
            return false;
        }
        let Some(p) = self.prefix() else {
            return false;
        };
        let Some(meta) = p.meta(b) else {
            return false;
        };
        let queued = self.write_back(b, &meta, p.block_tokens(b));
        if queued {
            self.blocks.mark_stored(b);
        }
        queued
    }

    /// Queues every cached block the tiers do not hold yet, and the cached state
    /// checkpoints at block ends; returns how many blocks were queued.
    pub fn store_cached(&mut self) -> usize {
        let Some(p) = self.prefix() else {
            return 0;
        };
        if self.tiers.is_none() {
            return 0;
        }
        let cached: Vec<BlockId> = (0..self.shape.num_blocks as BlockId)
            .filter(|&b| p.meta(b).is_some())
            .collect();
        let n = cached.iter().filter(|&&b| self.write_through(b)).count();
        if let Some(index) = self.checkpoints.as_ref() {
            for (c, e) in index.published() {
                self.write_back_checkpoint(c, e);
            }
        }
        n
    }

    /// Closes the pool's tiers: queues what is cached and not yet stored
    /// ([`Self::store_cached`]), waits until it is written, and stops the write-back
    /// thread ([`TierSet::close`]: later writes are dropped and counted). Returns the
    /// blocks queued; closing twice, or a pool without tiers, is harmless (0). (A caller
    /// that shares the pool behind a lock runs `store_cached` under it and
    /// [`TierSet::close`] on a clone of [`PoolCore::tiers`] without it.)
    pub fn close_tiers(&mut self) -> usize {
        let Some(ts) = self.tiers.clone() else {
            return 0;
        };
        if ts.writer.is_closed() {
            return 0;
        }
        let n = self.store_cached();
        ts.close();
        n
    }
}

impl TierSet {
    /// Waits until what is queued is written, then stops the write-back thread.
    pub fn close(&self) {
        self.writer.close();
    }
}
