//! Internals with no stability promise: the dtype-erased cores that the Python bindings
//! (the `kvrs-python` crate, `bindings/python`) are written over ([`PoolCore`],
//! [`CacheCore`]: raw strided tensors of any dtype, CUDA devices, slot mappings and page
//! tables, batched forwards, persistence), with the argument checks, sizes and strided
//! copies they share with the core, and the storage backends and kernel entry points,
//! re-exported for the bindings and for this crate's own tests, benches and tools.
//!
//! Nothing here is part of the supported API (the crate root and [`crate::tier`]): any
//! release may change or remove it, and it is hidden from the documentation. A program
//! that uses it pins kvrs to an exact version. `BlockPool::core`, `BlockPool::core_mut`
//! and `KvCache::core` (hidden too) hand out the cores of the typed API's values.
//!
//! The bindings crate's view of the core is the crate root, [`crate::tier`] and, from
//! here: the cores ([`PoolCore`] with [`LayerGroups`], [`StateConfig`], [`ForwardPlan`],
//! [`PlanMask`] and [`MaskInput`]; [`CacheCore`] and [`CacheShape`]; [`EncoderCache`];
//! [`Rope`]); the tensors it hands them ([`TensorRef`], [`TensorMut`], [`Span`],
//! [`copy_strided`], [`Storage`], [`cuda`]); and the checks every Python argument goes
//! through, so that its messages are the core's ([`check_index`], [`check_count`],
//! [`check_size`], [`check_layer_count`], [`parse_size`], [`sizes`]).

pub use crate::attention::{
    segment_packbits, set_simd_level, simd_level, simd_levels, CustomMask, KvHeads,
};
pub use crate::bytes::parse_size;
pub use crate::dtype::convert_contiguous;
pub use crate::encoder_cache::EncoderCache;
pub use crate::error::{check_count, check_index, check_size};
pub use crate::kv_cache::{CacheCore, CacheShape};
pub use crate::layout::{BlockId, Region};
pub use crate::paged::caching::prompt_limit;
pub use crate::paged::pool::{check_layer_count, MAX_LAYERS};
pub use crate::paged::{BlockAllocator, ForwardPlan, LayerGroups, PoolCore, SeqState};
pub use crate::paged::{MaskInput, PlanMask, StateConfig, StateSpec, Table, NO_BLOCK};
pub use crate::prefix::persist::read_file;
pub use crate::prefix::BlockHash;
pub use crate::quant::{dequantize_row_i8, quantize_row_i8, Fp8};
pub use crate::rope::{Rope, RopeStyle};
pub use crate::storage::{allocate, PagedTensor, Storage};
pub use crate::tensor::{copy_strided, Span, TensorMut, TensorRef, MAX_RANK};
pub use crate::tier::writer::{DEFAULT_QUEUE_BYTES, DROP_DEADLINE};

/// Checked sizes: products within the address space, and bookkeeping vectors allocated
/// fallibly (an [`OutOfMemory`](crate::KvError::OutOfMemory) error, not an abort).
pub mod sizes {
    pub use crate::sizes::{filled, int8_scale_unit, kv_bytes, product, with_capacity};
}

/// The CUDA backend's device operations (on the simulated device with `cuda-sim`).
pub mod cuda {
    pub use crate::storage::cuda::gpu::{Args, DevicePtr, Gpu};
    #[cfg(feature = "cuda-sim")]
    pub use crate::storage::cuda::sim_launches;
    pub use crate::storage::cuda::{device_count, gpu_for, CudaStorage, SWAP_CHUNK};
}

/// The offload tiers' block payloads: keys, MACs, encoding and checks.
pub mod payload {
    pub use crate::tier::payload::{begin, decode, fingerprint, seal};
    pub use crate::tier::payload::{BlockMeta, PayloadShape, TierKey};
}

/// The offload tiers' checkpoint payloads: a hybrid model's recurrent state beside its blocks.
pub mod checkpoint_payload {
    pub use crate::tier::checkpoint_payload::{checkpoint_key, state_range};
}
