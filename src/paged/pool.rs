//! The paged block pool: one preallocated storage of fixed-size blocks shared by many
//! sequences, with reference counting, copy-on-write forks, per-group block tables
//! (sliding-window and chunked layers release what no window sees) and, optionally,
//! prefix caching with LRU eviction ([`super::caching`]).
//!
//! This file holds the pool's construction, its blocks' life cycle and its sequences'
//! (new, fork, free, copy_prefix, window trimming). The other operations are beside it:
//! [`super::edit`] (writes and commits), [`super::read`] (gathers), [`super::stats`]
//! (accounting, invariants), [`super::slots`], [`super::forward`], [`super::caching`],
//! [`super::shift`] and [`super::attend`].

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use super::groups::{Attention, LayerGroups, LayerKind};
use super::ledger::BlockLedger;
use super::seq::{SeqState, Table, NO_BLOCK};
use super::states::StateArena;
use crate::dtype::DType;
use crate::error::{check_count, check_index, check_positive, KvError, Result};
use crate::layout::BlockId;
use crate::layout::PagedShape;
use crate::prefix::PrefixIndex;
use crate::rope::Rope;
use crate::scales::{check_dtype, KvScales};
use crate::sizes;
use crate::storage::{allocate, Device, RowScales, Storage};

/// Handle of a sequence in one pool.
///
/// A handle names its pool as well as its sequence: every operation of a pool checks
/// that the handles it is given were made by that pool, so a handle of another pool is
/// refused ([`KvError::InvalidArgument`] naming it) rather than taken for the sequence
/// of the same number. A sequence's number is never reused within its pool, so a handle
/// of a freed sequence is refused too. Handles are `Copy` and keep nothing alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId {
    pool: u64,
    number: u64,
}

impl SeqId {
    /// The sequence's number in its pool: 0, 1, 2, ... in order of creation.
    pub fn number(self) -> u64 {
        self.number
    }
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number)
    }
}

/// Identities of pools, one per [`PoolCore`] made in this process.
static NEXT_POOL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How a pool caches prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Hash function of the chains.
    pub hash: crate::prefix::HashKind,
    /// Seed of every chain root.
    pub seed: u128,
    /// Whether prompts may match the beginning of a cached block.
    pub partial_hits: bool,
    /// Whether stored and removed blocks are recorded for [`PoolCore::drain_events`].
    pub events: bool,
}

/// A pool of `num_blocks` blocks of `block_size` positions for every layer of a group,
/// shared by sequences.
#[derive(Debug)]
pub struct PoolCore {
    pub(crate) shape: PagedShape,
    pub(crate) groups: LayerGroups,
    pub(crate) storage: Box<dyn Storage>,
    pub(crate) scales: KvScales,
    /// Who holds each block, its generation, the prefix index and the pins: the only
    /// way to take, share, free, cache or evict a block.
    pub(crate) blocks: BlockLedger,
    pub(crate) rope: Option<Rope>,
    pub(crate) seqs: FxHashMap<SeqId, SeqState>,
    /// This pool's identity, carried by its [`SeqId`]s.
    uid: u64,
    /// Number of the next sequence.
    next_id: u64,
    /// Offload tiers below the prefix cache ([`super::tiering`]).
    pub(crate) tiers: Option<super::tiering::TierSet>,
    /// The model whose K/V the blocks hold ([`PoolCore::with_model_id`]).
    model_id: String,
    /// The fingerprint of the model the pool serves, once bound ([`PoolCore::bind_model`]).
    model_fingerprint: Option<String>,
    /// Block copies of the operation in progress, made together by one
    /// [`Storage::copy_blocks`] when it ends ([`PoolCore::batch_copies`]); `None`
    /// outside one, when each copy is made at once.
    pending_copies: Option<Vec<(BlockId, BlockId)>>,
    /// Elements each layer's writes saturated (fp8 storages that count them:
    /// [`Storage::saturated`]), K and V together.
    pub(crate) saturated: Vec<u64>,
    /// Hybrid models' recurrent state slots ([`PoolCore::with_states`]); `None` for a
    /// pool of attention layers only.
    pub(crate) states: Option<StateArena>,
    /// The state checkpoints of a pool with state layers that caches prefixes
    /// ([`super::checkpointing`]).
    pub(crate) checkpoints: Option<super::checkpoints::CheckpointIndex>,
    /// Decode commits that cross a multiple of this take a checkpoint (0: none).
    pub(crate) checkpoint_interval: usize,
}

impl PoolCore {
    /// Allocates the whole pool (every layer full attention), zero-filled, on `device`;
    /// caches prefixes when `prefix` is given.
    pub fn new(
        shape: PagedShape,
        dtype: DType,
        device: Device,
        prefix: Option<PrefixConfig>,
    ) -> Result<Self> {
        check_layer_count(shape.num_layers)?;
        Self::with_attention(
            shape,
            Attention::full(shape.num_layers),
            dtype,
            device,
            prefix,
        )
    }

    /// Allocates the whole pool for layers of the kinds in `attention`, zero-filled, on
    /// `device`; caches prefixes when `prefix` is given.
    pub fn with_attention(
        shape: PagedShape,
        attention: Attention,
        dtype: DType,
        device: Device,
        prefix: Option<PrefixConfig>,
    ) -> Result<Self> {
        check_positive(&[
            ("num_layers", shape.num_layers),
            ("num_kv_heads", shape.num_kv_heads),
            ("head_dim", shape.head_dim),
            ("v_head_dim", shape.v_head_dim),
            ("block_size", shape.block_size),
            ("num_blocks", shape.num_blocks),
        ])?;
        check_layer_count(shape.num_layers)?;
        attention.validate(shape.num_layers)?;
        let groups = LayerGroups::new(attention);
        if shape.num_blocks > i32::MAX as usize / shape.block_size {
            return Err(KvError::InvalidArgument {
                name: "num_blocks",
                value: shape.num_blocks.to_string(),
                reason: format!(
                    "slots must fit in int32: at most {} blocks",
                    i32::MAX as usize / shape.block_size
                ),
            });
        }
        sizes::kv_bytes(
            "the pool",
            &[
                ("", groups.per_block),
                ("num_blocks", shape.num_blocks),
                ("block_size", shape.block_size),
                ("num_kv_heads", shape.num_kv_heads),
            ],
            [shape.head_dim, shape.v_head_dim],
            dtype,
        )?;
        // The bookkeeping first: a pool whose tables the host cannot hold fails before
        // its storage is allocated.
        let partial_ok = groups.all_full();
        let prefix = prefix
            .map(|p| {
                PrefixIndex::new(
                    p.hash,
                    p.seed,
                    p.partial_hits && partial_ok,
                    p.events,
                    shape.num_blocks,
                    shape.block_size,
                )
            })
            .transpose()?;
        let blocks = BlockLedger::new(shape.num_blocks, shape.block_size, prefix)?;
        let scales = KvScales::unit(shape.num_layers, shape.num_kv_heads)?;
        // The bytes fit, so the element count does.
        let numel = groups.per_block * shape.num_blocks * shape.block_elems();
        let storage = allocate(device, dtype, numel, shape.scale_unit())?;
        Ok(PoolCore {
            shape,
            groups,
            storage,
            scales,
            blocks,
            rope: None,
            seqs: FxHashMap::default(),
            uid: NEXT_POOL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            next_id: 0,
            tiers: None,
            model_id: String::new(),
            model_fingerprint: None,
            pending_copies: None,
            saturated: vec![0; shape.num_layers],
            states: None,
            checkpoints: None,
            checkpoint_interval: 0,
        })
    }

    /// Sets the fp8 scales (a new pool of an fp8 dtype; unit scales for any other).
    pub fn with_scales(mut self, scales: KvScales) -> Result<Self> {
        check_dtype(&scales, self.dtype())?;
        self.scales = scales;
        Ok(self)
    }

    /// Names the model whose K/V the pool holds. Prefix-cache files record it and load
    /// only into a pool of the same model id (the default, empty, matches only empty);
    /// [`Self::with_tiers`] sets it too.
    pub fn with_model_id(mut self, model_id: &str) -> Self {
        self.model_id = model_id.to_string();
        self
    }

    /// The model id ([`Self::with_model_id`]); empty when none was given.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Binds the pool to the model of `fingerprint` (what identifies a model's weights
    /// and configuration): the first binding is kept, a later one of the same
    /// fingerprint is a no-op, and one of another fingerprint is refused, so K/V that
    /// one model wrote are never read by another. A pool with no model id takes the
    /// fingerprint as its model id (prefix-cache files then load only into pools of the
    /// same model); an explicit model id stays as it was.
    pub fn bind_model(&mut self, fingerprint: &str) -> Result<()> {
        if fingerprint.is_empty() {
            return Err(KvError::InvalidArgument {
                name: "fingerprint",
                value: "\"\"".into(),
                reason: "a model fingerprint must not be empty".into(),
            });
        }
        match &self.model_fingerprint {
            Some(bound) if bound == fingerprint => Ok(()),
            Some(bound) => Err(KvError::InvalidArgument {
                name: "pool",
                value: format!("bound to model {bound}"),
                reason: format!(
                    "this pool holds the K/V of model {bound}, not of model {fingerprint}: \
                     another model's cached K/V would be served as this one's. Give each \
                     model its own pool (block_pool_from_config(model, ...))"
                ),
            }),
            None => {
                if self.model_id.is_empty() {
                    self.model_id = fingerprint.to_string();
                }
                self.model_fingerprint = Some(fingerprint.to_string());
                Ok(())
            }
        }
    }

    /// The fingerprint of the model the pool is bound to ([`Self::bind_model`]).
    pub fn model_fingerprint(&self) -> Option<&str> {
        self.model_fingerprint.as_deref()
    }

    /// The fp8 scales (all 1 for other dtypes).
    pub fn scales(&self) -> &KvScales {
        &self.scales
    }

    /// Elements each layer's writes have saturated since the pool was made, K and V
    /// together: values whose `x / scale` rounds past the fp8 dtype's largest finite
    /// value (448 for E4M3, 57344 for E5M2; [`crate::quant::Fp8::saturates`]:
    /// infinities included, NaN not) and was stored as it. `None` where nothing is
    /// counted: pools of other dtypes, and device pools, whose kernels encode
    /// ([`Storage::saturated`]).
    pub fn saturated(&self) -> Option<Vec<u64>> {
        self.storage.saturated().map(|_| self.saturated.clone())
    }

    /// Adds what the storage saturated since its count was `before` (taken before a
    /// write of `layer`) to the layer's count.
    pub(crate) fn count_saturated(&mut self, layer: usize, before: Option<u64>) {
        add_saturated(&mut self.saturated, &*self.storage, layer, before);
    }

    /// The per-vector scales of an int8 pool (laid out like the storage, one per head
    /// vector); `None` for other dtypes.
    pub fn row_scales(&self) -> Option<RowScales> {
        self.storage.row_scales()
    }

    /// Gives the pool the rotary embedding its keys were computed with, so that a span can
    /// be removed from the middle of a sequence (later keys are re-rotated).
    pub fn with_rope(mut self, rope: Rope) -> Result<Self> {
        rope.rotary_dim(self.shape.head_dim)?;
        self.rope = Some(rope);
        Ok(self)
    }

    /// The pool's rotary embedding, if it has one.
    pub fn rope(&self) -> Option<Rope> {
        self.rope
    }

    /// The pool's sizes and layout.
    pub fn shape(&self) -> PagedShape {
        self.shape
    }

    /// The layer kinds and how layers are grouped.
    pub fn groups(&self) -> &LayerGroups {
        &self.groups
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Device of the storage.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// Address of element 0 of the storage.
    pub fn data_ptr(&self) -> *mut u8 {
        self.storage.data_ptr()
    }

    /// The byte ranges of the storage's allocations (see [`Storage::spans`]).
    pub fn storage_spans(&self) -> Vec<crate::tensor::Span> {
        let mut spans = self.storage.spans();
        if let Some(a) = &self.states {
            spans.extend(a.spans());
        }
        spans
    }

    /// Sends the pool's later kernel launches and copies (writes, attention, block copies,
    /// state updates) to CUDA stream `stream` (a handle; `None`: kvrs's own stream of the
    /// device), in order on it: e.g. the stream a framework computes a step on, or one a
    /// CUDA graph is being captured on. The new stream waits on the device for the work
    /// queued on the previous one; the host never waits. Refused on a host pool.
    pub fn set_stream(&self, stream: Option<u64>) -> Result<()> {
        let cuda = self.storage.as_cuda().ok_or_else(|| {
            KvError::NotSupported(format!(
                "set_stream needs a pool on a CUDA device; this one is on {}",
                self.device()
            ))
        })?;
        cuda.set_stream(stream)?;
        match &self.states {
            Some(a) => a.set_stream(stream),
            None => Ok(()),
        }
    }

    /// The storage (for persistence and transfers).
    pub fn storage(&self) -> &dyn Storage {
        self.storage.as_ref()
    }

    /// The storage, for writing (loading a saved cache).
    pub(crate) fn storage_mut(&mut self) -> &mut dyn Storage {
        self.storage.as_mut()
    }

    /// Blocks in the free list (not counting evictable cached ones).
    pub(crate) fn free_block_count(&self) -> usize {
        self.blocks.num_free()
    }

    /// The prefix index, when prefix caching is on.
    pub fn prefix(&self) -> Option<&PrefixIndex> {
        self.blocks.prefix()
    }

    /// Bytes of one block id: one block of each layer of a group (int8's scales included).
    pub fn bytes_per_block(&self) -> usize {
        let sh = self.shape;
        let pair = sizes::kv_pair_bytes([sh.head_dim, sh.v_head_dim], self.dtype())
            .expect("the pool's size was checked at construction");
        self.groups.per_block * sh.block_size * sh.num_kv_heads * pair
    }

    /// Blocks that allocation can hand out: free ones plus evictable cached ones.
    pub fn num_free_blocks(&self) -> usize {
        self.blocks.num_available()
    }

    /// References to `block` (from sequences and pins).
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.blocks.refcount(block)
    }

    /// Whether `block` is in the prefix index (and so immutable).
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.blocks.is_cached(block)
    }

    /// The storage tensor of `layer`.
    pub fn tensor_of(&self, layer: usize) -> usize {
        self.groups.tensor_of[layer]
    }

    /// The group (block table) of a layer; with `None`, the only group of a pool whose
    /// layers are all full attention.
    pub fn group_for(&self, layer: Option<i64>) -> Result<usize> {
        match layer {
            Some(l) => Ok(self.groups.group_of[check_index("layer", l, self.shape.num_layers)?]),
            None if self.groups.groups.len() == 1 => Ok(0),
            None => Err(KvError::InvalidArgument {
                name: "layer",
                value: "None".into(),
                reason: format!(
                    "this pool's layers have {} block tables (layer groups); name the layer",
                    self.groups.groups.len()
                ),
            }),
        }
    }

    // ----- block life cycle -------------------------------------------------------------

    /// Takes a block for writing: a free one, else the least recently used cached one.
    /// The caller has checked [`Self::num_free_blocks`].
    pub(crate) fn take_block(&mut self) -> BlockId {
        let (b, evicted) = self
            .blocks
            .take(self.tiers.is_some())
            .expect("free blocks checked by the caller");
        if self.copy_pending(b) {
            // A batched copy still reads the block its caller will overwrite.
            self.flush_copies();
        }
        if let Some(e) = &evicted {
            self.drop_checkpoints_at(e.meta.hash);
        }
        if let Some(e) = evicted.filter(|e| self.tiers.is_some() && !e.stored) {
            // The block leaves the pool: its payload goes to the tiers (read before the
            // caller overwrites it).
            self.write_back(b, &e.meta, &e.tokens);
        }
        b
    }

    /// Adds a reference to `b`, taking it out of the eviction order if it was there.
    pub(crate) fn hold_block(&mut self, b: BlockId) {
        self.blocks.hold(b);
    }

    /// Drops a reference to `b`; an unreferenced cached block becomes evictable (most
    /// recently used), any other goes back to the free list.
    pub(crate) fn release_block(&mut self, b: BlockId) {
        self.blocks.release(b);
    }

    /// Releases blocks last first, so a freed prompt's end is evicted before its start.
    pub(crate) fn release_all(&mut self, blocks: impl DoubleEndedIterator<Item = BlockId>) {
        for b in blocks.rev() {
            if b != NO_BLOCK {
                self.release_block(b);
            }
        }
    }

    /// Copies block `src` onto block `dst` in every storage tensor: at once, or with the
    /// other copies of the operation in progress ([`Self::batch_copies`]).
    pub(crate) fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        self.blocks.copied(src, dst);
        match &mut self.pending_copies {
            Some(pending) => {
                // Copies of one batch run together: a block copied onto earlier in the
                // batch, or read by it, goes in the next batch.
                if pending
                    .iter()
                    .any(|&(s, d)| d == src || s == dst || d == dst)
                {
                    self.flush_copies();
                }
                self.pending_copies
                    .as_mut()
                    .expect("batching")
                    .push((src, dst));
            }
            None => self.copy_blocks_now(&[(src, dst)]),
        }
    }

    /// Runs `f`, making the block copies it asks for ([`Self::copy_block`]) together
    /// when it returns: one [`Storage::copy_blocks`] call (one launch on a CUDA pool)
    /// for every copy-on-write of an operation over many sequences. Inside `f` the pool
    /// must not read or write block contents other than through [`Self::take_block`]
    /// (which makes the copies first when they read the block it hands out).
    pub(crate) fn batch_copies<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        if self.pending_copies.is_some() {
            return f(self);
        }
        self.pending_copies = Some(Vec::new());
        let r = f(self);
        self.flush_copies();
        self.pending_copies = None;
        r
    }

    /// Whether a batched copy still reads or writes block `b`.
    fn copy_pending(&self, b: BlockId) -> bool {
        self.pending_copies
            .as_ref()
            .is_some_and(|p| p.iter().any(|&(s, d)| s == b || d == b))
    }

    /// Makes the batched copies (the batch goes on, empty).
    fn flush_copies(&mut self) {
        let pairs = self
            .pending_copies
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        if !pairs.is_empty() {
            self.copy_blocks_now(&pairs);
        }
    }

    /// Copies blocks `(src, dst)` in every storage tensor. They are the pool's own
    /// blocks, so this fails only when the device itself has failed (a CUDA context that
    /// can no longer launch), which no state of the pool can recover from.
    fn copy_blocks_now(&mut self, pairs: &[(BlockId, BlockId)]) {
        self.storage
            .copy_blocks(self.shape, self.groups.per_block, pairs)
            .expect("copying blocks within the pool's storage: the device failed");
    }

    // ----- sequences --------------------------------------------------------------------

    pub(crate) fn empty_state(
        &self,
        root: crate::prefix::BlockHash,
        extra: std::sync::Arc<[u8]>,
    ) -> SeqState {
        SeqState {
            tables: smallvec::smallvec![Table::default(); self.groups.groups.len()],
            layer_len: vec![0; self.shape.num_layers],
            seq_len: 0,
            tokens: Vec::new(),
            hashes: Vec::new(),
            root,
            extra,
            num_cached_tokens: 0,
            tier_tokens: Default::default(),
            cache_limit: usize::MAX,
            claimed_from: usize::MAX,
            edits: 0,
            state_slot: None,
            prompt_len: 0,
            checkpoints: SmallVec::new(),
            branch: None,
        }
    }

    /// Adds a sequence; in a pool with state layers it takes a zeroed state slot when one
    /// is free (callers check [`Self::check_state_room`] first).
    pub(crate) fn insert(&mut self, mut s: SeqState) -> SeqId {
        if let Some(a) = &mut self.states {
            s.state_slot = a.take();
        }
        let id = SeqId {
            pool: self.uid,
            number: self.next_id,
        };
        self.next_id += 1;
        self.seqs.insert(id, s);
        id
    }

    /// Starts an empty sequence that tracks no tokens. In a pool with state layers it
    /// takes a state slot: call [`Self::check_state_room`] first (a sequence started with
    /// every slot held has none, and its state cannot be read or written).
    pub fn new_sequence(&mut self) -> SeqId {
        let root = self.prefix().map_or(0, |p| p.root(b""));
        let s = self.empty_state(root, std::sync::Arc::from(&[][..]));
        self.insert(s)
    }

    /// The state of a live sequence.
    pub fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.check_owner(id)?;
        self.seqs.get(&id).ok_or_else(|| freed(id))
    }

    /// Fails unless `id` was made by this pool.
    pub(crate) fn check_owner(&self, id: SeqId) -> Result<()> {
        if id.pool != self.uid {
            return Err(KvError::InvalidArgument {
                name: "seq",
                value: format!("sequence {id}"),
                reason: "belongs to another pool; give each pool the handles it returned".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn seq_mut(&mut self, id: SeqId) -> &mut SeqState {
        self.seqs.get_mut(&id).expect("checked live")
    }

    /// Whether `id` is a live sequence.
    pub fn is_live(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Ids of every live sequence.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Releases a sequence's blocks (last first) and forgets it.
    pub fn free_sequence(&mut self, id: SeqId) -> Result<()> {
        self.check_owner(id)?;
        let s = self.seqs.remove(&id).ok_or_else(|| freed(id))?;
        for t in &s.tables {
            self.release_all(t.blocks.iter().copied());
        }
        self.release_checkpoints(&s.checkpoints);
        if let (Some(a), Some(slot)) = (&mut self.states, s.state_slot) {
            a.release(slot);
        }
        Ok(())
    }

    /// Frees every live sequence not in `keep`.
    pub fn keep(&mut self, keep: &[SeqId]) -> Result<()> {
        for &id in keep {
            self.seq(id)?;
        }
        let keep: FxHashSet<SeqId> = keep.iter().copied().collect();
        let drop: Vec<SeqId> = self
            .seqs
            .keys()
            .copied()
            .filter(|id| !keep.contains(id))
            .collect();
        for id in drop {
            self.free_sequence(id)?;
        }
        Ok(())
    }

    /// A new sequence sharing every block of `id` (no copy); its recurrent state, in a
    /// pool with state layers, is a copy of `id`'s.
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId> {
        let mut s = self.seq(id)?.clone();
        self.check_state_room(1, || format!("forking sequence {id}"))?;
        let src_slot = s.state_slot.take();
        s.num_cached_tokens = 0;
        for b in s.all_blocks().collect::<Vec<_>>() {
            self.hold_block(b);
        }
        let held = s.checkpoints.clone();
        self.hold_checkpoints(&held);
        let new = self.insert(s);
        if let (Some(a), Some(src), Some(dst)) = (
            &mut self.states,
            src_slot,
            self.seqs.get(&new).and_then(|s| s.state_slot),
        ) {
            a.copy(src, dst);
        }
        Ok(new)
    }

    /// Makes `dst` hold the first `n` committed positions of `src`, sharing their blocks
    /// (llama.cpp's `seq_cp`, ollama's `CopyPrefix`); `dst`'s previous content is released.
    pub fn copy_prefix(&mut self, src: SeqId, dst: SeqId, n: i64) -> Result<()> {
        let n = check_count("n", n)?;
        let s = self.seq(src)?;
        let d = self.seq(dst)?;
        if src == dst {
            return Err(KvError::InvalidArgument {
                name: "dst",
                value: format!("sequence {dst}"),
                reason: "must differ from src".into(),
            });
        }
        if n > s.seq_len {
            return Err(KvError::InvalidArgument {
                name: "n",
                value: n.to_string(),
                reason: format!("src has only {} committed positions", s.seq_len),
            });
        }
        if n > 0 && (s.root != d.root || s.extra != d.extra) {
            return Err(KvError::InvalidArgument {
                name: "dst",
                value: format!("sequence {dst}"),
                reason: format!(
                    "has another namespace or extra_key than src (sequence {src}): \
                     K/V are shared only within one namespace and extra key"
                ),
            });
        }
        // The state at n: src's own, or a checkpoint's (refused when n has none).
        let restore = self.restore_for(src, n, "copy_prefix")?;
        let (s, d) = (self.seq(src)?, self.seq(dst)?);
        let (src_slot, dst_slot) = (s.state_slot, d.state_slot);
        let bs = self.shape.block_size;
        let mut copy = s.clone();
        copy.state_slot = dst_slot;
        // dst keeps its identity (namespace, extra key) and its edit count, moved on.
        copy.root = d.root;
        copy.extra = d.extra.clone();
        copy.edits = d.edits + 1;
        copy.hashes.truncate(n / bs);
        copy.tokens.truncate(n);
        copy.layer_len.fill(n);
        copy.seq_len = n;
        copy.num_cached_tokens = 0;
        copy.tier_tokens.clear();
        // Every position of the copy is committed: no reserved claim is left.
        copy.claimed_from = usize::MAX;
        copy.checkpoints.retain(|&mut (p, _)| p <= n);
        copy.branch = None;
        for t in &mut copy.tables {
            t.start = t.start.min(n);
            let start = t.start;
            cut_table(t, start, n, bs);
        }
        for b in copy.all_blocks().collect::<Vec<_>>() {
            self.hold_block(b);
        }
        let held = copy.checkpoints.clone();
        self.hold_checkpoints(&held);
        let old = std::mem::replace(self.seq_mut(dst), copy);
        for t in &old.tables {
            self.release_all(t.blocks.iter().copied());
        }
        self.release_checkpoints(&old.checkpoints);
        if let (Some(a), Some(from), Some(to)) = (&mut self.states, src_slot, dst_slot) {
            a.copy(from, to);
        }
        self.apply_restore(dst, restore);
        self.trim(dst);
        Ok(())
    }

    /// Sets every entry of `g`'s table that covers none of its held positions to
    /// [`NO_BLOCK`] and drops entries past them, releasing those blocks.
    pub(crate) fn normalize_table(&mut self, id: SeqId, g: usize) {
        let bs = self.shape.block_size;
        let held = self
            .seq(id)
            .expect("checked live")
            .held_by(&self.groups.groups[g].layers);
        let t = &mut self.seq_mut(id).tables[g];
        t.start = t.start.min(held);
        let start = t.start;
        let dropped = cut_table(t, start, held, bs);
        self.release_all(dropped.into_iter());
    }

    /// Releases the blocks of sliding and chunked groups that no future token of `id`
    /// sees (and that lie behind the sliding layers' `swa_memory`).
    pub(crate) fn trim(&mut self, id: SeqId) {
        let bs = self.shape.block_size;
        for g in 0..self.groups.groups.len() {
            let kind = self.groups.groups[g].kind;
            if kind == LayerKind::Full {
                continue;
            }
            let keep = self
                .groups
                .attention
                .keep_from(kind, self.seq(id).expect("checked live").seq_len);
            let t = &mut self.seq_mut(id).tables[g];
            t.start = t.start.max(keep / bs * bs);
            self.normalize_table(id, g);
        }
    }

    /// Whether the cache holds everything needed to continue sequence `id` at `pos`
    /// (after dropping the positions from `pos` on), for every layer (ollama's `CanResume`).
    pub fn can_resume(&self, id: SeqId, pos: i64) -> Result<bool> {
        let pos = check_count("pos", pos)?;
        let s = self.seq(id)?;
        if pos > s.seq_len {
            return Ok(false);
        }
        Ok(self
            .groups
            .groups
            .iter()
            .zip(&s.tables)
            .all(|(g, t)| self.window_held(g.kind, t, pos)))
    }

    /// Whether a table starting at `t.start` holds what a token at `pos` of `kind` sees
    /// before itself.
    pub(crate) fn window_held(&self, kind: LayerKind, t: &Table, pos: usize) -> bool {
        let first = self.groups.attention.first_visible(kind, pos);
        first >= pos || t.start <= first
    }
}

/// Cuts table `t` to the entries covering held positions `start..held`: later entries are
/// dropped and earlier ones become [`NO_BLOCK`]; returns the blocks taken out.
pub(crate) fn cut_table(t: &mut Table, start: usize, held: usize, bs: usize) -> Vec<BlockId> {
    let mut out: Vec<BlockId> = t
        .blocks
        .drain(held.div_ceil(bs).min(t.blocks.len())..)
        .collect();
    for i in 0..t.blocks.len() {
        if (i * bs).max(start) >= ((i + 1) * bs).min(held) && t.blocks[i] != NO_BLOCK {
            out.push(std::mem::replace(&mut t.blocks[i], NO_BLOCK));
        }
    }
    out.retain(|&b| b != NO_BLOCK);
    out
}

/// Layers a pool may have: far more than any model, few enough that per-layer
/// bookkeeping is always allocatable.
pub const MAX_LAYERS: usize = 1 << 16;

/// Checks that `num_layers` is at most [`MAX_LAYERS`].
pub fn check_layer_count(num_layers: usize) -> Result<()> {
    if num_layers > MAX_LAYERS {
        return Err(KvError::InvalidArgument {
            name: "num_layers",
            value: num_layers.to_string(),
            reason: format!("must be <= {MAX_LAYERS}"),
        });
    }
    Ok(())
}

pub(crate) fn freed(id: SeqId) -> KvError {
    KvError::InvalidArgument {
        name: "seq",
        value: format!("sequence {id}"),
        reason: "was freed".into(),
    }
}

/// Adds what `storage` saturated since its count was `before` to `counts[layer]`
/// ([`PoolCore::count_saturated`], for callers that hold other borrows of the pool).
pub(crate) fn add_saturated(
    counts: &mut [u64],
    storage: &dyn Storage,
    layer: usize,
    before: Option<u64>,
) {
    if let (Some(before), Some(now)) = (before, storage.saturated()) {
        counts[layer] += now - before;
    }
}
