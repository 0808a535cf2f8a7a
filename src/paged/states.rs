//! Recurrent state beside the blocks: hybrid models' linear-attention and Mamba layers
//! keep a fixed-size state per sequence (a convolution window, an SSM or delta-rule
//! matrix) instead of K/V per position. A pool made with state layers holds one
//! [`StateArena`]: `slots` state slots, each with every state of every state layer.
//!
//! Invariants (checked by [`StateArena::check`] in the tests):
//! - a slot is either free or held by exactly one live sequence;
//! - a slot taken for a new sequence is all zeros (the state before any token);
//! - a fork's slot holds a copy of its source's state at the fork.
//!
//! Each state `s` lives in its own allocation of its own dtype, laid out
//! `[state_layers, slots, *dims]`, so one layer's states of consecutive slots are one
//! strided tensor (what a batched kernel indexes by slot, as vLLM's Mamba layers do).

use std::collections::BTreeSet;

use crate::dtype::DType;
use crate::error::{KvError, Result, Unit};
use crate::layout::{Device, Region};
use crate::storage::{allocate, Storage};
use crate::tensor::{TensorMut, TensorRef};

/// One state of a state layer: its name, its shape per sequence and its dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSpec {
    /// The name it is looked up by (e.g. "conv", "recurrent").
    pub name: String,
    /// Its shape for one sequence and layer.
    pub dims: Vec<usize>,
    /// Its element type (float32, float16 or bfloat16).
    pub dtype: DType,
}

impl StateSpec {
    /// Elements for one sequence and layer.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

/// The state layers of a pool: how many, their states, and the slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateConfig {
    /// State layers (numbered from 0, apart from the pool's K/V layers).
    pub layers: usize,
    /// Sequences that can hold a state at once.
    pub slots: usize,
    /// Checkpoint slots: copies of a sequence's state at a token position, kept for
    /// prefix hits and rollbacks ([`super::checkpoints`]); 0 for none.
    pub checkpoints: usize,
    /// The states every state layer keeps.
    pub specs: Vec<StateSpec>,
}

impl StateConfig {
    /// Bytes of one slot: every state of every layer.
    pub fn slot_bytes(&self) -> usize {
        self.specs
            .iter()
            .map(|s| s.numel() * s.dtype.size() * self.layers)
            .sum()
    }

    /// Bytes of every slot, checkpoint slots included.
    pub fn total_bytes(&self) -> usize {
        self.slot_bytes() * (self.slots + self.checkpoints)
    }

    /// Checks sizes, names and dtypes; fails with the argument's name.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: String, reason: &str| KvError::InvalidArgument {
            name,
            value,
            reason: reason.into(),
        };
        if self.layers == 0 {
            return Err(bad("state_layers", "0".into(), "must be >= 1"));
        }
        if self.slots == 0 {
            return Err(bad("state_slots", "0".into(), "must be >= 1"));
        }
        if self.slots > u32::MAX as usize {
            return Err(bad(
                "state_slots",
                self.slots.to_string(),
                "must be below 2^32",
            ));
        }
        if self.checkpoints > u32::MAX as usize {
            return Err(bad(
                "state_checkpoints",
                self.checkpoints.to_string(),
                "must be below 2^32",
            ));
        }
        if self.specs.is_empty() {
            return Err(bad(
                "state_shapes",
                "{}".into(),
                "name at least one state, e.g. {'conv': (conv_dim, kernel), 'recurrent': (heads, k, v)}",
            ));
        }
        for (i, s) in self.specs.iter().enumerate() {
            if s.name.is_empty() || self.specs[..i].iter().any(|o| o.name == s.name) {
                return Err(bad(
                    "state_shapes",
                    format!("{:?}", s.name),
                    "each state needs a distinct, non-empty name",
                ));
            }
            if s.dims.is_empty() || s.dims.contains(&0) {
                return Err(bad(
                    "state_shapes",
                    format!("{}: {:?}", s.name, s.dims),
                    "every dimension must be >= 1",
                ));
            }
            if !matches!(s.dtype, DType::F32 | DType::F16 | DType::BF16) {
                return Err(bad(
                    "state_dtype",
                    s.dtype.name().into(),
                    "states are float32, float16 or bfloat16",
                ));
            }
        }
        let total = self.specs.iter().try_fold(0usize, |acc, s| {
            s.dims
                .iter()
                .try_fold(s.dtype.size(), |a, &d| a.checked_mul(d))
                .and_then(|b| b.checked_mul(self.layers))
                .and_then(|b| b.checked_mul(self.slots.checked_add(self.checkpoints)?))
                .and_then(|b| acc.checked_add(b))
        });
        if total.is_none_or(|t| t > isize::MAX as usize) {
            return Err(bad(
                "state_shapes",
                format!(
                    "{} states x {} layers x {} slots",
                    self.specs.len(),
                    self.layers,
                    self.slots
                ),
                "the states' bytes exceed the address space",
            ));
        }
        Ok(())
    }
}

/// The state slots of a pool: one allocation per state, and who holds each slot.
#[derive(Debug)]
pub struct StateArena {
    config: StateConfig,
    storages: Vec<Box<dyn Storage>>,
    /// Free slots, lowest first, so sequences made together get consecutive slots.
    free: BTreeSet<u32>,
}

impl StateArena {
    /// Allocates every state of every slot, zero-filled, on `device`.
    pub fn new(config: StateConfig, device: Device) -> Result<Self> {
        config.validate()?;
        let storages = config
            .specs
            .iter()
            .map(|s| {
                let slots = config.slots + config.checkpoints;
                allocate(device, s.dtype, s.numel() * config.layers * slots, 1).map_err(|e| match e
                {
                    KvError::OutOfMemory { bytes, .. } => KvError::OutOfMemory {
                        what: "the recurrent-state arena (state_slots + state_checkpoints \
                                   slots of every state layer: lower state_slots or \
                                   state_checkpoints, or give the pool less memory_bytes)",
                        bytes,
                    },
                    e => e,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let free = (0..config.slots as u32).collect();
        Ok(StateArena {
            config,
            storages,
            free,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &StateConfig {
        &self.config
    }

    /// Slots no sequence holds.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Whether `n` more sequences can take a slot; the error says how many are free.
    pub fn check_room(&self, n: usize, what: impl FnOnce() -> String) -> Result<()> {
        if n <= self.free.len() {
            return Ok(());
        }
        Err(KvError::CacheFull {
            what: what(),
            needed: n,
            free: self.free.len(),
            capacity: self.config.slots,
            unit: Unit::StateSlots,
        })
    }

    /// Takes the lowest free slot and zeroes it; `None` when every slot is held.
    pub fn take(&mut self) -> Option<u32> {
        let slot = self.free.pop_first()?;
        self.zero(slot);
        Some(slot)
    }

    /// Zeroes every state of `slot`: the state before any token.
    pub fn zero(&mut self, slot: u32) {
        for s in 0..self.storages.len() {
            for layer in 0..self.config.layers {
                let r = self.region(s, layer, slot, 1);
                self.storages[s]
                    .fill_zero(r)
                    .expect("zeroing a state slot within its storage: the device failed");
            }
        }
    }

    /// Copies every state of slot `slot` into checkpoint slot `ck` (`save`), or back
    /// (`!save`): one copy within each state's storage per layer.
    pub fn checkpoint_copy(&mut self, slot: u32, ck: u32, save: bool) {
        for s in 0..self.storages.len() {
            for layer in 0..self.config.layers {
                let (live, kept) = (
                    self.region(s, layer, slot, 1),
                    self.checkpoint_region(s, layer, ck),
                );
                let (src, dst) = if save { (live, kept) } else { (kept, live) };
                self.storages[s]
                    .copy_within(src, dst)
                    .expect("copying a state checkpoint within its storage: the device failed");
            }
        }
    }

    /// Every state of checkpoint slot `ck`, states in order, each layer by layer, as
    /// stored (what tiers and files carry: [`StateConfig::slot_bytes`] bytes).
    pub fn read_checkpoint(&self, ck: u32, out: &mut [u8]) -> Result<()> {
        let mut at = 0;
        for (s, spec) in self.config.specs.iter().enumerate() {
            let bytes = spec.numel() * spec.dtype.size();
            for layer in 0..self.config.layers {
                let mut t = TensorMut::from_bytes_mut(
                    &mut out[at..at + bytes],
                    spec.dtype,
                    &[spec.numel(), 1, 1],
                )?;
                self.storages[s].read(self.checkpoint_region(s, layer, ck), &mut t)?;
                at += bytes;
            }
        }
        Ok(())
    }

    /// Writes checkpoint slot `ck` from bytes [`Self::read_checkpoint`] produced.
    pub fn write_checkpoint(&mut self, ck: u32, bytes: &[u8]) -> Result<()> {
        let mut at = 0;
        for (s, spec) in self.config.specs.iter().enumerate() {
            let n = spec.numel() * spec.dtype.size();
            for layer in 0..self.config.layers {
                let t =
                    TensorRef::from_bytes(&bytes[at..at + n], spec.dtype, &[spec.numel(), 1, 1])?;
                let r = self.checkpoint_region(s, layer, ck);
                self.storages[s].write(r, &t)?;
                at += n;
            }
        }
        Ok(())
    }

    /// The flat region of state `s` of `layer` in checkpoint slot `ck`: after every
    /// layer's live slots, `[layers, checkpoints, numel]`.
    fn checkpoint_region(&self, s: usize, layer: usize, ck: u32) -> Region {
        let c = &self.config;
        let numel = c.specs[s].numel();
        Region {
            offset: (c.layers * c.slots + layer * c.checkpoints + ck as usize) * numel,
            shape: [numel, 1, 1],
            strides: [1, 1, 1],
        }
    }

    /// Returns `slot` to the free slots.
    pub fn release(&mut self, slot: u32) {
        let fresh = self.free.insert(slot);
        debug_assert!(fresh, "state slot {slot} released twice");
    }

    /// Copies every state of slot `src` onto slot `dst` (a fork).
    pub fn copy(&mut self, src: u32, dst: u32) {
        if src == dst {
            return;
        }
        for s in 0..self.storages.len() {
            for layer in 0..self.config.layers {
                let (a, b) = (self.region(s, layer, src, 1), self.region(s, layer, dst, 1));
                self.storages[s]
                    .copy_within(a, b)
                    .expect("copying a state slot within its storage: the device failed");
            }
        }
    }

    /// Moves the states of `held` (distinct slots, in order) to the consecutive slots
    /// `first..first + held.len()`, the lowest run whose slots are free or in `held`;
    /// returns `first` and the new slot of each. Contents follow their holders.
    pub fn pack(&mut self, held: &[u32]) -> Result<(u32, Vec<u32>)> {
        let n = held.len();
        let mine: BTreeSet<u32> = held.iter().copied().collect();
        debug_assert_eq!(mine.len(), n, "pack takes distinct slots");
        let usable = |s: u32| self.free.contains(&s) || mine.contains(&s);
        let first = (0..=self.config.slots.saturating_sub(n) as u32)
            .find(|&f| (f..f + n as u32).all(usable))
            .ok_or_else(|| {
                // The longest run of slots that are free or the sequences' own.
                let (mut best, mut run) = (0, 0);
                for s in 0..self.config.slots as u32 {
                    run = if usable(s) { run + 1 } else { 0 };
                    best = best.max(run);
                }
                KvError::CacheFull {
                    what: format!(
                        "placing the states of {n} sequences in consecutive slots (other \
                         sequences' slots split the rest: the longest run is {best})"
                    ),
                    needed: n,
                    free: best,
                    capacity: self.config.slots,
                    unit: Unit::StateSlots,
                }
            })?;
        let targets: Vec<u32> = (first..first + n as u32).collect();
        if targets.as_slice() == held {
            return Ok((first, targets));
        }
        // Through the host: every state of the moved slots is read, then written back
        // at its new slot (the runs may overlap in any order).
        for s in 0..self.storages.len() {
            let spec = &self.config.specs[s];
            let per = spec.numel() * spec.dtype.size();
            for layer in 0..self.config.layers {
                let mut buf = vec![0u8; per * n];
                for (i, &slot) in held.iter().enumerate() {
                    let mut t = TensorMut::from_bytes_mut(
                        &mut buf[i * per..(i + 1) * per],
                        spec.dtype,
                        &[spec.numel(), 1, 1],
                    )?;
                    self.storages[s].read(self.region(s, layer, slot, 1), &mut t)?;
                }
                for (i, &slot) in targets.iter().enumerate() {
                    let t = TensorRef::from_bytes(
                        &buf[i * per..(i + 1) * per],
                        spec.dtype,
                        &[spec.numel(), 1, 1],
                    )?;
                    let r = self.region(s, layer, slot, 1);
                    self.storages[s].write(r, &t)?;
                }
            }
        }
        for &slot in held {
            self.free.insert(slot);
        }
        for &slot in &targets {
            self.free.remove(&slot);
        }
        Ok((first, targets))
    }

    /// The index of state `name` and the checked `layer`.
    pub fn locate(&self, layer: i64, name: &str) -> Result<(usize, usize)> {
        let layer = crate::error::check_index("layer", layer, self.config.layers)?;
        Ok((self.find(name)?, layer))
    }

    /// Reads state `s` of `layer` at `slot` into `dst` (`[numel, 1, 1]`).
    pub fn read(&self, s: usize, layer: usize, slot: u32, dst: &mut TensorMut) -> Result<()> {
        self.storages[s].read(self.region(s, layer, slot, 1), dst)
    }

    /// Writes `src` (`[numel, 1, 1]`) as state `s` of `layer` at `slot`.
    pub fn write(&mut self, s: usize, layer: usize, slot: u32, src: &TensorRef) -> Result<()> {
        let r = self.region(s, layer, slot, 1);
        self.storages[s].write(r, src)
    }

    /// Element offset of state `s` of `layer` at `slot` in its storage.
    pub fn offset(&self, s: usize, layer: usize, slot: u32) -> usize {
        let numel = self.config.specs[s].numel();
        (layer * self.config.slots + slot as usize) * numel
    }

    /// The flat region of state `s` of `layer` for `count` slots from `slot`.
    fn region(&self, s: usize, layer: usize, slot: u32, count: usize) -> Region {
        Region {
            offset: self.offset(s, layer, slot),
            shape: [count * self.config.specs[s].numel(), 1, 1],
            strides: [1, 1, 1],
        }
    }

    /// Sends the arenas' later launches to CUDA stream `stream` (see
    /// [`super::PoolCore::set_stream`]); nothing for host arenas.
    pub fn set_stream(&self, stream: Option<u64>) -> crate::error::Result<()> {
        for st in &self.storages {
            if let Some(c) = st.as_cuda() {
                c.set_stream(stream)?;
            }
        }
        Ok(())
    }

    /// The storage of state `s`.
    pub fn storage(&self, s: usize) -> &dyn Storage {
        &*self.storages[s]
    }

    /// Index of the state named `name`; the error lists the names.
    fn find(&self, name: &str) -> Result<usize> {
        self.config
            .specs
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| KvError::InvalidArgument {
                name: "name",
                value: format!("{name:?}"),
                reason: format!(
                    "this pool's states are {:?}",
                    self.config
                        .specs
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                ),
            })
    }

    /// The allocations' bytes (what inputs may not overlap).
    pub fn spans(&self) -> Vec<crate::tensor::Span> {
        self.storages.iter().flat_map(|s| s.spans()).collect()
    }

    /// Checks that the free slots and `held` (the live sequences' slots) partition the
    /// slots.
    pub fn check(&self, held: &[u32]) -> std::result::Result<(), String> {
        let mut seen = self.free.clone();
        for &s in held {
            if s as usize >= self.config.slots || !seen.insert(s) {
                return Err(format!("state slot {s} held twice or out of range"));
            }
        }
        if seen.len() != self.config.slots {
            return Err(format!(
                "{} of {} state slots are neither free nor held",
                self.config.slots - seen.len(),
                self.config.slots
            ));
        }
        Ok(())
    }
}
